"""The paged CPU attention (`gear_hf.kernels.cpu.paged`, what gear_hf.vllm's backend runs) against the torch oracle
on the scenarios of `paged_case`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from paged_case import paged_case  # noqa: E402

from gear_hf.config import GearConfig  # noqa: E402
from gear_hf.kernels.cpu import paged, threads  # noqa: E402

CONFIGS = {"default": GearConfig(), "gear-2": GearConfig.preset("gear-2"), "kivi-4": GearConfig.preset("kivi-4"),
           "smallest": GearConfig.recommended(name="smallest")}


def _bits(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _case(config, dtype, rotated, **shape):
    """(kernel output [T, Hq, d], oracle output [T, Hq, d] float64)."""
    c = paged_case(config, dtype, rotated, **shape)
    bs, d = c.fmt.block_size, c.fmt.head_size
    q = c.query / math.sqrt(d)
    halves = (c.cos[:, : d // 2].contiguous().numpy(), c.sin[:, : d // 2].contiguous().numpy()) if rotated else \
        (np.zeros((0, 0), np.float32),) * 2
    layouts = [paged.page_layout(spec, tuple((name, *where) for name, where in layout.items()), bs, d)
               for spec, layout in zip(c.fmt.specs, c.fmt.layout)]
    out = np.full(tuple(q.shape), np.nan, dtype=np.float32)
    sinks = () if c.sink_k is None else (c.sink_slot.numpy(), _bits(c.sink_k), _bits(c.sink_v))
    paged.paged_attention(q.numpy(), np.asarray(c.starts, np.int64), np.asarray(c.lens, np.int64), c.table.numpy(),
                          bs, *halves, c.pages.numpy(), *layouts,
                          *map(_bits, (c.tail_k, c.tail_v, c.close_k, c.close_v)), c.slots, out, *sinks)
    return out, c.expected


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_equals_the_oracle(name, dtype):
    out, expected = _case(CONFIGS[name], dtype, rotated=True)
    assert np.isfinite(out).all()
    assert (torch.from_numpy(out).double() - expected).abs().max() < 2e-5


def test_one_compiled_kernel_serves_float32_and_bf16_models():
    """The exact blocks (tails, closing blocks, sinks) are read as their bytes: a page format's kernel signature is
    the same for a float32 and a bf16 model (one compile each, not two); other dtypes are named as not read."""
    _case(CONFIGS["default"], torch.float32, rotated=True, sinks=4, seed=3)
    compiled = set(paged._paged_pairs.signatures) | set(paged._paged_parallel.signatures)
    _case(CONFIGS["default"], torch.bfloat16, rotated=True, sinks=4, seed=3)
    assert set(paged._paged_pairs.signatures) | set(paged._paged_parallel.signatures) == compiled
    with pytest.raises(ValueError, match="dtype float16"):
        paged._exact_bytes(np.zeros((1, 4, 2, 8), np.float16), 8)
    with pytest.raises(ValueError, match=r"heads, 16\]"):
        paged._exact_bytes(np.zeros((1, 4, 2, 8), np.float32), 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_sinks_replace_the_pages_first_tokens(dtype):
    """Requests whose block 0 is a page attend their first 4 tokens from a sink slot (low-rank values and rotated
    values included: the page's copies of those rows add nothing)."""
    for name in ("default", "gear-2", "smallest"):
        out, expected = _case(CONFIGS[name], dtype, rotated=True, sinks=4, seed=3)
        assert (torch.from_numpy(out).double() - expected).abs().max() < 2e-5, name


def test_keys_stored_after_rope_and_odd_shapes():
    """Keys stored as they arrive (no rotation), head_dim 32, one KV head shared by 5 query heads, block 32."""
    config = GearConfig.preset("gear-2", pre_rope=False)
    out, expected = _case(config, torch.bfloat16, rotated=False, bs=32, d=32, H=1, G=5, lens=(97, 48, 5),
                          queries=(1, 40, 5), seed=1)
    assert (torch.from_numpy(out).double() - expected).abs().max() < 2e-5


def test_threads_give_the_same_bits(monkeypatch):
    serial, _ = _case(CONFIGS["default"], torch.bfloat16, rotated=True, seed=2)
    monkeypatch.setattr(threads, "parts", lambda shares: min(2, shares))
    split, _ = _case(CONFIGS["default"], torch.bfloat16, rotated=True, seed=2)
    assert np.array_equal(serial, split)
