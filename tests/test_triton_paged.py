"""The paged Triton attention (`gear_hf.kernels.triton.paged`, what gear_hf.vllm's GPU backend runs) against the
torch oracle on the scenarios of `paged_case` (on the GPU when there is one, else under TRITON_INTERPRET=1). Every
shipped page format: widths per channel with 8-bit value statistics (GearConfig()), outliers and int8 low-rank
factors (gear-2), plain 4-bit (kivi-4), values stored per channel and rotated (smallest), and the raw fp16 format."""

from __future__ import annotations

import math

import pytest
import torch
from paged_case import paged_case

from gear_hf.config import GearConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (scripts/gpu_check.sh runs this file on the GPU)
CONFIGS = {"default": GearConfig(), "gear-2": GearConfig.preset("gear-2"), "kivi-4": GearConfig.preset("kivi-4"),
           "smallest": GearConfig.recommended(name="smallest")}


def _run(config, dtype, rotated, device=DEVICE, **shape):
    from gear_hf.kernels.triton import paged

    c = paged_case(config, dtype, rotated, **shape, query_dtype=dtype)  # (the oracle's query: the kernel's, rounded)
    bs, d = c.fmt.block_size, c.fmt.head_size
    streams = (None, None) if c.fmt.raw else [
        paged.page_stream(spec, tuple((name, *where) for name, where in layout.items()), bs, d, keys)
        for spec, layout, keys in zip(c.fmt.specs, c.fmt.layout, (True, False))]
    counts = [b - a for a, b in zip(c.starts, c.starts[1:])]
    query = c.query.to(dtype).to(device)
    out = torch.full(tuple(query.shape), float("nan"), device=device)  # (float32: the kernel's own precision)
    int32 = dict(dtype=torch.int32, device=device)
    sinks = {} if c.sink_k is None else dict(sink_slot=c.sink_slot.to(**int32), sink_k=c.sink_k.to(device),
                                              sink_v=c.sink_v.to(device))
    paged.paged_attention(query, torch.tensor(c.starts, **int32), torch.tensor(c.lens, **int32),
                          c.table.to(**int32), bs, max(counts), c.pages.to(device), *streams,
                          *(t.to(device) for t in (c.tail_k, c.tail_v, c.close_k, c.close_v)), c.slots, out,
                          scale=1 / math.sqrt(d), inv_freq=c.inv_freq if rotated else None, **sinks)
    return out.cpu().double(), c.expected


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_triton_equals_the_oracle(name):
    out, expected = _run(CONFIGS[name], torch.bfloat16, rotated=True)
    assert torch.isfinite(out).all()
    assert (out - expected).abs().max() < 2e-5


def test_float32_and_raw_pages():
    out, expected = _run(CONFIGS["gear-2"], torch.float32, rotated=True, bs=32, lens=(97, 48, 5), queries=(1, 20, 5))
    assert (out - expected).abs().max() < 2e-5
    out, expected = _run(GearConfig.preset("fp16"), torch.float32, rotated=False)
    assert (out - expected).abs().max() < 2e-5


def test_exact_sinks_replace_the_pages_first_tokens():
    """Requests whose block 0 is a page attend their first 4 tokens from a sink slot (low-rank values and rotated
    values included: the page's copies of those rows add nothing)."""
    for name in ("default", "gear-2", "smallest"):
        out, expected = _run(CONFIGS[name], torch.float32, rotated=True, sinks=4, seed=3)
        assert (out - expected).abs().max() < 2e-5, name


def test_keys_stored_after_rope_and_odd_shapes():
    """Keys stored as they arrive (no rotation), head_dim 32, one KV head shared by 5 query heads, block 32."""
    config = GearConfig.preset("gear-2", pre_rope=False)
    out, expected = _run(config, torch.float32, rotated=False, bs=32, d=32, H=1, G=5, lens=(97, 48, 5),
                         queries=(1, 40, 5), seed=1)
    assert (out - expected).abs().max() < 2e-5


def test_float16_models_side_information_in_fp16():
    """An fp16 model's pages hold their statistics and outliers in fp16 (read as such); dots take fp16 operands."""
    for name in ("default", "gear-2"):
        out, expected = _run(CONFIGS[name], torch.float16, rotated=True, bs=32, lens=(97, 48, 5), queries=(1, 20, 5))
        assert (out - expected).abs().max() < 3e-3
