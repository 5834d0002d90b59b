"""The paged CPU attention (`gear_hf.kernels.cpu.paged`, what gear_hf.vllm's backend runs) against the torch oracle:
pages written by the vLLM page format (`gear_hf.vllm.format.PageFormat`, needs no vllm), decoded by
`gear_hf.compress`, keys rotated by `apply_rotary`, attention in float64, causal per request. Requests mix pages,
exact tail slots and closing blocks, decode (one query token) and prefill chunks longer than a query tile."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from gear_hf.compress.rope import apply_rotary, rope_tables  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402
from gear_hf.kernels.cpu import paged, threads  # noqa: E402
from gear_hf.vllm.format import PageFormat  # noqa: E402

CONFIGS = {"default": GearConfig(), "gear-2": GearConfig.preset("gear-2"), "kivi-4": GearConfig.preset("kivi-4"),
           "smallest": GearConfig.recommended(name="smallest")}


def _bits(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _case(config, dtype, rotated, bs=16, d=64, H=2, G=3, lens=(40, 16, 70, 33), queries=(1, 16, 21, 1), seed=0):
    """(kernel output [T, Hq, d], oracle output [T, Hq, d] float64)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = PageFormat(config, bs, d, dtype)
    blocks = sum(L // bs for L in lens) + 3  # (+ pages no request reads)
    pages = fmt.encode(torch.randn(blocks, H, bs, d, generator=gen).to(dtype),
                       torch.randn(blocks, H, bs, d, generator=gen).to(dtype))
    decoded_k, decoded_v = fmt.decode(pages, torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(torch.arange(max(lens)), inv_freq)
    tails, closing = [], []  # exact blocks: (keys [bs, H, d], values)
    slots = 5  # tail slots (some unused)
    table = np.zeros((len(lens), max(-(-L // bs) for L in lens)), dtype=np.int64)
    queries_all, expected, starts, page = [], [], [0], 3
    for r, (L, n) in enumerate(zip(lens, queries)):
        before = L - n
        keys, values = [], []
        for j in range(-(-L // bs)):
            if (j + 1) * bs <= before:  # closed: a page
                table[r, j] = page
                k = decoded_k[page]
                if rotated:
                    k = apply_rotary(k, cos[None, j * bs:(j + 1) * bs], sin[None, j * bs:(j + 1) * bs])
                keys.append(k)
                values.append(decoded_v[page])
                page += 1
                continue
            k = torch.randn(bs, H, d, generator=gen).to(dtype)
            v = torch.randn(bs, H, d, generator=gen).to(dtype)
            if (j + 1) * bs <= L:  # closes this step
                table[r, j] = -1 - (slots + len(closing))
                closing.append((k, v))
            else:
                table[r, j] = -1 - len(tails)
                tails.append((k, v))
            keys.append(k.transpose(0, 1).float())
            values.append(v.transpose(0, 1).float())
        K, V = torch.cat(keys, 1)[:, :L].double(), torch.cat(values, 1)[:, :L].double()  # [H, L, d]
        q = torch.randn(n, H * G, d, generator=gen)
        scores = torch.einsum("qhd,hkd->hqk", q.double(), K.repeat_interleave(G, 0)) / math.sqrt(d)
        scores = scores.masked_fill(torch.arange(L)[None, :] > (before + torch.arange(n))[:, None], float("-inf"))
        expected.append(torch.einsum("hqk,hkd->qhd", scores.softmax(-1), V.repeat_interleave(G, 0)))
        queries_all.append(q)
        starts.append(starts[-1] + n)
    while len(tails) < slots:
        tails.append((torch.zeros(bs, H, d, dtype=dtype),) * 2)
    stack = [torch.stack([t[i] for t in group]) if group else torch.zeros(0, bs, H, d, dtype=dtype)
             for group in (tails, closing) for i in (0, 1)]
    q = torch.cat(queries_all).float() / math.sqrt(d)
    halves = (cos[:, : d // 2].contiguous().numpy(), sin[:, : d // 2].contiguous().numpy()) if rotated else \
        (np.zeros((0, 0), np.float32),) * 2
    layouts = [paged.page_layout(spec, tuple((name, *where) for name, where in layout.items()), bs, d)
               for spec, layout in zip(fmt.specs, fmt.layout)]
    out = np.full((q.shape[0], H * G, d), np.nan, dtype=np.float32)
    paged.paged_attention(q.numpy(), np.asarray(starts, np.int64), np.asarray(lens, np.int64), table, bs, *halves,
                          pages.numpy(), *layouts, *map(_bits, stack), slots, out)
    return out, torch.cat(expected)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_equals_the_oracle(name, dtype):
    out, expected = _case(CONFIGS[name], dtype, rotated=True)
    assert np.isfinite(out).all()
    assert (torch.from_numpy(out).double() - expected).abs().max() < 2e-5


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
