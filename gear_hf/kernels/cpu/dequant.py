"""CPU read kernels (numba): a chunk run decompressed (and keys rotated) in one pass.

The reference path reconstructs the whole compressed history every decode step. In eager torch that is a
dozen whole-history passes per layer (unpack, cast, scale, shift, outliers, low-rank, RoPE), each at memory
speed, and on a 2-core machine they cost more than the model's attention itself. These loops read the packed
codes once and write each float once.

They compute what `gear_hf.compress.decompress` and `gear_hf.compress.rope.apply_rotary` compute (those stay the
oracle):
bit for bit (same float32 operations in the same order, no contraction into fused multiply-adds) except where a
low-rank term is added: that is summed in another order than the matmul's, so equal to float32 rounding.
What they cover (`decompress_supported`): uniform widths 2/3/4/8, either axis, outliers, low-rank, Hadamard
rotation (undone by butterflies: to float32 rounding), widths per channel (bit planes), float32 or bf16 output
(bf16: rounded as torch rounds a bf16 tensor, RoPE with a rounding per operation); anything else takes the torch
path."""

from __future__ import annotations

import numba
import numpy as np

from .bf16 import bf16_value as _f32
from .bf16 import round_bf16 as _bf16
from .bf16 import side_entry as _side_entry
from .bf16 import stored_stats as _stored_stats
from .jit import kernel
from .pack import transpose_bits8

_F32 = np.float32


# A run is decompressed one (row, head) plane [N, d] at a time: the quantized backbone into a scratch plane, the
# outlier and low-rank terms added to it while it is in cache, then the plane written out once (rotated, for keys read
# by the attention); with nothing to rotate after, all of it straight onto out's rows. Each stage is its own loop nest
# (a call or extra code inside a loop stopped LLVM from vectorizing it). `out, at`: rows [at, at+N) of out, whole and
# C-contiguous (LLVM then knows the unit stride).


@kernel()
def _dequant_channel(codes, bits, group, scale, minimum, b, h, N, plane, rotate_rows, cos, sin, cos_at):
    """Keys-style codes packed along tokens, codes [B,H,>=P(N),d] -> plane [N,d] = code*scale + minimum, with
    scale/minimum [B,H,>=N/group,d*w] as their bytes (`read._stats_bytes`; groups run along tokens), each group's
    row decoded once. rotate_rows: each row then rotated in place by cos/sin as `_write` does, while it is in cache
    (keys with nothing to add: no pass of their own)."""
    d = plane.shape[1]
    half, cb = d // 2, b if cos.shape[0] > 1 else 0
    per, mask = 8 // bits if bits != 3 else 1, np.int32((1 << bits) - 1)
    stats = np.empty((2, d), dtype=np.float32)
    s, m = stats[0], stats[1]
    for t in range(N):  # (int32 code arithmetic: int64 lanes vectorize worse, and convert to float32 slowly)
        if t % group == 0:
            _stored_stats(scale, minimum, 0, b, h, t // group, 1, d, stats)
        if bits == 3:  # units of 8 tokens in 3 bytes: two 2-bit planes (tokens 0-3, 4-7), one high-bit plane
            unit, j = t // 8, t % 8
            low_row, high_row = unit * 3 + j // 4, unit * 3 + 2
            low_shift, high_shift = np.int32(2 * (j % 4)), np.int32(j)
            for c in range(d):
                code = ((np.int32(codes[b, h, low_row, c]) >> low_shift) & np.int32(3)) | \
                    (((np.int32(codes[b, h, high_row, c]) >> high_shift) & np.int32(1)) << np.int32(2))
                plane[t, c] = _F32(code) * s[c] + m[c]
        else:
            row, shift = t // per, np.int32(bits * (t % per))
            for c in range(d):
                code = (np.int32(codes[b, h, row, c]) >> shift) & mask
                plane[t, c] = _F32(code) * s[c] + m[c]
        if rotate_rows:
            ct = cos_at + t
            for i in range(half):
                x1, x2 = plane[t, i], plane[t, i + half]
                plane[t, i] = x1 * cos[cb, 0, ct, i] - x2 * sin[cb, 0, ct, i]
                plane[t, i + half] = x2 * cos[cb, 0, ct, i + half] + x1 * sin[cb, 0, ct, i + half]


@kernel()
def _spread_codes(codes, bits, b, h, N, out):
    """Codes packed along channels, codes [B,H,>=N,P] -> one code per byte, out uint8 [N, W] (W: P's codes rounded
    up to 8): each byte's (or 3-bit unit's) fields spread over the bytes of a wider integer (little-endian).
    Lane-independent integer ops over whole rows vectorize; a per-code shift and mask does not."""
    P = codes.shape[3]
    if bits == 8:
        for t in range(N):
            for p in range(P):
                out[t, p] = codes[b, h, t, p]
    elif bits == 4:
        out16 = out.view(np.uint16)
        for t in range(N):
            for p in range(P):
                x = np.uint16(codes[b, h, t, p])
                out16[t, p] = (x | (x << 4)) & 0x0F0F
    elif bits == 2:
        out32 = out.view(np.uint32)
        for t in range(N):
            for p in range(P):
                x = (np.uint32(codes[b, h, t, p]) * np.uint32(0x1001)) & np.uint32(0x000F000F)
                out32[t, p] = (x * np.uint32(0x41)) & np.uint32(0x03030303)
    else:  # 3 bits: units of 8 codes in 3 bytes (2-bit planes of codes 0-3 and 4-7, then the high bits)
        out64 = out.view(np.uint64)
        for t in range(N):
            for u in range(P // 3):
                lo0 = (np.uint64(codes[b, h, t, 3 * u]) * np.uint64(0x1001)) & np.uint64(0x000F000F)
                lo1 = (np.uint64(codes[b, h, t, 3 * u + 1]) * np.uint64(0x1001)) & np.uint64(0x000F000F)
                lo0 = (lo0 * np.uint64(0x41)) & np.uint64(0x03030303)
                lo1 = (lo1 * np.uint64(0x41)) & np.uint64(0x03030303)
                hi = np.uint64(codes[b, h, t, 3 * u + 2])
                hi = (hi | (hi << np.uint64(28))) & np.uint64(0x0000000F0000000F)
                hi = (hi | (hi << np.uint64(14))) & np.uint64(0x0003000300030003)
                hi = (hi | (hi << np.uint64(7))) & np.uint64(0x0101010101010101)
                out64[t, u] = lo0 | (lo1 << np.uint64(32)) | (hi << np.uint64(2))


@kernel()
def _dequant_token(spread, scale, minimum, top, b, h, N, G, plane):
    """Values-style: spread codes [N, d] (`_spread_codes`) -> plane [N, d] (the d channels as G groups of g) =
    code*scale + minimum, scale/minimum [B,H,N,G*w] as their bytes (`bf16.stored_stats`: 8-bit statistics' codes,
    top the highest code; bf16; float32). Every group's statistics are decoded first, then the rows written
    from 2-d rows: decoded inside the row loop, or written through an [N, G, g] view, the rows did not vectorize
    (2.2x slower); one group a row takes whole rows (slices of a runtime width cost 1.6x more)."""
    g = plane.shape[1] // G
    stats = np.empty((2, N * G), dtype=np.float32)
    _stored_stats(scale, minimum, top, b, h, 0, N, G, stats)
    if G == 1:  # (one group a row, the common case: whole rows, which vectorize best)
        for t in range(N):
            s, m = stats[0, t], stats[1, t]
            for c in range(g):
                plane[t, c] = _F32(spread[t, c]) * s + m
        return
    for t in range(N):
        for k in range(G):
            s, m = stats[0, t * G + k], stats[1, t * G + k]
            row, codes = plane[t, k * g : (k + 1) * g], spread[t, k * g : (k + 1) * g]
            for c in range(g):
                row[c] = _F32(codes[c]) * s + m


@kernel()
def _add_lowrank(a, a_scale, b_raw, b_scale, b, h, n, N, plane, bt, weights):
    """plane [N,d] += A Bᵀ of each chunk of n tokens, factors as stored (`CompressedChunk`): a [B,H,N,r], b
    [B,H,C*d,r] as their bytes (int8, bf16, or float32 cast from fp16: `read._factors`) with per-chunk column scales
    [B,H,C,r] float32 (ones for 16-bit factors), scaled as `compress.gear._factor` does. Four rank terms per pass
    over a row, summed pairwise (vectorized along d): float32 rounding differs from the matmul's. Scratch: bt [R,d]
    (the chunk's Bᵀ) and weights [n,R] (its A), R = r rounded up to 4, zero past r."""
    d, r, terms = plane.shape[1], a.shape[3], bt.shape[0]
    for chunk in range(N // n):
        for k in range(r):
            s = b_scale[b, h, chunk, k]
            for c in range(d):
                bt[k, c] = _side_entry(b_raw, b, h, chunk * d + c, k) * s
        for t in range(n):
            for k in range(r):
                weights[t, k] = _side_entry(a, b, h, chunk * n + t, k) * a_scale[b, h, chunk, k]
        for k0 in range(0, terms, 4):
            b0, b1, b2, b3 = bt[k0], bt[k0 + 1], bt[k0 + 2], bt[k0 + 3]
            for t in range(n):
                w0, w1, w2, w3 = weights[t, k0], weights[t, k0 + 1], weights[t, k0 + 2], weights[t, k0 + 3]
                row = plane[chunk * n + t]
                for c in range(d):
                    row[c] += (w0 * b0[c] + w1 * b1[c]) + (w2 * b2[c] + w3 * b3[c])


@numba.njit
def _index_entry(index, b, h, e, c, width):
    """Entry (e, c) of an outlier index held as its little-endian bytes (`read._index_bytes`), `width` bytes each."""
    if width == 1:
        return np.int64(index[b, h, e, c])
    value = np.int64(0)
    for i in range(width):
        value |= np.int64(index[b, h, e, c * width + i]) << (8 * i)
    return value


@kernel()
def _add_outliers(values, index, E, channel_axis, b, h, n, N, plane):
    """plane [N,d] += S: values [B,H,>=E,d], E = C*k rows in use (channel axis: token index within its chunk of n)
    or [B,H,>=N,k] (token axis: channel index), as their bytes (`read._side_bytes`); index: the same entries as
    bytes, 1, 2 or 4 each (one kernel signature for every index and side width). Unused slots hold value 0, adding
    nothing."""
    K = values.shape[3]
    width = index.shape[3] // K if K else 1
    if channel_axis:
        per_chunk = E // (N // n)
        for e in range(E):
            first = (e // per_chunk) * n
            for c in range(K):
                plane[first + _index_entry(index, b, h, e, c, width), c] += _side_entry(values, b, h, e, c)
    else:
        for t in range(N):
            for k in range(K):
                plane[t, _index_entry(index, b, h, t, k, width)] += _side_entry(values, b, h, t, k)


@kernel()
def _write(plane, b, h, N, out, at, cos, sin, cos_at):
    """out[b, h, at:at+N] = plane [N,d], rotated by cos/sin [B|1,1,>=cos_at+N,d] as `apply_rotary` rotates, per half
    x1*c1 - x2*s1 and x2*c2 + x1*s2, bit for bit (an empty dim 2: as is)."""
    d = plane.shape[1]
    if cos.shape[2] == 0:
        for t in range(N):
            for c in range(d):
                out[b, h, at + t, c] = plane[t, c]
        return
    half, cb = d // 2, b if cos.shape[0] > 1 else 0
    for t in range(N):
        ct = cos_at + t
        for i in range(half):
            x1, x2 = plane[t, i], plane[t, i + half]
            out[b, h, at + t, i] = x1 * cos[cb, 0, ct, i] - x2 * sin[cb, 0, ct, i]
            out[b, h, at + t, i + half] = x2 * cos[cb, 0, ct, i + half] + x1 * sin[cb, 0, ct, i + half]


# _dequant_planes: a channel's plane bytes as the low `width` bytes of a word
_WIDTH_MASKS = np.array([(1 << (8 * w)) - 1 for w in range(8)] + [(1 << 64) - 1], dtype=np.uint64)


@kernel()
def _dequant_planes(codes, widths, group, scale, minimum, b, h, n, N, plane, words):
    """Keys with a width per channel (`quant.pack_planes`): codes [B,H,>=N/8,S], per 8 tokens channel c's planes
    (bit t of plane j = bit j of token t's code) at bytes [start_c, start_c + widths[c]) with start_c the sum of
    the widths before it, widths [B,H,C,d] (1..8) per chunk of n tokens -> plane [N,d] = code*scale + minimum.
    A channel's planes, as the bytes of one word, become its 8 codes by an 8x8 bit transpose (`transpose_bits8`).
    Each stage is a loop over the channels of its own: every channel's word read (unaligned, from a copy of the 8
    tokens' bytes: no loop of `width` iterations), then all transposed, then each token's row written: the
    transposes vectorize in uint64 lanes (one channel through all three stages at a time ran 1.6x slower).
    words: scratch [5, d+2] uint64 (`_scratch`)."""
    d = plane.shape[1]
    S = codes.shape[3]
    unit, word, mask, starts = words[0], words[1], words[2], words[3].view(np.int64)
    unit_bytes = unit.view(np.uint8)  # (S <= 8d bytes, and one word past the last channel's start)
    stats = words[4].view(np.float32)[: 2 * d].reshape(2, d)
    last_group = -1
    for chunk in range(N // n):
        start = 0
        for c in range(d):
            width = widths[b, h, chunk, c]
            starts[c], mask[c] = start, _WIDTH_MASKS[width]
            start += width
        for u in range(chunk * n // 8, (chunk + 1) * n // 8):
            for i in range(S):
                unit_bytes[i] = codes[b, h, u, i]
            for c in range(d):  # bytes [start, start+8) of the unit, as one word (the shift by 64 - r in two steps)
                at, r = starts[c] >> 3, np.uint64(8 * (starts[c] & 7))
                word[c] = ((unit[at] >> r) | ((unit[at + 1] << (np.uint64(63) - r)) << np.uint64(1))) & mask[c]
            for c in range(d):
                word[c] = transpose_bits8(word[c])
            for t in range(8):
                token = 8 * u + t
                g = token // group
                if g != last_group:  # (the group's scale and minimum as float32 rows, decoded once)
                    _stored_stats(scale, minimum, 0, b, h, g, 1, d, stats)
                    last_group = g
                shift = np.uint64(8 * t)
                for c in range(d):
                    plane[token, c] = _F32(np.int32((word[c] >> shift) & np.uint64(0xFF))) * stats[0, c] + \
                        stats[1, c]


@kernel()
def _hadamard_rows(x, N, tile):
    """Rows of x [N, d] times the block-diagonal normalized Sylvester matrix (blocks of b = d's largest power-of-two
    divisor), as `compress.rotation.rotate`: butterflies on tiles of rows held transposed in tile [d, L] (a tile's
    L tokens along the vector lanes), then the scale. Summed in another order than the matmul: equal to float32
    rounding."""
    d, L = x.shape[1], tile.shape[1]
    b = d & -d
    scale = _F32(1.0 / np.sqrt(b))  # (the matrix entries: 1/sqrt(b) rounded to float32)
    for t0 in range(0, N, L):
        m = min(L, N - t0)
        for j in range(m):  # (rows read whole; the tile is in L1)
            for c in range(d):
                tile[c, j] = x[t0 + j, c]
        s = 1
        while s < b:  # (2s divides b, and b divides d: every pair lies inside one block)
            for base in range(0, d, 2 * s):
                for k in range(base, base + s):
                    for j in range(L):
                        p, q = tile[k, j], tile[k + s, j]
                        tile[k, j], tile[k + s, j] = p + q, p - q
            s *= 2
        for j in range(m):
            for c in range(d):
                x[t0 + j, c] = tile[c, j] * scale


@numba.njit
def _scratch(a, channel_axis, hadamard, widths, n, N, d):
    """The per-plane scratch of `_assemble`: (plane [N,d], spread codes, low-rank bt and weights, Hadamard tile,
    bit-plane words); empty where the run does not need one."""
    bt = np.zeros(((a.shape[3] + 3) // 4 * 4, d), dtype=np.float32)
    return (np.empty((N, d), dtype=np.float32),  # one (row, head) at a time, while terms are added before rotating
            np.empty((0 if channel_axis else N, d), dtype=np.uint8),  # (token axis: d % 8 == 0: codes fill d)
            bt, np.zeros((n if a.shape[3] else 0, bt.shape[0]), dtype=np.float32),
            np.empty((d, 64 if hadamard else 0), dtype=np.float32),
            np.empty((5 if widths.shape[2] else 0, d + 2), dtype=np.uint64))


@numba.njit
def _assemble(codes, bits, group, channel_axis, scale, minimum, a, a_scale, b_raw, b_scale, values, index, rows, n,
              N, hadamard, widths, b, h, target, rotate_rows, cos, sin, cos_at, spread, bt, weights, tile, plane_words):
    """Plane (b, h) of the run into target [N,d] float32: the codes dequantized (rotate_rows: keys with nothing
    to add, rotated as they are written), then the outlier and low-rank terms and the Hadamard rotation undone."""
    d = target.shape[1]
    if widths.shape[2]:
        _dequant_planes(codes, widths, group, scale, minimum, b, h, n, N, target, plane_words)
    elif channel_axis:
        _dequant_channel(codes, bits, group, scale, minimum, b, h, N, target, rotate_rows, cos, sin, cos_at)
    else:
        _spread_codes(codes, bits, b, h, N, spread)
        _dequant_token(spread, scale, minimum, (1 << bits) - 1, b, h, N, d // group, target)
    if rows:  # (D̂ + S) + A Bᵀ, in the oracle's order
        _add_outliers(values, index, rows, channel_axis, b, h, n, N, target)
    if a.shape[3]:
        _add_lowrank(a, a_scale, b_raw, b_scale, b, h, n, N, target, bt, weights)
    if hadamard:  # undone before RoPE, as decompress then apply_rotary do
        _hadamard_rows(target, N, tile)


@kernel()
def _decompress(codes, bits, group, channel_axis, scale, minimum, a, a_scale, b_raw, b_scale, values, index, rows, n,
                N, hadamard, widths, out, at, cos, sin, cos_at):
    """A run of N = C*n tokens (the arrays of `decompress_into`) into out[:, :, at:at+N] float32, plane by plane;
    widths [B,H,C,d]: codes of a width per channel (`_dequant_planes`), else [B,H,0,d]."""
    B, H, _, d = out.shape
    plane, spread, bt, weights, tile, plane_words = _scratch(a, channel_axis, hadamard, widths, n, N, d)
    # nothing to add to the codes (and keys rotated row by row as they are written): straight into out, no plane
    rotate = cos.shape[2] > 0
    direct = a.shape[3] == 0 and rows == 0 and not hadamard and widths.shape[2] == 0 \
        and (channel_axis or not rotate)
    in_place = direct or not rotate  # nothing to rotate once the terms are added: they are added on out's rows
    for b in range(B):
        for h in range(H):
            target = out[b, h, at : at + N] if in_place else plane
            _assemble(codes, bits, group, channel_axis, scale, minimum, a, a_scale, b_raw, b_scale, values, index,
                      rows, n, N, hadamard, widths, b, h, target, direct and rotate, cos, sin, cos_at, spread, bt,
                      weights, tile, plane_words)
            if not in_place:
                _write(plane, b, h, N, out, at, cos, sin, cos_at)


@kernel()
def _decompress_bf16(codes, bits, group, channel_axis, scale, minimum, a, a_scale, b_raw, b_scale, values, index,
                     rows, n, N, hadamard, widths, out, at, cos, sin, cos_at):
    """`_decompress` into out [B,H,>=at+N,d] of bf16 bits (int16), with cos/sin in bf16 bits: each plane assembled in
    float32 and rounded once as it is written (what decompress into a bf16 tensor does), keys then rotated with
    a rounding after every operation, as `apply_rotary` on bf16 tensors does (`_write_bf16`)."""
    B, H, _, d = out.shape
    plane, spread, bt, weights, tile, plane_words = _scratch(a, channel_axis, hadamard, widths, n, N, d)
    for b in range(B):
        for h in range(H):
            _assemble(codes, bits, group, channel_axis, scale, minimum, a, a_scale, b_raw, b_scale, values, index,
                      rows, n, N, hadamard, widths, b, h, plane, False, cos, sin, cos_at, spread, bt, weights, tile,
                      plane_words)
            _write_bf16(plane, b, h, N, out, at, cos, sin, cos_at)


@kernel()
def _write_bf16(plane, b, h, N, out, at, cos, sin, cos_at):
    """out[b, h, at:at+N] = plane [N,d] in bf16 bits (rounded to nearest even), rotated by cos/sin [B|1,1,..,d] bf16
    bits (an empty dim 2: as is) as `apply_rotary` computes on bf16 tensors: rne(rne(x1*c1) - rne(x2*s1)) and
    rne(rne(x2*c2) + rne(x1*s2)), x1/x2 the halves of the plane rounded first."""
    d = plane.shape[1]
    if cos.shape[2] == 0:
        for t in range(N):
            for c in range(d):
                out[b, h, at + t, c] = _bf16(plane[t, c])
        return
    half, cb = d // 2, b if cos.shape[0] > 1 else 0
    for t in range(N):
        ct = cos_at + t
        for i in range(half):
            j = i + half
            x1, x2 = _f32(_bf16(plane[t, i])), _f32(_bf16(plane[t, j]))
            c1, s1, c2, s2 = _f32(cos[cb, 0, ct, i]), _f32(sin[cb, 0, ct, i]), _f32(cos[cb, 0, ct, j]), \
                _f32(sin[cb, 0, ct, j])
            out[b, h, at + t, i] = _bf16(_f32(_bf16(x1 * c1)) - _f32(_bf16(x2 * s1)))
            out[b, h, at + t, j] = _bf16(_f32(_bf16(x2 * c2)) + _f32(_bf16(x1 * s2)))


@kernel()
def _rotate(x, x_at, cos, sin, cos_at, T, out, out_at):
    """out[:, :, out_at:+T] = x[:, :, x_at:+T] rotated as `_write` rotates (`apply_rotary`); cos/sin
    [B|1,1,>=cos_at+T,d]. (Not in place: LLVM vectorizes distinct arrays.)"""
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            _write(x[b, h, x_at : x_at + T], b, h, T, out, out_at, cos, sin, cos_at)
