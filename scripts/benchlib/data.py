"""Benchmark inputs: GSM8K prompts and texts (read at run time through gear_hf.gsm8k; no dataset text in the repo),
fixed-length batches, and the models by name."""

from __future__ import annotations

from pathlib import Path

import torch

from gear_hf import gsm8k
from gear_hf.weights import load_model as load_model_spec


def data_dir() -> Path:
    """$GEAR_HF_DATA_DIR, else ../shared/data of this checkout (gear_hf.gsm8k.default_data_dir)."""
    found = gsm8k.default_data_dir()
    if found is None:
        raise SystemExit(f"GSM8K data not found: set ${gsm8k.DATA_DIR_ENV} to a directory with gsm8k/{{train,test}}.jsonl")
    return found


def gsm8k_prompts(n: int, shots: int = 8):
    """The first n GSM8K test problems as 8-shot CoT prompts (gear_hf.gsm8k) with their gold answers."""
    return gsm8k.problems(data_dir(), shots=shots, limit=n)


def long_text(min_chars: int = 40000) -> str:
    """A long natural text for prefill lengths: GSM8K train problems with worked answers, concatenated."""
    return gsm8k.train_text(min_chars, data_dir())


def gsm8k_text(index: int = 0) -> str:
    """Test problem `index` as an 8-shot prompt followed by its worked answer (teacher-forced measurements)."""
    return gsm8k.solved_text(data_dir(), index)


def load_model(name: str, dtype: str = "bfloat16"):
    """A model by name (smollm2, qwen25, a .gguf file or a HF directory), GGUF conversions snapshotted."""
    return load_model_spec(name, getattr(torch, dtype), snapshot=True)


def fixed_length_batch(tokenizer, prompts: list[str], length: int, batch: int) -> torch.Tensor:
    """[batch, length] ids: the last `length` tokens of each prompt (cycled), so rows need no padding and every
    row ends where its question asks for an answer."""
    rows = []
    for i in range(batch):
        ids = tokenizer(prompts[i % len(prompts)], return_tensors="pt").input_ids[0]
        if ids.shape[0] < length:
            filler = tokenizer(long_text(length * 8), return_tensors="pt").input_ids[0]
            ids = torch.cat([filler[: length - ids.shape[0]], ids])
        rows.append(ids[-length:])
    return torch.stack(rows)
