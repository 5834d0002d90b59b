"""The `fp16` preset goes through the whole GEAR path (pre-RoPE storage, row-local layout, re-rotation at
read) without compressing: it must reproduce stock transformers exactly."""

from __future__ import annotations

import pytest
import torch

import gear_hf
from tiny_models import ARCHS, NEW_ARCHS, greedy, prompts, tiny_model, tiny_model_or_skip

pytestmark = pytest.mark.compat
STEPS = 24


@pytest.mark.parametrize("batch", [1, 3], ids=["single", "left-padded-3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_fp16_preset_matches_stock(arch, attn, dtype, batch):
    model = tiny_model_or_skip(arch, attn, dtype)
    ids, mask = prompts(batch)
    stock_tokens, stock_logits = greedy(model, ids, mask, STEPS)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        tokens, logits = greedy(model, ids, mask, STEPS)
        cache = gear_hf.last_cache(model)
    assert isinstance(cache, gear_hf.GearCache)
    assert cache.get_seq_length() == ids.shape[1] + STEPS - 1  # the cache really grew every step
    assert torch.equal(tokens, stock_tokens)
    assert torch.equal(logits, stock_logits)  # sliding layers see exactly the window stock keeps


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_prompt_longer_than_buffer_through_compressing_layout(arch):
    """A compressing config with 8-bit everything still runs the full layout; sanity bound on drift."""
    model = tiny_model(arch)
    ids, mask = prompts(3, length=40)
    stock_tokens, stock_logits = greedy(model, ids, mask, 20)
    config = gear_hf.GearConfig.preset("kivi", bits=8, group_size=8, buffer_size=8)
    with gear_hf.enabled(model, config):
        _, logits = greedy(model, ids, mask, 1)
    assert (logits[:, 0] - stock_logits[:, 0]).abs().max() < 0.05
