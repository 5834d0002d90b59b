"""GearConfig() works on every head_dim the patches accept. key_bits=3.125 times a head_dim that is not
a multiple of 8 is not a whole number of bits: a head's budget is rounded down (compress/allocation.py), and
summary() says so."""

from __future__ import annotations

import pytest
import torch

import gear_hf
from gear_hf.compress.allocation import allocate_channel_bits, allocated_mean_bits, even_channel_bits, head_bit_budget
from tiny_models import tiny_model

HEAD_DIMS = (20, 24, 36, 40, 48, 72, 80, 96, 112, 128, 160, 256)


@pytest.mark.parametrize("mean,d,total", [(3.125, 20, 62), (3.125, 36, 112), (3.125, 24, 75), (3.375, 20, 67),
                                          (3.375, 22, 74), (3.5, 20, 70), (1, 20, 20), (8, 20, 160)])
def test_a_heads_budget_is_rounded_down_to_whole_bits(mean, d, total):
    assert head_bit_budget(mean, d) == total
    assert allocated_mean_bits(mean, d) == total / d <= mean
    weight = torch.rand(2, 3, d, dtype=torch.float64)
    bits = allocate_channel_bits(weight, torch.randn(2, 3, 16, d), 8, mean)
    assert (bits.long().sum(dim=-1) == total).all() and bits.min() >= 1 and bits.max() <= 8
    assert (even_channel_bits(2, 3, d, mean).long().sum(dim=-1) == total).all()  # sizing probes agree


@pytest.mark.parametrize("mean", [0.5, 9, True])
def test_a_mean_outside_the_widths_is_refused(mean):
    with pytest.raises(ValueError, match="cannot allocate a mean of"):
        head_bit_budget(mean, 20)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_default_generates_on_every_head_dim(head_dim):
    """Tiny random Llama (GQA 4/2) with this head_dim: GearConfig() compresses a prompt chunk and a decode chunk."""
    config = gear_hf.GearConfig()
    model = tiny_model("llama3", head_dim=head_dim, layers=1)
    prompt = config.sink_tokens + config.prompt_granule + 3
    ids = torch.randint(3, 100, (1, prompt), generator=torch.Generator().manual_seed(head_dim))
    gear_hf.enable(model, config)
    new = config.buffer_size + 2  # past one buffer flush: a decode chunk too
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, prompt + new)
    cache = gear_hf.last_cache(model)
    report = cache.memory_report()
    assert report["codes"] > 0 and report["key_bits_allocated"] == allocated_mean_bits(config.key_bits, head_dim)
    note = "keys allocated"
    if head_bit_budget(config.key_bits, head_dim) != config.key_bits * head_dim:  # (2.875 x 20 channels: 57.5)
        assert f"rounded down to {head_bit_budget(config.key_bits, head_dim)} bits per head" in cache.summary()
    else:
        assert note not in cache.summary()
