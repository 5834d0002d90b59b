"""A scenario of paged storage as gear_hf.vllm's backend hands it to its attention kernels, with the torch oracle's
answer: pages written by the vLLM page format (`gear_hf.vllm.format.PageFormat`, needs no vllm) and decoded by
`gear_hf.compress`, keys rotated by `apply_rotary` (pre-RoPE pages), attention in float64, causal per request.
Requests mix pages, exact tail slots and closing blocks, decode (one query token) and prefill chunks longer than a
query tile; some tail slots are unused and some pages read by no request."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gear_hf.compress.rope import apply_rotary, rope_tables
from gear_hf.vllm.format import PageFormat


@dataclass
class PagedCase:
    fmt: PageFormat
    pages: torch.Tensor  # [blocks, H, page_bytes] uint8
    table: torch.Tensor  # int64 [R, blocks]: page id, else -1 - source (tail slot, or slots + closing index)
    starts: list
    lens: list
    query: torch.Tensor  # [T, Hq, d] float32, not scaled
    tail_k: torch.Tensor  # [slots, bs, H, d] model dtype
    tail_v: torch.Tensor
    close_k: torch.Tensor  # [C, bs, H, d]
    close_v: torch.Tensor
    slots: int  # first_closing
    sink_slot: torch.Tensor  # int64 [R]: request r's sink slot (its block 0 a page, sinks > 0), else -1
    sink_k: torch.Tensor  # [slots, sinks, H, d] model dtype: exact first tokens (keys after RoPE)
    sink_v: torch.Tensor
    inv_freq: torch.Tensor  # [d/2]
    cos: torch.Tensor  # [L, d] float32 (rope_tables)
    sin: torch.Tensor
    expected: torch.Tensor  # [T, Hq, d] float64


def paged_case(config, dtype, rotated, bs=16, d=64, H=2, G=3, lens=(40, 16, 70, 33), queries=(1, 16, 21, 1),
               seed=0, query_dtype=torch.float32, sinks=0) -> PagedCase:
    """query_dtype: the oracle attends the query rounded to it (the kernel's input); sinks: the first tokens of each
    request whose block 0 is a page are exact, from a sink slot (the page's rows there are not attended)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = PageFormat(config, bs, d, dtype)
    blocks = sum(L // bs for L in lens) + 3  # (+ pages no request reads)
    pages = fmt.encode(torch.randn(blocks, H, bs, d, generator=gen).to(dtype),
                       torch.randn(blocks, H, bs, d, generator=gen).to(dtype))
    decoded_k, decoded_v = fmt.decode(pages, torch.float32)
    decoded_k, decoded_v = decoded_k.float(), decoded_v.float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(torch.arange(max(lens)), inv_freq)
    tails, closing = [], []  # exact blocks: (keys [bs, H, d], values)
    slots = 5  # tail slots (some unused)
    table = torch.zeros(len(lens), max(-(-L // bs) for L in lens), dtype=torch.int64)
    queries_all, expected, starts, page = [], [], [0], 3
    sink_slot, sink_k, sink_v = torch.full((len(lens),), -1, dtype=torch.int64), [], []
    for r, (L, n) in enumerate(zip(lens, queries)):
        before = L - n
        keys, values = [], []
        for j in range(-(-L // bs)):
            if (j + 1) * bs <= before:  # closed: a page
                table[r, j] = page
                k, v = decoded_k[page].clone(), decoded_v[page].clone()
                if rotated:
                    k = apply_rotary(k, cos[None, j * bs:(j + 1) * bs], sin[None, j * bs:(j + 1) * bs])
                if j == 0 and sinks:
                    sink_slot[r] = len(sink_k) + 1  # (slot 0 unused)
                    sink_k.append(torch.randn(sinks, H, d, generator=gen).to(dtype))
                    sink_v.append(torch.randn(sinks, H, d, generator=gen).to(dtype))
                    k[:, :sinks], v[:, :sinks] = sink_k[-1].transpose(0, 1).float(), sink_v[-1].transpose(0, 1).float()
                keys.append(k)
                values.append(v)
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
        q = torch.randn(n, H * G, d, generator=gen).to(query_dtype).float()
        scores = torch.einsum("qhd,hkd->hqk", q.double(), K.repeat_interleave(G, 0)) / math.sqrt(d)
        scores = scores.masked_fill(torch.arange(L)[None, :] > (before + torch.arange(n))[:, None], float("-inf"))
        expected.append(torch.einsum("hqk,hkd->qhd", scores.softmax(-1), V.repeat_interleave(G, 0)))
        queries_all.append(q)
        starts.append(starts[-1] + n)
    while len(tails) < slots:
        tails.append((torch.zeros(bs, H, d, dtype=dtype),) * 2)
    tail_k, tail_v, close_k, close_v = [
        torch.stack([t[i] for t in group]) if group else torch.zeros(0, bs, H, d, dtype=dtype)
        for group in (tails, closing) for i in (0, 1)]
    sink_k = torch.stack([torch.zeros(sinks, H, d, dtype=dtype)] + sink_k) if sinks else None
    sink_v = torch.stack([torch.zeros(sinks, H, d, dtype=dtype)] + sink_v) if sinks else None
    return PagedCase(fmt, pages, table, starts, list(lens), torch.cat(queries_all), tail_k, tail_v, close_k, close_v,
                     slots, sink_slot, sink_k, sink_v, inv_freq, cos, sin, torch.cat(expected))
