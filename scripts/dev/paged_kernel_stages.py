"""One decode step of one layer of gear_hf.vllm's CPU paged attention, against stock CPU_ATTN over the same lengths,
and where the paged kernel's time goes, stage by stage (ms per layer, 1 thread).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python scripts/dev/paged_kernel_stages.py [--config gear-2] [--requests 16]

The serving step of the throughput benchmark's workload: SmolLM2 attention shapes (9 query heads, 3 KV heads,
head_dim 64), bf16, `--requests` requests of ~700-800 tokens (one query token each) in blocks of 128: every full block
a page of the format (random keys and values, keys stored before RoPE), the rest an open block in a tail slot, the
first 4 tokens exact sinks. Rows:

  kernel          `paged.paged_attention` as the backend calls it (its checks and argument views included)
  stock CPU_ATTN  vLLM's `cpu_attention_with_kv_cache` over bf16 blocks of the same lengths (needs vllm)
  stages          the kernel's own loops over every (request, KV head) pair, one stage at a time: key planes (pages
                  decoded, tails converted), their rotation, value planes, scores, softmax, P·V

Each row: the best of 5 rounds of 10 calls in this process (on a shared machine a process's own speed varies by
tens of percent: compare rows of one run, not runs).
"""

from __future__ import annotations

import argparse
import math
import time

import numba
import numpy as np
import torch

from gear_hf.compress.rope import rope_tables
from gear_hf.config import GearConfig
from gear_hf.kernels.cpu import paged
from gear_hf.kernels.cpu.attend import _FAST, _run_scratch, _softmax_row, _weighted_rows
from gear_hf.kernels.cpu.read import _NO_FACTORS
from gear_hf.vllm.format import PageFormat
from gear_hf.warmup import shipped_config

H, G, D, BLOCK, SINKS = 3, 3, 64, 128, 4


@numba.njit(fastmath=_FAST)
def _stage(which, q, lens, table, bs, cos, sin, pages, k_layout, v_layout, tail_k, tail_v, rounds):
    """`paged._paged_pairs`' loops of one stage (0 key planes, 1 their rotation, 2 value planes, 3 scores, 4 softmax,
    5 P·V) over every (request, KV head) pair, `rounds` times."""
    cap = table.shape[1] * bs
    keys, vals = np.ones((cap, D), dtype=np.float32), np.ones((cap, D), dtype=np.float32)
    from_pages = np.ones(table.shape[1], dtype=np.bool_)
    k_scales = np.ones((2, 1, 1, 1, max(k_layout[0][6, 2], 1)), dtype=np.float32)
    v_scales = np.ones((2, 1, 1, 1, max(v_layout[0][6, 2], 1)), dtype=np.float32)
    k_run, k_factors = paged._page_run(pages, 0, 0, k_layout, k_scales)
    v_run, _ = paged._page_run(pages, 0, 0, v_layout, v_scales)
    k_scratch = _run_scratch(k_run, k_factors, False, D)
    v_scratch = _run_scratch(v_run, _NO_FACTORS, False, D)
    exponents = np.empty(cap, dtype=np.int32)
    scores, acc = np.zeros((G, cap), np.float32), np.zeros((G, D), np.float32)
    for _ in range(rounds):
        for pair in range(lens.shape[0] * H):
            r, h = pair // H, pair % H
            L = lens[r]
            if which == 0:
                paged._paged_planes(pages, table, r, h, L, bs, k_layout, True, False, tail_k, tail_k, tail_k.shape[0],
                                    keys, k_scratch, k_scales, from_pages)
            elif which == 1:
                paged._rotate_pages(keys, L, bs, from_pages, cos, sin)
            elif which == 2:
                paged._paged_planes(pages, table, r, h, L, bs, v_layout, False, False, tail_v, tail_v, tail_v.shape[0],
                                    vals, v_scratch, v_scales, from_pages)
            elif which == 3:
                for t in range(L):
                    for m in range(G):
                        dot = np.float32(0.0)
                        for k in range(D):
                            dot += q[r, h * G + m, k] * keys[t, k]
                        scores[m, t] = dot
            elif which == 4:
                for m in range(G):
                    _softmax_row(scores[m], 0, L, L, exponents)
            else:
                _weighted_rows(acc, scores, vals, 0, L)
    return acc[0, 0]


def _best_ms(call, rounds: int = 10) -> float:
    call()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            call()
        best = min(best, (time.perf_counter() - start) / rounds * 1e3)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a paper preset or recommended name (default: GearConfig())")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = GearConfig() if args.config is None else shipped_config(args.config)
    gen = torch.Generator().manual_seed(0)
    R, bf16 = args.requests, torch.bfloat16
    lens = np.array([700 + 7 * r for r in range(R)], dtype=np.int64)
    blocks = [-(-int(L) // BLOCK) for L in lens]
    closed = [int(L) // BLOCK for L in lens]
    fmt = PageFormat(config, BLOCK, D, bf16)
    pages = fmt.encode(*(torch.randn(sum(closed), H, BLOCK, D, generator=gen).to(bf16) for _ in range(2)))
    table = np.zeros((R, max(blocks)), np.int64)
    page = 0
    for r in range(R):  # closed blocks: pages; the last block: tail slot r
        for j in range(blocks[r]):
            table[r, j] = page if j < closed[r] else -1 - r
            page += j < closed[r]
    bits = lambda t: t.view(torch.int16).numpy()  # noqa: E731 (bf16 as the kernel reads it)
    tail_k, tail_v = (torch.randn(R, BLOCK, H, D, generator=gen).to(bf16) for _ in range(2))
    sink_k, sink_v = (torch.randn(R, SINKS, H, D, generator=gen).to(bf16) for _ in range(2))
    closing = torch.zeros(0, BLOCK, H, D, dtype=bf16)
    q = (torch.randn(R, H * G, D, generator=gen) / math.sqrt(D)).numpy()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = (t[:, : D // 2].contiguous().numpy() for t in rope_tables(torch.arange(int(lens.max())), inv_freq))
    layouts = [paged.page_layout(spec, tuple((name, *where) for name, where in layout.items()), BLOCK, D)
               for spec, layout in zip(fmt.specs, fmt.layout)]
    out = np.empty((R, H * G, D), np.float32)
    starts = np.arange(R + 1, dtype=np.int64)
    print(f"{fmt.config.describe()} pages, {R} requests of {lens.min()}-{lens.max()} tokens, bf16, 1 thread "
          "(compiling first where needed)")
    kernel = lambda: paged.paged_attention(  # noqa: E731
        q, starts, lens, table, BLOCK, cos, sin, pages.numpy(), *layouts, bits(tail_k), bits(tail_v), bits(closing),
        bits(closing), R, out, np.arange(R, dtype=np.int64), bits(sink_k), bits(sink_v))
    print(f"  kernel          {_best_ms(kernel):7.3f} ms/layer")
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        print("  stock CPU_ATTN  (vllm not installed)")
    else:
        cache = torch.randn(sum(blocks), H, 2 * BLOCK, D, generator=gen).to(bf16)
        key_cache, value_cache = cache.chunk(2, dim=2)
        block_table = torch.arange(sum(blocks), dtype=torch.int32).split(blocks)
        block_table = torch.nn.utils.rnn.pad_sequence(block_table, batch_first=True)
        query_start, seq_lens = torch.arange(R + 1, dtype=torch.int32), torch.from_numpy(lens).int()
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=R, num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=seq_lens, dtype=bf16,
            query_start_loc=query_start, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
            kv_cache_dtype="auto")
        query = torch.randn(R, H * G, D, generator=gen).to(bf16)
        output = torch.empty_like(query)
        stock = lambda: ops.cpu_attention_with_kv_cache(  # noqa: E731
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=query_start,
            seq_lens=seq_lens, scale=1 / math.sqrt(D), causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        print(f"  stock CPU_ATTN  {_best_ms(stock):7.3f} ms/layer")
    stage_args = (q, lens, table, BLOCK, cos, sin, pages.numpy(), layouts[0][0], layouts[1][0], bits(tail_k),
                  bits(tail_v))
    for which, name in enumerate(("key planes", "key rotation", "value planes", "scores", "softmax", "P·V")):
        print(f"  {name:15s} {_best_ms(lambda: _stage(which, *stage_args, 1)):7.3f} ms/layer")  # noqa: B023


if __name__ == "__main__":
    main()
