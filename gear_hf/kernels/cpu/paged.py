"""Attention over paged GEAR storage on the CPU (numba): each request's blocks read in place through its block table.

The serving layout (`gear_hf.vllm`): one page per (block, KV head) holds one compressed chunk of `bs` tokens of keys
and of values, its fields at fixed offsets (`page_layout`), each read in place as a one-chunk run; the blocks
written this step are read in full precision: the open ones from their tail slots [S, bs, H, d], those that close
this step from their staging [C, bs, H, d] (before they are compressed).
Per (request, KV head): every block the request reads is assembled into a scratch plane by the read kernels' stages
(`dequant._assemble`: codes, outliers, low-rank, Hadamard rotation undone), keys stored before RoPE rotated at
their positions once; then its query tokens, in tiles, take exact two-pass softmax scores over the keys they see
(causal: query i of a request with `before` earlier tokens sees keys [0, before + i]). Values are assembled
without their low-rank term, which enters as (P·A)·Bᵀ per block, and rotated values are summed in the rotated
basis and un-rotated once per tile, as `attend._attend` does.

Numerics: float32 throughout (queries, exact blocks and pages read exactly into float32; output float32); the
torch oracle (pages decoded by `gear_hf.compress`, attention in torch) equals it to float32 rounding.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from . import threads
from .attend import _FAST, _add_value_lowrank, _assemble_run, _run_scratch, _softmax_row, _weighted_rows
from .bf16 import bf16_value
from .bf16 import side_value as _side
from .dequant import _hadamard_rows
from .jit import kernel
from .read import _NO_FACTORS

_F32 = np.float32
QUERY_TILE = 16  # query tokens per pass over a request's keys (scores [G*tile, L] stay small during a prefill)


@numba.njit
def _field(page, f, fields, like):
    """Field f of one page (page [page_bytes] uint8; fields [10, 3]: byte offset, rows, columns) as a [1, 1, rows,
    columns] array of like's dtype: a view, C-contiguous (what lets the read loops vectorize)."""
    offset, rows, columns = fields[f, 0], fields[f, 1], fields[f, 2]
    return page[offset : offset + rows * columns * like.itemsize].view(like.dtype).reshape(1, 1, rows, columns)


@numba.njit
def _side_field(page, f, fields, like):
    """Field f of one page, side information of like's dtype, as its bytes [1, 1, rows, columns, w] (w: like's
    itemsize), as `bf16.side_entry` reads it."""
    offset, rows, columns, w = fields[f, 0], fields[f, 1], fields[f, 2], like.itemsize
    return page[offset : offset + rows * columns * w].reshape(1, 1, rows, columns, w)


@numba.njit
def _page_factors(page, layout, scales):
    """The low-rank factors of one page (page [page_bytes] uint8) as `attend._assemble_run` reads them: (a, a
    scales, b, b scales); scales [2, 1, 1, 1, >=r] float32 scratch for int8 factors' column scales (ones are left
    there for 16-bit factors)."""
    fields, side_like, factor_like, scaled_factors = layout[:4]
    a, b = _side_field(page, 6, fields, factor_like), _side_field(page, 7, fields, factor_like)
    r = a.shape[3]
    if r and scaled_factors:
        a_scale, b_scale = _field(page, 8, fields, side_like), _field(page, 9, fields, side_like)
        for k in range(r):
            scales[0, 0, 0, 0, k] = _side(a_scale[0, 0, 0, k])
            scales[1, 0, 0, 0, k] = _side(b_scale[0, 0, 0, k])
    return a, scales[0], b, scales[1]


@numba.njit
def _page_run(pages, block, h, layout, scales):
    """(run, factors) of page (block, h) as `attend._assemble_run` reads a one-chunk run at plane (0, 0); layout as
    `page_layout` gives it; scales: `_page_factors`' scratch."""
    fields, side_like, factor_like, scaled_factors, bits, group, channel_axis, n = layout
    page = pages[block, h]
    index = _field(page, 5, fields, page)
    run = (_field(page, 0, fields, page), bits, group, channel_axis, _field(page, 2, fields, page),
           _field(page, 3, fields, page), _side_field(page, 4, fields, side_like), index,
           index.shape[2] if index.shape[3] else 0, n, n, _field(page, 1, fields, page))
    return run, _page_factors(page, layout, scales)


@kernel(fastmath=_FAST)
def _exact_rows(blocks, s, h, count, target):
    """target[:count] = rows [0, count) of block s of blocks [S, bs, H, d*w] at head h, held as their bytes
    (`_exact_bytes`): w = 4 float32, w = 2 bf16."""
    d = target.shape[1]
    wide = blocks.shape[3] == 4 * d
    for t in range(count):
        row = blocks[s, t, h]
        if wide:
            values = row.view(np.float32)
            for k in range(d):
                target[t, k] = values[k]
        else:
            bits = row.view(np.uint16)
            for k in range(d):
                target[t, k] = bf16_value(bits[k])


@kernel(fastmath=_FAST)
def _paged_planes(pages, table, r, h, L, bs, layout, with_factors, rotated, tails, closing, first_closing, plane,
                  scratch, scales, from_pages):
    """Rows [0, L) of plane [>=L, d]: request r's tokens of one stream, KV head h, block by block: table[r, j] >= 0
    a page (block id), else exact, from source s = -1 - table[r, j]: tail slot s of tails [S, bs, H, d], or for
    s >= first_closing block s - first_closing of closing [C, bs, H, d]. with_factors: the low-rank term added
    (keys; values take it as (P·A)·Bᵀ); rotated: the Hadamard rotation undone (keys). from_pages[j] records which
    blocks came from pages."""
    for j in range((L + bs - 1) // bs):
        entry, lo = table[r, j], j * bs
        if entry >= 0:
            run, factors = _page_run(pages, entry, h, layout, scales)
            if with_factors:
                _assemble_run(run, factors, rotated, 0, 0, plane[lo : lo + bs], scratch)
            else:
                _assemble_run(run, _NO_FACTORS, False, 0, 0, plane[lo : lo + bs], scratch)
            from_pages[j] = True
        else:
            s = -1 - entry
            count = min(bs, L - lo)
            if s < first_closing:
                _exact_rows(tails, s, h, count, plane[lo : lo + count])
            else:
                _exact_rows(closing, s - first_closing, h, count, plane[lo : lo + count])
            from_pages[j] = False


@kernel(fastmath=_FAST)
def _rotate_pages(plane, L, bs, from_pages, cos, sin):
    """Page rows of plane rotated at their positions (row t at position t), HF's rotate_half RoPE with cos/sin
    [>=L, d/2] (attention scaling folded in); exact rows arrive rotated."""
    half = plane.shape[1] // 2
    for j in range((L + bs - 1) // bs):
        if not from_pages[j]:
            continue
        for t in range(j * bs, min(L, (j + 1) * bs)):
            for i in range(half):
                x1, x2, c, s = plane[t, i], plane[t, i + half], cos[t, i], sin[t, i]
                plane[t, i] = x1 * c - x2 * s
                plane[t, i + half] = x2 * c + x1 * s


@kernel(fastmath=_FAST)
def _paged_pairs(q, starts, lens, table, bs, cos, sin, pages, k_layout, k_rotated, v_layout, v_rotated, tail_k,
                 tail_v, close_k, close_v, first_closing, sink_slot, sink_k, sink_v, out, start, stop):
    """Attention of the (request, KV head) pairs start..stop-1 (pair = request * H + head).

    q [T, Hq, d] float32 (softmax scale folded in); starts [R+1] (request r's query tokens: rows starts[r] ..
    starts[r+1]-1 of q, the last of its lens[r] tokens); table [R, >=blocks] (`_paged_planes`); cos/sin [>=L, d/2]
    to rotate page keys by, or [0, 0] (keys stored rotated); pages [blocks, H, page_bytes] uint8 with each stream's
    fields where `page_layout` says; *_rotated: the stream's chunks are Hadamard-rotated; tail_k/tail_v
    [S, bs, H, d*w] and close_k/close_v [C, bs, H, d*w] the exact blocks (`_paged_planes`) as their bytes
    (`_exact_rows`); sink_slot [R]: request r's first sink_k.shape[1] tokens read exact from slot sink_slot[r] of
    sink_k/sink_v [slots, n, H, d*w] (its block 0 a page whose copies of them are not attended), -1: none;
    out [T, Hq, d] float32."""
    T, Hq, d = q.shape
    H = tail_k.shape[2]
    G = Hq // H
    cap = table.shape[1] * bs
    keys = np.empty((cap, d), dtype=np.float32)
    vals = np.empty((cap, d), dtype=np.float32)
    exponents = np.empty(cap, dtype=np.int32)
    from_pages = np.zeros(table.shape[1], dtype=np.bool_)
    value_pages = np.zeros(table.shape[1], dtype=np.bool_)
    k_scales = np.ones((2, 1, 1, 1, max(k_layout[0][6, 2], 1)), dtype=np.float32)
    v_scales = np.ones((2, 1, 1, 1, max(v_layout[0][6, 2], 1)), dtype=np.float32)
    k_run, k_factors = _page_run(pages, 0, 0, k_layout, k_scales)  # (any page: the scratch only needs shapes)
    v_run, v_factors = _page_run(pages, 0, 0, v_layout, v_scales)
    k_s = _run_scratch(k_run, k_factors, k_rotated, d)
    v_s = _run_scratch(v_run, _NO_FACTORS, False, d)
    tile = np.empty((d, 64), dtype=np.float32)
    rank = v_factors[0].shape[3]
    for pair in range(start, stop):
        r, h = pair // H, pair % H
        L = lens[r]
        queries = starts[r + 1] - starts[r]
        if queries == 0 or L == 0:
            continue
        before = L - queries
        _paged_planes(pages, table, r, h, L, bs, k_layout, True, k_rotated, tail_k, close_k, first_closing, keys, k_s,
                      k_scales, from_pages)
        if cos.shape[0] > 0:
            _rotate_pages(keys, L, bs, from_pages, cos, sin)
        _paged_planes(pages, table, r, h, L, bs, v_layout, False, False, tail_v, close_v, first_closing, vals, v_s,
                      v_scales, value_pages)
        sink, sinks = sink_slot[r], 0
        if sink >= 0:  # (after the rotation: exact keys arrive rotated)
            sinks = min(sink_k.shape[1], L)
            _exact_rows(sink_k, sink, h, sinks, keys[:sinks])
            _exact_rows(sink_v, sink, h, sinks, vals[:sinks])
        for first in range(0, queries, QUERY_TILE):
            n = min(QUERY_TILE, queries - first)
            M = G * n  # query row m: head h*G + m // n, token first + m % n
            seen = before + first + n  # keys the tile's last query sees
            qrows = np.empty((M, d), dtype=np.float32)
            scores = np.empty((M, seen), dtype=np.float32)
            acc = np.zeros((M, d), dtype=np.float32)
            plain = np.zeros((M, d), dtype=np.float32)
            norm = np.empty(M, dtype=np.float32)
            pa = np.empty((M, max(rank, 1)), dtype=np.float32)
            column = np.empty(d, dtype=np.float32)
            for m in range(M):
                for k in range(d):
                    qrows[m, k] = q[starts[r] + first + m % n, h * G + m // n, k]
            for t in range(seen):
                for m in range(M):
                    dot = _F32(0.0)
                    for k in range(d):
                        dot += qrows[m, k] * keys[t, k]
                    scores[m, t] = dot
            for m in range(M):  # causal: query token first + m % n sees keys [0, before + first + m % n]
                norm[m] = _softmax_row(scores[m], 0, before + first + m % n + 1, seen, exponents)
            for j in range((seen + bs - 1) // bs):
                lo, hi = j * bs, min(seen, (j + 1) * bs)
                if value_pages[j]:  # (the rotated basis when values rotate; low-rank term as (P·A)·Bᵀ)
                    if j == 0 and sinks:  # exact sinks, then nothing of the page's copies of them
                        _weighted_rows(plain, scores, vals, 0, min(sinks, hi))
                        scores[:, : min(sinks, hi)] = 0.0
                    _weighted_rows(acc, scores, vals, lo, hi)
                    if rank:
                        factors = _page_factors(pages[table[r, j], h], v_layout, v_scales)
                        _add_value_lowrank(acc, scores, factors, 0, 0, 0, bs, lo, hi - lo, d, pa, column)
                else:
                    _weighted_rows(plain, scores, vals, lo, hi)
            if v_rotated:
                _hadamard_rows(acc, M, tile)  # (P·V·H)·H = P·V
            for m in range(M):
                for k in range(d):
                    out[starts[r] + first + m % n, h * G + m // n, k] = (acc[m, k] + plain[m, k]) * norm[m]


@kernel(fastmath=_FAST, parallel=True)
def _paged_parallel(q, starts, lens, table, bs, cos, sin, pages, k_layout, k_rotated, v_layout, v_rotated, tail_k,
                    tail_v, close_k, close_v, first_closing, sink_slot, sink_k, sink_v, out, parts):
    """`_paged_pairs` of every pair, cut into `parts` contiguous shares on numba's threads (the same bits)."""
    pairs = lens.shape[0] * tail_k.shape[2]
    for part in numba.prange(parts):
        _paged_pairs(q, starts, lens, table, bs, cos, sin, pages, k_layout, k_rotated, v_layout, v_rotated, tail_k,
                     tail_v, close_k, close_v, first_closing, sink_slot, sink_k, sink_v, out, part * pairs // parts,
                     (part + 1) * pairs // parts)


def paged_attention(q, starts, lens, table, block_size, cos, sin, pages, keys, values, tail_k, tail_v, close_k,
                    close_v, first_closing, out, sink_slot=None, sink_k=None, sink_v=None):
    """Fill out [T, Hq, d] float32 with the attention of q [T, Hq, d] float32 (scale folded in) over the pages
    [blocks, H, page_bytes] uint8 and the exact blocks (tails, closing from source first_closing on:
    `_paged_planes`; float32, or bf16 as its bits: int16), numpy arrays; a request of lens 0 is skipped (its rows
    of out are left as they are); keys/values: (layout, rotated) as `page_layout` gives them; sink_slot/sink_k/sink_v:
    exact first tokens (`_paged_pairs`; None: none). Its (request, KV head) pairs are split over torch's threads
    where numba runs them safely (`threads`)."""
    if sink_slot is None:  # (same argument types as with sinks: one compiled signature)
        sink_slot = np.full(len(lens), -1, dtype=np.int64)
        sink_k = sink_v = np.zeros((0, 1, *tail_k.shape[2:]), dtype=tail_k.dtype)
    tail_k, tail_v, close_k, close_v, sink_k, sink_v = (_exact_bytes(blocks, q.shape[2]) for blocks in (
        tail_k, tail_v, close_k, close_v, sink_k, sink_v))
    if len(sink_slot) != len(lens) or (sink_slot >= sink_k.shape[0]).any() or sink_k.shape[1] >= block_size:
        raise ValueError(f"paged attention: sink slots {sink_slot.tolist()} must be one per request, below the "
                         f"{sink_k.shape[0]} held, of fewer tokens ({sink_k.shape[1]}) than a block ({block_size})")
    counts = np.diff(starts)
    if len(counts) != len(lens) or ((counts > lens) & (lens > 0)).any() or (counts < 0).any():
        raise ValueError(f"paged attention: query counts {counts.tolist()} (from starts) must be one per request and "
                         f"at most its tokens {lens.tolist()} (0: a request not attended here)")
    if (lens > table.shape[1] * block_size).any() or (cos.shape[0] and lens.size and cos.shape[0] < lens.max()):
        raise ValueError(f"paged attention: requests of {lens.tolist()} tokens exceed the table ({table.shape[1]} "
                         f"blocks of {block_size}) or the rotation tables ({cos.shape[0]} positions)")
    if (table < -first_closing - close_k.shape[0]).any() or (table >= pages.shape[0]).any() or \
            ((table < 0) & (table >= -first_closing) & (table < -tail_k.shape[0])).any():
        raise ValueError(f"paged attention: the table names pages past {pages.shape[0]}, tail slots past "
                         f"{tail_k.shape[0]} or closing blocks past {close_k.shape[0]}")
    args = (q, starts, lens, table, block_size, cos, sin, pages, *keys, *values, tail_k, tail_v, close_k, close_v,
            first_closing, sink_slot, sink_k, sink_v, out)
    pairs = lens.shape[0] * tail_k.shape[2]
    threads.launch(lambda *serial: _paged_pairs(*serial, 0, pairs), _paged_parallel, args, pairs)
    return out


def _exact_bytes(blocks: np.ndarray, d: int) -> np.ndarray:
    """Exact blocks [S, bs, H, d] (float32, or bf16 as its bits: int16) as their bytes [S, bs, H, d*4 or d*2], no copy:
    one array type for either model dtype, so one compiled signature of the paged kernel per page format."""
    if blocks.dtype not in (np.float32, np.int16) or blocks.ndim != 4 or blocks.shape[3] != d:
        raise ValueError(f"paged attention: exact blocks of dtype {blocks.dtype} and shape {blocks.shape} are not "
                         f"read; allowed: float32, or bf16 as its bits (int16), [blocks, block size, heads, {d}]")
    return blocks.view(np.uint8)


# -- where a page's fields lie ---------------------------------------------------------------------------------
_NUMPY = {torch.uint8: np.uint8, torch.int8: np.int8, torch.bfloat16: np.int16, torch.float32: np.float32}
_FIELDS = ("codes", "channel_bits", "scale", "minimum", "sparse_values", "sparse_index", "lowrank_a", "lowrank_b",
           "lowrank_a_scale", "lowrank_b_scale")  # (the order `_page_run` reads them in)


def pages_supported(spec, dtypes, d: int) -> bool:
    """True when the paged kernel reads pages of `spec` (head_dim d) whose fields have these torch dtypes: side
    information in bf16 (as its bits) or float32 (fp16 would need a float32 copy of every page each step), and what
    the read kernels cover (widths 2/3/4/8 or a width per channel; along tokens, groups that split d, d % 8 == 0)."""
    if not all(dtype in _NUMPY for dtype in dtypes) or not (spec.allocated or spec.bits in (2, 3, 4, 8)):
        return False
    return spec.axis == "channel" or (d % min(spec.group or d, d) == 0 and d % 8 == 0)


@functools.lru_cache(maxsize=64)
def page_layout(spec, fields: tuple, n: int, d: int) -> tuple:
    """(layout, rotated) of one stream's chunk in a page, as `_paged_pairs` reads it: fields ((name, byte offset in
    the page, torch dtype, shape), ...) of every `CompressedChunk` field; a page holds one chunk of n tokens of
    `spec`, head_dim d. layout = (fields [10, 3] int64: offset, rows, columns (the statistics' in bytes: they are
    read as their bytes, `bf16.stored_stats`); arrays of the dtypes side information and the low-rank factors are
    read as; whether the factors are int8 with column scales; bits (0: a width per channel); group; along channels;
    n)."""
    where = {name: (offset, dtype, shape) for name, offset, dtype, shape in fields}
    table = np.zeros((len(_FIELDS), 3), dtype=np.int64)
    for i, name in enumerate(_FIELDS):
        offset, dtype, (rows, columns) = where[name]
        if name in ("scale", "minimum"):
            columns *= np.dtype(_NUMPY[dtype]).itemsize
        table[i] = (offset, rows, columns)
    like = {name: np.zeros(0, dtype=_NUMPY[where[name][1]]) for name in ("sparse_values", "lowrank_a")}
    group = spec.group_for(n, d) if spec.axis == "channel" else min(spec.group_for(n, d), d)
    layout = (table, like["sparse_values"], like["lowrank_a"], where["lowrank_a"][1] == torch.int8,
              0 if spec.allocated else int(spec.bits), group, spec.axis == "channel", n)
    return layout, bool(spec.rotate)
