"""The shared attention forward's own pieces against HF's functions."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from gear_hf.attention import apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3, 1, 64), (2, 5, 37, 128), (3, 2, 19, 80)])
def test_apply_rotary_is_hf_apply_rotary_pos_emb_bit_for_bit(dtype, shape):
    """The reference path rotates the whole key history every step with its own (cheaper) formulation: it must
    give exactly HF's values, or the fp16 preset would drift from stock."""
    B, H, T, d = shape
    g = torch.Generator().manual_seed(T * d)
    x = (torch.randn(B, H, T, d, generator=g) * 7).to(dtype)
    angles = torch.rand(B, T, d // 2, generator=g) * 500  # large positions: cos/sin far from 0/1
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert torch.equal(apply_rotary(x, cos, sin), expected)
    assert torch.equal(apply_rotary(x, cos, sin, out=torch.empty_like(x)), expected)  # into a workspace
    scratch = torch.full((B, H, T, d // 2), float("nan"), dtype=dtype)  # the half products' workspace
    assert torch.equal(apply_rotary(x, cos, sin, out=torch.empty_like(x), scratch=scratch), expected)
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)  # shared by the layers of a step, already over the heads axis
    assert torch.equal(apply_rotary(x, cos4, sin4, out=torch.empty_like(x), scratch=scratch), expected)
