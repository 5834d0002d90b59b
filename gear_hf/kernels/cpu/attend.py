"""Fused decode attention on the CPU (numba): attend straight from GEAR storage, one (row, KV head) at a time.

What `gear_hf.kernels.decode.decode_attention` (Triton) computes, from the same inputs (`views`: the storage
tensors and the row layout, no cache object), for CPU tensors; `gear_hf.cache.fused.reference_decode_attention` is
the oracle of both.
Why: the reference path writes every key (rotated) and value of the history into a [B,H,T,d] workspace at every
step and then runs the model's attention function over it (HF's sdpa first repeats K and V for every query head
of a group), so a decode step moved the history through memory several times. Here, per (row, KV head):

* the row's keys [sink | prompt chunk | decode chunks | buffer] are assembled into a scratch plane that stays in
  cache, by the read kernels' stages (`read._assemble`: codes, outliers, low-rank, Hadamard rotation undone);
  each key row is rotated at its position as its scores are taken (cos/sin from the positions and inv_freq, as
  the rotary module computes them, once per step for every layer), never written rotated;
* the softmax is exact (two passes over the scores, float32);
* the values are assembled without their low-rank term, which enters as (P·A)·Bᵀ (two small products, never
  A·Bᵀ); rotated values are attended in the rotated basis and the output rows are un-rotated once (P·V·H·H = P·V).

Numerics: float32 throughout (bf16 queries and storage read exactly into float32; the output rounded once to the
query's dtype); sums in another order than the oracle's: equal to float32 rounding.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...compress import side_dtype
from . import threads
from .attend_args import _float32, _rope_halves, _stream_runs, _tail_args, _value_center
from .bf16 import side_entry as _side_entry
from .dequant import _assemble, _hadamard_rows, _scratch
from .jit import kernel
from .query import NO_QUERY_ROTATION, _query_row, rotation_rounding
from .read import _NO_FACTORS, _NO_ROTATION

_F32 = np.float32
# numba: reductions over channels need reassociation to vectorize; no finite-math flags (masked scores are -inf).
# The loops `_attend` calls are cached kernels of their own with the same flags, not inlined into it: numba's IR
# inlining copied each into every call site, so each new argument-type signature of `_attend` compiled in ~22 s
# (~7 s with its callees cached; decode time the same, measured on bf16 Llama-3-8B head shapes at T~2k).
_FAST = {"reassoc", "contract"}


@kernel(fastmath=_FAST)
def _assemble_run(run, factors, hadamard, b, h, target, scratch):
    """Every token of a prepared run (`_run_args`) for plane (b, h) into target [N, d]; factors/hadamard replace
    the run's own (values: without their low-rank term and rotation, added and undone after the attention)."""
    codes, bits, group, channel_axis, scale, minimum, values, index, rows, n, N, widths = run
    a, a_scale, b_raw, b_scale = factors
    spread, bt, weights, tile, plane_words = scratch
    _assemble(codes, bits, group, channel_axis, scale, minimum, a, a_scale, b_raw, b_scale, values, index, rows, n, N,
              hadamard, widths, b, h, target, False, _NO_ROTATION, _NO_ROTATION, 0, spread, bt, weights, tile,
              plane_words)


@kernel(fastmath=_FAST)
def _run_scratch(run, factors, hadamard, d):
    """`read._scratch` of a run (its plane unused: `_attend` assembles into its own)."""
    codes, bits, group, channel_axis, scale, minimum, values, index, rows, n, N, widths = run
    _, spread, bt, weights, tile, plane_words = _scratch(factors[0], channel_axis, hadamard, widths, n, N, d)
    return spread, bt, weights, tile, plane_words


@numba.njit
def _is_staged(staged, b, t):
    """Whether buffer token t of row b is this step's own (read exact from the buffer), staged [B,cap] or [0,0]."""
    return staged.shape[0] > 0 and staged[b, t]


@kernel(fastmath=_FAST)
def _decode_token(codes, bits, s, m, b, h, t, row):
    """row [d] = code * s + m (float32) of token t's codes [B,H,cap,P]: 8-bit codes, or 4-bit ones two a byte (the
    even channel in the low nibble, as `quant.pack_codes` packs them)."""
    d = row.shape[0]
    if bits == 8:
        for k in range(d):
            row[k] = _F32(codes[b, h, t, k]) * s + m
    else:
        for p in range(d // 2):
            byte = codes[b, h, t, p]
            row[2 * p] = _F32(byte & 15) * s + m
            row[2 * p + 1] = _F32(byte >> 4) * s + m
        if d % 2:
            row[d - 1] = _F32(codes[b, h, t, d // 2] & 15) * s + m


@kernel(fastmath=_FAST)
def _buffer_rows(buf, tail, b, h, f, target, unrotate, tile):
    """The row's f buffer tokens into target [>=f, d]: from buf [B,H,cap,d] (float32, full precision), or, for a
    buffer held per token (`_tail_args`: codes [B,H,cap,P] uint8 of 8 or 4 bits, scale/minimum [B,H,cap,1] as their
    bytes (`read._side_bytes`),
    staged [B,cap], bits, rotated, affine), code * scale + minimum in float32, except the staged tokens (this step's
    own), read from buf. A rotated format's coded tokens stay in the rotated basis unless unrotate (keys: then each run
    of coded tokens is rotated back, `_hadamard_rows` with scratch tile [d, L]); the staged ones are never rotated.
    A centered buffer (affine [B,H,2,d] float32 in the basis the rows are left in, else empty) then takes each
    channel times affine[b,h,0] plus affine[b,h,1]."""
    codes, scale, minimum, staged, bits, rotated, affine = tail
    d = target.shape[1]
    coded = codes.shape[2] > 0
    t = 0
    while t < f:
        if coded and not _is_staged(staged, b, t):
            first = t
            while t < f and not _is_staged(staged, b, t):
                _decode_token(codes, bits, _side_entry(scale, b, h, t, 0), _side_entry(minimum, b, h, t, 0), b, h, t,
                              target[t])
                t += 1
            if rotated and unrotate:
                _hadamard_rows(target[first:t], t - first, tile)
            if affine.shape[0] > 0:
                for u in range(first, t):
                    for k in range(d):
                        target[u, k] = target[u, k] * affine[b, h, 0, k] + affine[b, h, 1, k]
        else:
            for k in range(d):
                target[t, k] = buf[b, h, t, k]
            t += 1


@kernel(fastmath=_FAST)
def _center_exact(vals, center, tail, b, h, s, first, f):
    """The rows of a value plane [L, d] read exact, minus center[b, h] [d]: the sink's (rows [0, s)) and the buffer's
    (rows [first, first+f)) that are not coded (staged ones, or all of a buffer held in full precision)."""
    coded = tail[0].shape[2] > 0
    for t in range(s + f):
        row = t if t < s else first + t - s
        if t >= s and coded and not _is_staged(tail[3], b, t - s):
            continue
        for k in range(vals.shape[1]):
            vals[row, k] -= center[b, h, k]


@kernel(fastmath=_FAST)
def _tail_weighted(rotated_acc, plain, probs, vals, first, f, staged, b):
    """A rotated buffer's share: its coded tokens (rows [first, first+f) of vals, in the rotated basis) into
    rotated_acc, its staged ones (exact) into plain, each run of either kind with `_weighted_rows`."""
    t = 0
    while t < f:
        own = _is_staged(staged, b, t)
        end = t + 1
        while end < f and _is_staged(staged, b, end) == own:
            end += 1
        _weighted_rows(plain if own else rotated_acc, probs, vals, first + t, first + end)
        t = end


@kernel(fastmath=_FAST)
def _plane(sink, buf, tail, b, h, s, p, c, f, nb, prompt, prompt_factors, decode, decode_factors, hadamard, plane,
           prompt_scratch, decode_scratch, unrotate_tail, tile):
    """Rows [0, s+p+c*nb+f) of plane: the row's tokens of one stream in row-local order. The prompt chunk and the
    decode chunks are decompressed whole (as many chunks as the longest row holds) and then overwritten from the
    row's next segment on: what lies past a row's own tokens is never attended. (run[10]: a run's tokens.) A rotated
    buffer's coded tokens are rotated back when unrotate_tail (`_buffer_rows`)."""
    for t in range(s):
        for k in range(plane.shape[1]):
            plane[t, k] = sink[b, h, t, k]
    if p > 0:
        _assemble_run(prompt, prompt_factors, hadamard, b, h, plane[s : s + prompt[10]], prompt_scratch)
    if c > 0:
        _assemble_run(decode, decode_factors, hadamard, b, h, plane[s + p : s + p + decode[10]], decode_scratch)
    first = s + p + c * nb
    _buffer_rows(buf, tail, b, h, f, plane[first : first + f], unrotate_tail, tile)


@kernel(fastmath=_FAST)
def _add_value_lowrank(acc, probs, factors, b, h, chunk, n, first, tokens, d, pa, column):
    """acc [M, d] += (P·A)·Bᵀ for one chunk of a value run: probs [M, >=first+tokens], the chunk's tokens at
    columns [first, first+tokens) of probs and at rows [chunk*n, chunk*n+tokens) of A; factors as stored
    (scaled as `compress.gear._factor` scales them, as `read._add_lowrank` reads them). Scratch: pa [M, >=r],
    column [d] (a column of B, decoded once for every query row)."""
    a, a_scale, b_raw, b_scale = factors
    r = a.shape[3]
    M = acc.shape[0]
    pa[:, :r] = 0.0
    for t in range(tokens):
        for k in range(r):
            w = _side_entry(a, b, h, chunk * n + t, k)
            for m in range(M):
                pa[m, k] += probs[m, first + t] * w
    for k in range(r):
        sa, sb = a_scale[b, h, chunk, k], b_scale[b, h, chunk, k]
        for ch in range(d):
            column[ch] = _side_entry(b_raw, b, h, chunk * d + ch, k) * sb
        for m in range(M):
            weight = pa[m, k] * sa
            for ch in range(d):
                acc[m, ch] += weight * column[ch]


@kernel(fastmath=_FAST)
def _softmax_row(row, low, high, L, exponents):
    """row[:L] (scores) -> exp(row - max) over [low, high), 0 elsewhere, in place; returns 1 / their sum (0 when
    the range is empty: a query that sees nothing gets zeros). e^x as 2^n * 2^f, n = round(x log2 e), 2^f by its
    Taylor polynomial of degree 7 (|f| <= 1/2: relative error < 1e-7, about an ulp), 2^n built in the exponent
    bits: loops LLVM vectorizes (libm's expf is a call per element)."""
    top = -np.inf
    for t in range(low, high):
        top = max(top, row[t])
    for t in range(low, high):
        y = max((row[t] - top) * _F32(1.4426950408889634), _F32(-127.0))  # (below 2^-126: flushed to 0)
        n = np.floor(y + _F32(0.5))
        f = (y - n) * _F32(0.6931471805599453)
        poly = _F32(1.0) + f * (_F32(1.0) + f * (_F32(0.5) + f * (_F32(1.0 / 6) + f * (_F32(1.0 / 24) + f * (
            _F32(1.0 / 120) + f * (_F32(1.0 / 720) + f * _F32(1.0 / 5040)))))))
        exponents[t] = (np.int32(n) + np.int32(127)) << np.int32(23)
        row[t] = poly
    total = _F32(0.0)
    powers = exponents.view(np.float32)
    for t in range(low, high):
        row[t] *= powers[t]
        total += row[t]
    for t in range(0, low):
        row[t] = 0.0
    for t in range(high, L):
        row[t] = 0.0
    return _F32(1.0) / total if total > 0.0 else _F32(0.0)


@kernel(fastmath=_FAST)
def _weighted_rows(acc, probs, vals, first, last):
    """acc [M, d] += probs[:, first:last] · vals[first:last], vectorized along d, four value rows per pass over acc
    (a pass per row spent its time loading and storing acc: 1.7x slower at d=64)."""
    t = first
    while t + 4 <= last:
        for m in range(acc.shape[0]):
            w0, w1, w2, w3 = probs[m, t], probs[m, t + 1], probs[m, t + 2], probs[m, t + 3]
            for k in range(acc.shape[1]):
                acc[m, k] += (w0 * vals[t, k] + w1 * vals[t + 1, k]) + (w2 * vals[t + 2, k] + w3 * vals[t + 3, k])
        t += 4
    for u in range(t, last):
        for m in range(acc.shape[0]):
            w = probs[m, u]
            for k in range(acc.shape[1]):
                acc[m, k] += w * vals[u, k]


@kernel(fastmath=_FAST)
def _attend(q, q_cos, q_sin, q_rounding, q_scale, limits, rows, cos, sin, window, nb, sink_k, sink_v, buf_k, buf_v,
            tail_k, tail_v, pk, pk_factors, pv, pv_factors, dk, dk_factors, dv, dv_factors, rotated_keys,
            rotated_values, held_values, value_center, exact_centered, out):
    """q [B,Hq,QL,d] float32, read as `query._query_row` makes its rows (rotated by q_cos/q_sin [B,QL,d] as
    q_rounding says, unless they are empty: q rotated already; times q_scale, the softmax scale with the rotary
    attention_scaling folded in); limits [B,QL] (row-local index
    of each query token, -1: sees nothing); rows [B,4] (sink, prompt, decode chunks, buffer); cos/sin [B,>=L,d/2]
    at the row-local tokens' positions; sink/buffer keys and values [B,H,>=len,d] float32; the buffer's coded
    tokens as `_tail_args` gives them (empty: the buffer is full precision); runs as `_run_args` gives them;
    held_values: a row's newest value chunk is the front of its value buffer (`views.StreamView.held_chunk`);
    value_center [B,H,d] float32 (values handed centered, `views.StreamView.center`: added to each output row that
    attends anything; the weights sum to one) or [0,0,0]; exact_centered False: the values' sink and exact buffer
    tokens come as they are and are centered here; out [B,QL,Hq,d] float32. Every (row, KV head) pair in turn,
    on the calling thread."""
    _attend_pairs(q, q_cos, q_sin, q_rounding, q_scale, limits, rows, cos, sin, window, nb, sink_k, sink_v, buf_k,
                  buf_v, tail_k, tail_v, pk, pk_factors, pv, pv_factors, dk, dk_factors, dv, dv_factors, rotated_keys,
                  rotated_values, held_values, value_center, exact_centered, out, 0, q.shape[0] * buf_k.shape[1])


@kernel(fastmath=_FAST, parallel=True)
def _attend_parallel(q, q_cos, q_sin, q_rounding, q_scale, limits, rows, cos, sin, window, nb, sink_k, sink_v, buf_k,
                     buf_v, tail_k, tail_v, pk, pk_factors, pv, pv_factors, dk, dk_factors, dv, dv_factors,
                     rotated_keys, rotated_values, held_values, value_center, exact_centered, out, parts):
    """`_attend` with its (row, KV head) pairs cut into `parts` contiguous shares run on numba's threads (each pair
    computed as `_attend` computes it: the same output bits)."""
    pairs = q.shape[0] * buf_k.shape[1]
    for part in numba.prange(parts):
        _attend_pairs(q, q_cos, q_sin, q_rounding, q_scale, limits, rows, cos, sin, window, nb, sink_k, sink_v,
                      buf_k, buf_v, tail_k, tail_v, pk, pk_factors, pv, pv_factors, dk, dk_factors, dv, dv_factors,
                      rotated_keys, rotated_values, held_values, value_center, exact_centered, out,
                      part * pairs // parts, (part + 1) * pairs // parts)


@kernel(fastmath=_FAST)
def _attend_pairs(q, q_cos, q_sin, q_rounding, q_scale, limits, rows, cos, sin, window, nb, sink_k, sink_v, buf_k,
                  buf_v, tail_k, tail_v, pk, pk_factors, pv, pv_factors, dk, dk_factors, dv, dv_factors,
                  rotated_keys, rotated_values, held_values, value_center, exact_centered, out, start, stop):
    """`_attend` of the (row, KV head) pairs start..stop-1 (pair = row * H + head), with scratch of its own."""
    B, Hq, QL, d = q.shape
    H = buf_k.shape[1]
    G = Hq // H
    M = G * QL
    half = d // 2
    cap = sink_k.shape[2] + pk[10] + dk[10] + max(buf_k.shape[2], buf_v.shape[2], tail_k[0].shape[2],
                                                tail_v[0].shape[2])
    keys = np.empty((cap, d), dtype=np.float32)
    vals = np.empty((cap, d), dtype=np.float32)
    scores = np.empty((M, cap), dtype=np.float32)
    krow = np.empty(d, dtype=np.float32)
    qrows = np.empty((M, d), dtype=np.float32)
    acc = np.empty((M, d), dtype=np.float32)
    plain = np.empty((M, d), dtype=np.float32)  # rotated values: the sink's and buffer's (unrotated) share
    norm = np.empty(M, dtype=np.float32)
    exponents = np.empty(cap, dtype=np.int32)
    pa = np.empty((M, max(pv_factors[0].shape[3], dv_factors[0].shape[3], 1)), dtype=np.float32)
    column = np.empty(d, dtype=np.float32)
    pk_s = _run_scratch(pk, pk_factors, rotated_keys, d)
    dk_s = _run_scratch(dk, dk_factors, rotated_keys, d)
    pv_s = _run_scratch(pv, _NO_FACTORS, False, d)
    dv_s = _run_scratch(dv, _NO_FACTORS, False, d)
    tile = np.empty((d, 64), dtype=np.float32)
    rotated_tail = tail_v[5] and tail_v[0].shape[2] > 0  # values' buffer coded in the rotated basis
    centered = value_center.shape[0] > 0  # (values handed centered: the output takes the centers)
    for pair in range(start, stop):
        b, h = pair // H, pair % H
        s, p, c, f = rows[b, 0], rows[b, 1], rows[b, 2], rows[b, 3]
        L = s + p + c * nb + f
        for m in range(M):  # query row m: head h*G + m // QL, token m % QL
            _query_row(q, q_cos, q_sin, q_rounding, q_scale, b, h * G + m // QL, m % QL, qrows[m])
        _plane(sink_k, buf_k, tail_k, b, h, s, p, c, f, nb, pk, pk_factors, dk, dk_factors, rotated_keys, keys,
               pk_s, dk_s, True, tile)
        for t in range(L):  # key t rotated at its position (HF's rotate_half RoPE), then its scores
            for i in range(half):
                x1, x2, ct, st = keys[t, i], keys[t, i + half], cos[b, t, i], sin[b, t, i]
                krow[i] = x1 * ct - x2 * st
                krow[i + half] = x2 * ct + x1 * st
            for m in range(M):
                dot = _F32(0.0)
                for k in range(d):
                    dot += qrows[m, k] * krow[k]
                scores[m, t] = dot
        for m in range(M):  # softmax over the tokens query row m sees (causal, sliding window)
            limit = limits[b, m % QL]
            low = max(0, limit - window + 1) if window > 0 else 0
            high = min(limit + 1, L)
            norm[m] = _softmax_row(scores[m], low, high, L, exponents)
        cv, fv = (c - 1, f + nb) if held_values and c > 0 else (c, f)  # the values' chunks and buffer
        _plane(sink_v, buf_v, tail_v, b, h, s, p, cv, fv, nb, pv, _NO_FACTORS, dv, _NO_FACTORS, False, vals, pv_s,
               dv_s, False, tile)
        if centered and not exact_centered:
            _center_exact(vals, value_center, tail_v, b, h, s, s + p + cv * nb, fv)
        acc[:] = 0.0
        plain[:] = 0.0
        compressed = s + p + cv * nb
        if rotated_values or rotated_tail:  # acc: what is in the rotated basis, added after un-rotating it; plain:
            # the sink's and the staged tokens' share (and the chunks', when only the buffer is rotated)
            chunks = acc if rotated_values else plain
            _weighted_rows(plain, scores, vals, 0, s)
            _weighted_rows(chunks, scores, vals, s, compressed)
            if rotated_tail:
                _tail_weighted(acc, plain, scores, vals, compressed, L - compressed, tail_v[3], b)
            else:
                _weighted_rows(plain, scores, vals, compressed, L)
        else:
            chunks = acc
            _weighted_rows(acc, scores, vals, 0, L)
        if p > 0 and pv_factors[0].shape[3]:
            _add_value_lowrank(chunks, scores, pv_factors, b, h, 0, pv[9], s, p, d, pa, column)
        if dv_factors[0].shape[3]:
            for chunk in range(cv):
                _add_value_lowrank(chunks, scores, dv_factors, b, h, chunk, nb, s + p + chunk * nb, nb, d, pa,
                                   column)
        if rotated_values or rotated_tail:
            _hadamard_rows(acc, M, tile)  # (P·V·H)·H = P·V
        for m in range(M):
            for k in range(d):
                out[b, m % QL, h * G + m // QL, k] = (acc[m, k] + plain[m, k]) * norm[m]
            if centered and limits[b, m % QL] >= 0:
                for k in range(d):
                    out[b, m % QL, h * G + m // QL, k] += value_center[b, h, k]


# -- torch-facing entry points ----------------------------------------------------------------------------------
def decode_attention(query: torch.Tensor, keys, values, layout, *, scaling: float, inv_freq: torch.Tensor,
                     attention_scaling: float = 1.0, sliding_window: int | None = None,
                     out: torch.Tensor | None = None, rope_tables=None, query_rotary=None,
                     query_tables=None) -> torch.Tensor:
    """Attention of `query` [B,Hq,q,d] (already rotated) over one layer's storage (`views.StreamView` keys/values,
    `views.DecodeLayout`), CPU tensors. Returns out [B, q, Hq, d] in query's dtype (HF's attention-function
    layout), as `gear_hf.kernels.decode.decode_attention` does, its (row, KV head) pairs split over torch's threads
    (`threads`; the same bits on any number of them). rope_tables: (cos, sin) of the half angles at
    layout.positions, when the caller shares them across layers (`gear_hf.cache.kernel_state`), else computed.
    query_rotary: (cos, sin) [B|1, q, d], the model's rotary tables for the step's tokens: query is handed before RoPE
    and rotated here (`rotates_query` says which dtypes), bit for bit as `compress.rope.apply_rotary` rotates it;
    query_tables: `query_rotation_tables(query, query_rotary)`, when the caller shares them across layers."""
    B, Hq, QL, D = query.shape
    Hkv = keys.buffer.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split into {Hkv} KV heads")
    if inv_freq.numel() != D // 2:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries, expected head_dim/2 = {D // 2}")
    if keys.held_chunk:
        raise ValueError("keys with a held chunk: the kernel reads a held chunk of values only (keys held too are "
                         "handed as stored, no held chunk: `FusedPath.kernel_views`)")
    value_chunks_lag = 1 if values.held_chunk else 0  # (its newest chunk is in the buffer)
    decode_chunks = layout.max_decode_chunks if keys.decode is not None else 0
    if (keys.prompt is None) != (values.prompt is None) or \
            (values.decode is not None) != (decode_chunks > value_chunks_lag):
        raise ValueError("keys and values disagree on which chunk runs exist")
    prompt_chunks = 1 if keys.prompt is not None and layout.max_prompt > 0 else 0
    value_chunks = max(decode_chunks - value_chunks_lag, 0)
    side = side_dtype(keys.buffer.dtype)
    n = layout.buffer_size
    pk, pk_factors, dk, dk_factors, rot_k = _stream_runs(keys, prompt_chunks, decode_chunks, n, D, side)
    pv, pv_factors, dv, dv_factors, rot_v = _stream_runs(values, prompt_chunks, value_chunks, n, D, side)
    cos, sin = rope_tables if rope_tables is not None else _rope_halves(layout.positions, inv_freq)
    q_cos, q_sin, rounding = query_tables if query_tables is not None else query_rotation_tables(query, query_rotary)
    q = query.float().contiguous().numpy()  # (scaled in the kernel, as `query.float() * scale` would be)
    result = np.empty((B, QL, Hq, D), dtype=np.float32)
    sink_k, sink_v = (keys.sink, values.sink) if layout.max_sink > 0 else (None, None)
    args = (q, q_cos, q_sin, rounding, np.float32(scaling * attention_scaling), layout.limits.numpy(),
            layout.rows.numpy(), cos, sin, int(sliding_window or 0), layout.buffer_size,
            _float32(sink_k, keys.buffer), _float32(sink_v, values.buffer), _float32(keys.buffer, keys.buffer),
            _float32(values.buffer, values.buffer), _tail_args(keys),
            _tail_args(values, unrotated=False), pk, pk_factors, pv, pv_factors, dk, dk_factors, dv, dv_factors,
            rot_k, rot_v, bool(values.held_chunk), _value_center(values, B, Hkv, D), bool(values.exact_centered),
            result)
    threads.launch(_attend, _attend_parallel, args, B * Hkv)  # (row, KV head) pairs over torch's threads
    result = torch.from_numpy(result)
    if out is None:
        return result.to(query.dtype)
    if tuple(out.shape) != (B, QL, Hq, D):
        raise ValueError(f"out must be [B, q, Hq, d] = {(B, QL, Hq, D)}, got {tuple(out.shape)}")
    return out.copy_(result)


def rotates_query(query: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `decode_attention` takes this query [B,Hq,q,d] before RoPE with these cos [B|1,q,d] (whole-head RoPE,
    float32 or bf16 queries: `query.rotation_rounding`)."""
    return cos.shape[-1] == query.shape[-1] and rotation_rounding(query.dtype, cos.dtype) is not None


def query_rotation_tables(query: torch.Tensor, query_rotary):
    """(q_cos, q_sin, rounding) as `_attend` takes them: float32 [B,QL,d] tables, or empty ones (query rotated)."""
    if query_rotary is None:
        return NO_QUERY_ROTATION, NO_QUERY_ROTATION, 0
    cos, sin = query_rotary
    B, _, QL, D = query.shape
    if not rotates_query(query, cos) or cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) \
            or cos.shape[1] != QL:
        raise ValueError(f"query_rotary: cos/sin must be [B|1, q, d] = [{B}|1, {QL}, {D}] for a {query.dtype} query, "
                         f"float32 or of the query's dtype (bf16); got cos {cos.dtype} {list(cos.shape)}, sin "
                         f"{sin.dtype} {list(sin.shape)}")
    rounding = rotation_rounding(query.dtype, cos.dtype)
    return (cos.expand(B, QL, D).float().contiguous().numpy(), sin.expand(B, QL, D).float().contiguous().numpy(),
            rounding)
