"""CPU compression kernel (numba): a chunk's outliers, quantized backbone and residual, one (row, head) plane at a time.

What `gear_hf.compress.gear.compress` computes before the low-rank fit, bit for bit: the outlier choice
(`outliers.select_outliers`), the group statistics and codes (`quant.quantize`), the outliers' exact codes and
values (`gear.exact_outliers`), the packed codes (`quant.pack_codes`, or `pack_planes` for widths per channel) and
the residual R = X - D̂ - S the low-rank term is fitted to (`lowrank.py` fits it). The torch path spends most of a
prefill's compression in a few hundred small whole-chunk ops (ranking keys, masks, gathers, casts); here each plane
is read a few times while it is in cache.

Exactness: the same float32 operations in the same order (no fused multiply-adds), 16-bit values rounded to
nearest even as torch converts them, ties ranked by position as `select_outliers` ranks them. Covered
(`compress_supported`): bf16 and float32 models (side information in bf16), widths 2/3/4/8 or one per channel
(keys), either axis, Hadamard rotation (the chunk rotated first, as the oracle does), no padding mask, no range
search; anything else takes the torch path. Non-finite input gives unspecified outputs (the cache refuses it once
per step), never a crash.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...compress import ChunkSpec, outliers, quant
from ...compress.gear import Backbone, check_channel_bits, side_dtype
from ...compress.rotation import rotate
from . import arrays
from .bf16 import bf16_step as _bf16_next, bf16_value as _f32, round_bf16 as _bf16

_F32 = np.float32
_FLT_MAX = _F32(np.finfo(np.float32).max)
_INF = _F32(np.inf)


@numba.njit(inline="always")
def _in_model(v, model_bf16):
    """v rounded to the model dtype (bf16 or float32) and back to float32."""
    return _f32(_bf16(v)) if model_bf16 else v


# -- the outlier choice (select_outliers on one vector) ------------------------------------------------------
@numba.njit(inline="always")
def _insert(v, p, filled, count, kept_v, kept_i, largest):
    """Insert entry (v, position p) into the ranked list kept_v/kept_i that holds `filled` of its `count` slots
    (full: the last is dropped), after every entry that ranks before it (larger, or smaller, or equal). Returns the
    value in the last slot once full (what an entry must beat to enter), else an infinity that lets every entry in."""
    s = filled if filled < count else count - 1
    while s > 0 and (kept_v[s - 1] < v if largest else kept_v[s - 1] > v):
        kept_v[s], kept_i[s] = kept_v[s - 1], kept_i[s - 1]
        s -= 1
    kept_v[s], kept_i[s] = v, p
    if filled + 1 < count:
        return -_INF if largest else _INF
    return kept_v[count - 1]


@numba.njit(cache=True, nogil=True)
def _extremes(vec, L, k, top_v, top_i, bottom_v, bottom_i, taken, blocks):
    """vec[:L]'s k+1 largest (top, largest first) and, once the k largest are taken, the min(k+1, L-k) smallest of
    the rest (bottom, smallest first), equal values by position, as `outliers._extremes`; two passes, each entry
    compared with the bound `_bounds` gives and with the value it must beat. Returns the bottom's length.
    taken: a False scratch of L entries; blocks: a [3, >= 2k+2] scratch."""
    floor, ceiling = _bounds(vec, L, k, blocks)
    top_v[:], top_i[:], bottom_v[:], bottom_i[:] = -_INF, 0, _INF, 0  # (what non-finite input leaves unfilled)
    count, bar, filled = k + 1, -_INF, 0
    for p in range(L):
        v = vec[p]
        if v >= floor and (v > bar or filled < count):
            bar = _insert(v, p, filled, count, top_v, top_i, True)
            filled += 1
    for s in range(k):
        taken[top_i[s]] = True
    count, bar, filled = min(k + 1, L - k), _INF, 0
    for p in range(L):
        v = vec[p]
        if v <= ceiling and (v < bar or filled < count) and not taken[p]:
            bar = _insert(v, p, filled, count, bottom_v, bottom_i, False)
            filled += 1
    for s in range(k):
        taken[top_i[s]] = False
    return count


@numba.njit(inline="always")
def _bounds(vec, L, k, blocks):
    """(floor, ceiling): each of vec's k+1 largest is >= floor and, once its k largest are taken, each of the k+1
    smallest of the rest is <= ceiling (infinite: no bound), so that the ranking passes skip nearly every entry.
    With m = 2(k+1) blocks (entry p in block p % m: neighbouring tokens are alike), at least k+1 entries are >= the
    (k+1)-th largest block maximum, and at least k+1 are <= the (k+1)-th smallest block minimum; the latter stay in
    the rest when floor > ceiling (the k largest, all >= floor, are not among them)."""
    m = 2 * (k + 1)
    if L < 4 * m:  # short vectors: little to skip
        return -_INF, _INF
    block_max, block_min, ranked = blocks[0], blocks[1], blocks[2]
    block_max[:m], block_min[:m] = -_INF, _INF
    for p0 in range(0, L - m + 1, m):
        for j in range(m):
            block_max[j] = max(block_max[j], vec[p0 + j])
            block_min[j] = min(block_min[j], vec[p0 + j])
    for p in range(L - L % m, L):
        block_max[p % m] = max(block_max[p % m], vec[p])
        block_min[p % m] = min(block_min[p % m], vec[p])
    floor = _ranked_at(block_max, m, k, ranked, True)
    ceiling = _ranked_at(block_min, m, k, ranked, False)
    return floor, (ceiling if floor > ceiling else _INF)


@numba.njit(inline="always")
def _ranked_at(values, m, k, ranked, largest):
    """The (k+1)-th largest (or smallest) of values[:m], by insertion into ranked."""
    for i in range(m):
        v = values[i]
        s = i
        while s > 0 and (ranked[s - 1] < v if largest else ranked[s - 1] > v):
            ranked[s] = ranked[s - 1]
            s -= 1
        ranked[s] = v
    return ranked[k]


@numba.njit(cache=True, nogil=True)
def _split(top_v, bottom_v, k, L, bottom_count):
    """How many of the k outliers come from the top: the split that leaves the narrowest range, the first on ties
    (select_outliers' widths, both of its branches)."""
    best, best_width = 0, _INF
    for j in range(k + 1):
        p = k - j  # taken from the bottom
        if bottom_count == k + 1:  # every vector long enough (L >= 2k+1)
            width = top_v[j] - bottom_v[p]
            if width != width or width == -_INF:
                width = _INF
            elif width == _INF:
                width = _FLT_MAX  # (nan_to_num's posinf)
        else:  # L == 2k: the p-th smallest may be among the k largest
            lo = bottom_v[p] if p < bottom_count else _INF
            if (lo == _INF or lo == -_INF) and p >= L - k:
                among = L - 1 - p
                lo = top_v[among] if among < k + 1 else _INF
            width = top_v[j] - lo
            if not np.isfinite(width):
                width = _INF
        if width < best_width:  # (all infinite: the first, as argmin)
            best, best_width = j, width
    return best


# Ranking keys for many vectors at once: an entry's float32 order in the high half of an int64 (equal values, -0.0
# and +0.0 included, get equal orders) and its position in the low half, so that max/min of keys rank as
# `_extremes` does (larger values first, then lower positions; smaller values first, then lower positions).
_LOW = 0xFFFFFFFF
_KEY_MIN, _KEY_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


@numba.njit(cache=True, nogil=True)
def _rank_keys(row, p, top_key, low_key):
    """Entry p of every vector (row [N]): top_key (the largest ranks first) and low_key (the smallest first)."""
    for j in range(row.shape[0]):
        bits = np.int64(_F32(row[j]).view(np.int32))
        magnitude = bits & 0x7FFFFFFF
        order = (-magnitude if bits < 0 else magnitude) << 32
        top_key[j] = order | (_LOW - p)
        low_key[j] = order | p


@numba.njit(cache=True, nogil=True)
def _keep_largest(prev, cur, key):
    """One slot of ranked lists (slot s-1: prev, slot s: cur) after `key` came in, by min/max (vectorizes)."""
    for j in range(key.shape[0]):
        cur[j] = max(cur[j], min(prev[j], key[j]))


@numba.njit(cache=True, nogil=True)
def _keep_smallest(prev, cur, key):
    for j in range(key.shape[0]):
        cur[j] = min(cur[j], max(prev[j], key[j]))


@numba.njit(cache=True, nogil=True)
def _key_value(key):
    """The float32 value a ranking key holds (-0.0 reads as +0.0)."""
    order = key >> 32
    sign = np.uint32(np.uint32(order < 0) << np.uint32(31))
    return np.uint32(np.uint32(abs(order)) | sign).view(_F32)


@numba.njit(cache=True, nogil=True)
def _extremes_lanes(xt, top_key, low_key, top_in, low_in):
    """Ranked lists for N vectors at once, vector j in column j of xt [L, N]: its k+1 largest (top_key [k+1, N])
    and its min(2k+1, L) smallest (low_key [.., N]), as ranking keys. Every entry goes through every slot (a min
    and a max each): the loops over vectors vectorize, at a cost that grows with the lists' length (for a few
    outliers per vector; `_extremes` for many). top_in/low_in: [N] scratch."""
    top_key[:], low_key[:] = _KEY_MIN, _KEY_MAX
    for p in range(xt.shape[0]):
        _rank_keys(xt[p], p, top_in, low_in)
        for s in range(top_key.shape[0] - 1, 0, -1):  # last slot first: slot s-1 is read before it changes
            _keep_largest(top_key[s - 1], top_key[s], top_in)
        _keep_largest(top_in, top_key[0], top_in)
        for s in range(low_key.shape[0] - 1, 0, -1):
            _keep_smallest(low_key[s - 1], low_key[s], low_in)
        _keep_smallest(low_in, low_key[0], low_in)


@numba.njit(inline="always")
def _lane_lists(top_key, low_key, k, j, bottom_count, top_v, top_i, bottom_v, bottom_i):
    """Vector j's top (its k+1 largest) and bottom (the first bottom_count of its smallest not among its k
    largest) from its ranking keys, as `_extremes` returns them."""
    for s in range(k + 1):
        top_v[s], top_i[s] = _key_value(top_key[s, j]), _LOW - (top_key[s, j] & _LOW)
    b = 0
    for s in range(low_key.shape[0]):
        position = low_key[s, j] & _LOW
        taken = False
        for q in range(k):
            taken |= position == top_i[q]
        if not taken and b < bottom_count:
            bottom_v[b], bottom_i[b] = _key_value(low_key[s, j]), position
            b += 1


@numba.njit(cache=True, nogil=True)
def _slots(top_v, top_i, bottom_v, bottom_i, bottom_count, k, L, slot_index, slot_used):
    """select_outliers' slots of one vector: slot s holds the s-th largest while s < the split, then the smallest."""
    from_top = _split(top_v, bottom_v, k, L, bottom_count)
    for s in range(k):
        if s < from_top:
            value, position = top_v[s], top_i[s]
        else:
            value, position = bottom_v[s - from_top], bottom_i[s - from_top]
        used = np.isfinite(value)
        slot_used[s] = used
        slot_index[s] = position if used else 0


# -- quantization (quant.quantize, quant._stored_stats) -------------------------------------------------------
@numba.njit(inline="always")
def _stats(lo, hi, top):
    """(minimum, scale) bf16 bits for a group spanning [lo, hi], as `quant._stored_stats`; an empty group (lo
    infinite) is [0, 0]."""
    if lo == _INF or lo == -_INF:
        lo, hi = _F32(0.0), _F32(0.0)
    minimum = _bf16(lo)
    if _f32(minimum) > lo:
        minimum = _bf16_next(minimum, False)
    m = _f32(minimum)
    scale = _bf16((hi - m) / _F32(top))
    if m + _F32(top) * _f32(scale) < hi:
        scale = _bf16_next(scale, True)
    return minimum, scale


@numba.njit(inline="always")
def _code(v, m, safe, top):
    c = np.rint((v - m) / safe)
    return np.uint8(min(max(c, _F32(0.0)), _F32(top)))


@numba.njit(inline="always")
def _safe(scale_bits):
    s = _f32(scale_bits)
    return s if s > 0 else _F32(1.0)


@numba.njit(inline="always")
def _quantize_channel(plane, excluded, group, tops, scale, minimum, codes):
    """Groups of `group` tokens per channel: stats [n/group, d] (bf16 bits), codes [n, d]; tops [d]: each
    channel's highest code (its width's, for widths per channel)."""
    n, d = plane.shape
    lo, hi = np.empty(d, _F32), np.empty(d, _F32)
    m, safe = np.empty(d, _F32), np.empty(d, _F32)
    for g in range(n // group):
        lo[:] = _INF
        hi[:] = -_INF
        for t in range(g * group, (g + 1) * group):
            for c in range(d):  # (selects, not branches: the loop vectorizes)
                v = plane[t, c]
                lo[c] = min(lo[c], _INF if excluded[t, c] else v)
                hi[c] = max(hi[c], -_INF if excluded[t, c] else v)
        for c in range(d):
            minimum[g, c], scale[g, c] = _stats(lo[c], hi[c], tops[c])
            m[c], safe[c] = _f32(minimum[g, c]), _safe(scale[g, c])
        for t in range(g * group, (g + 1) * group):
            for c in range(d):
                codes[t, c] = _code(plane[t, c], m[c], safe[c], tops[c])


@numba.njit(inline="always")
def _quantize_token(plane, excluded, group, top, scale, minimum, codes):
    """Groups of `group` channels per token (the last one shorter when group does not split d): stats [n, G]."""
    n, d = plane.shape
    G = scale.shape[1]
    for t in range(n):
        for k in range(G):
            lo, hi = _INF, -_INF
            for c in range(k * group, min(d, (k + 1) * group)):
                v = plane[t, c]
                lo = min(lo, _INF if excluded[t, c] else v)
                hi = max(hi, -_INF if excluded[t, c] else v)
            minimum[t, k], scale[t, k] = _stats(lo, hi, top)
            m, safe = _f32(minimum[t, k]), _safe(scale[t, k])
            for c in range(k * group, min(d, (k + 1) * group)):
                codes[t, c] = _code(plane[t, c], m, safe, top)


# -- an outlier's code and value (gear.exact_outliers) --------------------------------------------------------
_CODE_STEPS = (0, 1, -1, 2, -2)
_ULP_STEPS = (0, 1, -1, 2, -2)


@numba.njit(inline="always")
def _exact(target, code, scale, minimum, top, model_bf16):
    """(code, S bf16 bits) such that code*scale + minimum + S, in float32, rounds to target in the model dtype:
    the first hit of the code steps x ulp steps, else the entry's code and the nearest S."""
    first_code, first_s = code, _bf16(target - (_F32(code) * scale + minimum))
    for code_step in _CODE_STEPS:
        c = min(max(np.int64(code) + code_step, 0), top)
        base = _F32(c) * scale + minimum
        nearest = _bf16(target - base)
        for ulps in _ULP_STEPS:
            s = nearest
            for _ in range(abs(ulps)):
                s = _bf16_next(s, ulps > 0)
            if _in_model(base + _f32(s), model_bf16) == target:
                return np.uint8(c), s
    return first_code, first_s


@numba.njit(inline="always")
def _exact_entries(plane, codes, channel_axis, group, k, top, model_bf16, scale, minimum, slot_index, slot_used,
                   sparse, index):
    """The chosen slots' index and S (0 at unused slots), and the entries' codes (`_exact`)."""
    for v in range(slot_index.shape[0]):
        for s in range(k):
            position = slot_index[v, s]
            t, c = (position, v) if channel_axis else (v, position)
            at = (s, v) if channel_axis else (v, s)
            index[at] = position
            if slot_used[v, s]:
                g = (t // group, c) if channel_axis else (t, c // group)
                codes[t, c], sparse[at] = _exact(plane[t, c], codes[t, c], _f32(scale[g]), _f32(minimum[g]), top,
                                                 model_bf16)
            else:
                sparse[at] = 0


# Up to this many list slots (k+1 largest, 2k+1 smallest) the outliers of a plane's vectors are ranked all at once
# (`_extremes_lanes`), beyond one vector at a time (`_extremes`). Only the speed depends on it.
_MAX_LANE_SLOTS = 11


@numba.njit(inline="always")
def _transpose(plane, out):
    """out [d, n] = plane [n, d]ᵀ, in tiles of 16 rows (whole cache lines written)."""
    n, d = plane.shape
    for t0 in range(0, n, 16):
        for c in range(d):
            for t in range(t0, min(n, t0 + 16)):
                out[c, t] = plane[t, c]


@numba.njit(inline="always")
def _choose(plane, channel_axis, k, vectors, top_v, top_i, bottom_v, bottom_i, taken, blocks, top_key, low_key,
            top_in, low_in, slot_index, slot_used):
    """select_outliers on every vector of a plane [n, d] (channels or tokens): slot_index/slot_used [V, k]."""
    n, d = plane.shape
    V, L = (d, n) if channel_axis else (n, d)
    if top_key.shape[1]:  # all at once: vectors as columns ([n, d] for channels, transposed for tokens)
        if not channel_axis:
            _transpose(plane, vectors)
        _extremes_lanes(plane if channel_axis else vectors, top_key, low_key, top_in, low_in)
        bottom_count = min(k + 1, L - k)
        for v in range(V):
            _lane_lists(top_key, low_key, k, v, bottom_count, top_v, top_i, bottom_v, bottom_i)
            _slots(top_v, top_i, bottom_v, bottom_i, bottom_count, k, L, slot_index[v], slot_used[v])
    else:  # one at a time: vectors as rows ([n, d] for tokens, transposed for channels)
        if channel_axis:
            _transpose(plane, vectors)
        for v in range(V):
            vec = vectors[v] if channel_axis else plane[v]
            bottom_count = _extremes(vec, L, k, top_v, top_i, bottom_v, bottom_i, taken, blocks)
            _slots(top_v, top_i, bottom_v, bottom_i, bottom_count, k, L, slot_index[v], slot_used[v])


# -- one chunk ------------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _compress(x, bits, widths, channel_axis, group, k, model_bf16, packed, scale, minimum, sparse, index, residual):
    """x [B,H,n,d] float32 -> packed codes [B,H,P(n),d] / [B,H,n,P(d')], scale/minimum (bf16 bits) [B,H,n/g,d] /
    [B,H,n,G], sparse (bf16 bits) and index (int64) [B,H,k,d] / [B,H,n,k] (0 at unused slots), and, when residual
    has rows, residual [B,H,n,d] = X - D̂ - S in float32. widths [B,H,d] uint8: a width per channel (keys; codes
    packed as bit planes [B,H,n/8,S], `_pack_planes`), or [0,0,0]: `bits` for all."""
    B, H, n, d = x.shape
    V, L = (d, n) if channel_axis else (n, d)
    top = (1 << bits) - 1
    tops = np.full(d, top, np.int64)
    codes = np.empty((n, d), np.uint8)
    excluded = np.zeros((n, d), np.bool_)
    lanes = 3 * k + 2 <= _MAX_LANE_SLOTS
    vectors = np.empty((d, n) if channel_axis != lanes else (0, 0), _F32)  # the plane transposed, when needed
    top_v, bottom_v = np.empty(k + 1, _F32), np.empty(k + 1, _F32)
    top_i, bottom_i = np.empty(k + 1, np.int64), np.empty(k + 1, np.int64)
    taken, blocks = np.zeros(L, np.bool_), np.empty((3, 2 * k + 2), _F32)
    W = V if lanes else 0  # ranking keys of every vector, for `_extremes_lanes`
    top_key, low_key = np.empty((k + 1, W), np.int64), np.empty((min(2 * k + 1, L), W), np.int64)
    top_in, low_in = np.empty(W, np.int64), np.empty(W, np.int64)
    slot_index, slot_used = np.zeros((V, max(k, 1)), np.int64), np.zeros((V, max(k, 1)), np.bool_)
    for b in range(B):
        for h in range(H):
            plane = x[b, h]
            if k:
                _choose(plane, channel_axis, k, vectors, top_v, top_i, bottom_v, bottom_i, taken, blocks, top_key,
                        low_key, top_in, low_in, slot_index, slot_used)
                for v in range(V):
                    for s in range(k):
                        if slot_used[v, s]:
                            if channel_axis:
                                excluded[slot_index[v, s], v] = True
                            else:
                                excluded[v, slot_index[v, s]] = True
            if widths.shape[0]:
                for c in range(d):
                    tops[c] = (1 << np.int64(widths[b, h, c])) - 1
            if channel_axis:
                _quantize_channel(plane, excluded, group, tops, scale[b, h], minimum[b, h], codes)
            else:
                _quantize_token(plane, excluded, group, top, scale[b, h], minimum[b, h], codes)
            if k:
                _exact_entries(plane, codes, channel_axis, group, k, top, model_bf16, scale[b, h], minimum[b, h],
                               slot_index, slot_used, sparse[b, h], index[b, h])
                excluded[:] = False
            if widths.shape[0]:
                _pack_planes(codes, widths[b, h], packed[b, h])
            else:
                _pack(codes, bits, channel_axis, packed[b, h])
            if residual.shape[2]:
                _residual(plane, codes, channel_axis, group, scale[b, h], minimum[b, h], k, slot_index, slot_used,
                          sparse[b, h], residual[b, h])


@numba.njit(inline="always")
def _pack(codes, bits, channel_axis, out):
    """quant.pack_codes of codes [n, d] along tokens (channel_axis) or channels (out [n, P], zero past d)."""
    n, d = codes.shape
    if bits == 8:
        for t in range(n):
            for c in range(d):
                out[t, c] = codes[t, c]
    elif channel_axis and bits != 3:  # (channels innermost: the loops vectorize)
        per = 8 // bits
        for r in range(n // per):
            for c in range(d):
                out[r, c] = codes[r * per, c]
            for j in range(1, per):
                for c in range(d):
                    out[r, c] |= np.uint8(codes[r * per + j, c] << (bits * j))
    elif channel_axis:  # 3 bits: 8 tokens in 3 bytes (2-bit planes of tokens 0-3 and 4-7, then the high bits)
        for u in range(n // 8):
            for c in range(d):
                out[3 * u, c], out[3 * u + 1, c], out[3 * u + 2, c] = 0, 0, 0
            for j in range(8):
                for c in range(d):
                    code = codes[8 * u + j, c]
                    out[3 * u + j // 4, c] |= np.uint8((code & 3) << (2 * (j % 4)))
                    out[3 * u + 2, c] |= np.uint8((code >> 2) << j)
    elif bits != 3:  # along channels: byte p holds codes p*per .. p*per+per-1 (zeros past d)
        per = 8 // bits
        for t in range(n):
            for p in range(out.shape[1]):
                byte = np.uint8(0)
                for j in range(per):
                    c = p * per + j
                    byte |= np.uint8((codes[t, c] if c < d else 0) << (bits * j))
                out[t, p] = byte
    else:  # 3 bits along channels: units of 8 channels in 3 bytes
        for t in range(n):
            for u in range(out.shape[1] // 3):
                low0, low1, high = np.uint8(0), np.uint8(0), np.uint8(0)
                for j in range(8):
                    c = 8 * u + j
                    code = codes[t, c] if c < d else 0
                    if j < 4:
                        low0 |= np.uint8((code & 3) << (2 * j))
                    else:
                        low1 |= np.uint8((code & 3) << (2 * (j - 4)))
                    high |= np.uint8((code >> 2) << j)
                out[t, 3 * u], out[t, 3 * u + 1], out[t, 3 * u + 2] = low0, low1, high


@numba.njit(inline="always")
def transpose_bits8(word):
    """A uint64 as an 8x8 bit matrix (byte r = row r) transposed: bit c of byte r becomes bit r of byte c, as
    `quant._transpose_bits8` (three masked swaps). Codes of 8 tokens <-> their bit planes."""
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        swap = (word ^ (word >> np.uint64(shift))) & np.uint64(mask)
        word ^= swap ^ (swap << np.uint64(shift))
    return word


@numba.njit(inline="always")
def _pack_planes(codes, widths, out):
    """quant.pack_planes of codes [n, d] with widths [d]: per 8 tokens, channel c's planes (bit t of plane j = bit
    j of token t's code) at bytes [start_c, start_c + widths[c]) of out [n/8, S], start_c the widths before c. The
    8 codes of a channel, as the bytes of one word, become its planes by an 8x8 bit transpose."""
    n, d = codes.shape
    for u in range(n // 8):
        start = 0
        for c in range(d):
            word = np.uint64(0)
            for t in range(8):
                word |= np.uint64(codes[8 * u + t, c]) << np.uint64(8 * t)
            word = transpose_bits8(word)
            for j in range(widths[c]):
                out[u, start + j] = (word >> np.uint64(8 * j)) & np.uint64(0xFF)
            start += widths[c]


@numba.njit(inline="always")
def _residual(plane, codes, channel_axis, group, scale, minimum, k, slot_index, slot_used, sparse, out):
    """out [n, d] = X - (D̂ + S): D̂ = code*scale + minimum, S added at the used slots (as scatter_add adds every
    slot, an unused one adding 0 at index 0)."""
    n, d = plane.shape
    if channel_axis:
        for t in range(n):
            g = t // group
            for c in range(d):
                out[t, c] = plane[t, c] - (_F32(codes[t, c]) * _f32(scale[g, c]) + _f32(minimum[g, c]))
    else:
        for t in range(n):
            for g in range(scale.shape[1]):
                s, m = _f32(scale[t, g]), _f32(minimum[t, g])
                for c in range(g * group, min(d, (g + 1) * group)):
                    out[t, c] = plane[t, c] - (_F32(codes[t, c]) * s + m)
    for v in range(d if channel_axis else n):
        unused = False
        for s in range(k):
            if not slot_used[v, s]:
                unused = True
                continue
            t, c = (slot_index[v, s], v) if channel_axis else (v, slot_index[v, s])
            out[t, c] = plane[t, c] - _approx(codes, channel_axis, group, scale, minimum, sparse, t, c, s, v)
        if unused:  # unused slots (index 0) add 0 to entry 0 after its own S, if it has one
            t, c = (0, v) if channel_axis else (v, 0)
            approx = _F32(codes[t, c]) * _f32(scale[(0, c) if channel_axis else (t, 0)]) \
                + _f32(minimum[(0, c) if channel_axis else (t, 0)])
            for s in range(k):
                if slot_used[v, s] and slot_index[v, s] == 0:
                    approx = _approx(codes, channel_axis, group, scale, minimum, sparse, t, c, s, v)
            out[t, c] = plane[t, c] - (approx + _F32(0.0))


@numba.njit(inline="always")
def _approx(codes, channel_axis, group, scale, minimum, sparse, t, c, s, v):
    """D̂ + S at outlier entry (t, c) of slot s of vector v."""
    g = (t // group, c) if channel_axis else (t, c // group)
    return _F32(codes[t, c]) * _f32(scale[g]) + _f32(minimum[g]) + _f32(sparse[(s, v) if channel_axis else (v, s)])


# -- torch-facing entry points --------------------------------------------------------------------------------
def compress_supported(spec: ChunkSpec, x: torch.Tensor) -> bool:
    """True when `compress_backbone` and `lowrank.fit_factors` cover this spec and chunk x [B,H,n,d] (else
    `compute_backbone` and `gear.fit_factors` run)."""
    if spec.range_search or (not spec.allocated and spec.bits not in quant.BITS):
        return False
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.ndim != 4:
        return False
    n, d = x.shape[2], x.shape[3]
    group = spec.group_for(n, d)
    if spec.axis == "channel":  # whole groups and whole packing units along tokens (else the torch path raises)
        return group > 0 and n % group == 0 and n % quant.codes_per_unit(spec.bits, spec.allocated) == 0
    return group > 0


def compress_backbone(x: torch.Tensor, spec: ChunkSpec, channel_bits: torch.Tensor | None = None) -> Backbone:
    """`gear_hf.compress.gear.compute_backbone(x, spec, channel_bits=channel_bits)`, bit for bit, for what
    `compress_supported` covers. channel_bits [B,H,d] uint8: the widths of an allocated spec (and only then)."""
    check_channel_bits(spec, channel_bits)
    B, H, n, d = x.shape
    channel_axis = spec.axis == "channel"
    bits = 0 if spec.allocated else int(spec.bits)
    group = spec.group_for(n, d)
    k = outliers.outliers_per_vector(n if channel_axis else d, spec.outlier_ratio)
    side = side_dtype(x.dtype)  # bf16 for both covered dtypes
    if spec.allocated:  # bit planes: per 8 tokens, the widths' sum in bytes (the same for every row and head)
        widths = channel_bits.to(torch.uint8).contiguous()
        packed = torch.empty(B, H, n // quant.PLANE_TOKENS, int(widths[0, 0].sum()) if widths.numel() else 0,
                             dtype=torch.uint8)
        stats_shape, slots_shape = (B, H, n // group, d), (B, H, k, d)
    elif channel_axis:
        widths = _UNIFORM
        packed = torch.empty(B, H, quant.packed_length(n, bits), d, dtype=torch.uint8)
        stats_shape, slots_shape = (B, H, n // group, d), (B, H, k, d)
    else:
        widths = _UNIFORM
        unit = quant.pack_unit(bits)[0]
        packed = torch.empty(B, H, n, quant.packed_length(-(-d // unit) * unit, bits), dtype=torch.uint8)
        stats_shape, slots_shape = (B, H, n, -(-d // group)), (B, H, n, k)
    scale, minimum = torch.empty(stats_shape, dtype=side), torch.empty(stats_shape, dtype=side)
    sparse, index = torch.empty(slots_shape, dtype=side), torch.empty(slots_shape, dtype=torch.long)
    residual = torch.empty(B, H, n, d) if spec.rank else torch.empty(B, H, 0, 0)
    # a rotating spec compresses the rotated chunk (rotated as the oracle rotates it), whose entries are float32 sums
    work = rotate(x) if spec.rotate else x.float()
    _compress(work.contiguous().numpy(), bits, widths if isinstance(widths, np.ndarray) else widths.numpy(),
              channel_axis, group, k, x.dtype == torch.bfloat16 and not spec.rotate, packed.numpy(),
              *(t.view(torch.int16).numpy() for t in (scale, minimum, sparse)), index.numpy(), residual.numpy())
    stored_bits = channel_bits.unsqueeze(2) if spec.allocated else torch.zeros(B, H, 0, d, dtype=torch.uint8)
    return Backbone(codes=packed, channel_bits=stored_bits, scale=scale, minimum=minimum, sparse_values=sparse,
                    sparse_index=index, residual=residual if spec.rank else None)


_UNIFORM = np.zeros((0, 0, 0), dtype=np.uint8)  # no widths per channel


# the exponent bits of a float dtype (all set: inf or NaN), and the integer dtype its bits are read as
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}


@numba.njit(cache=True, nogil=True)
def _count_nonfinite(bits, at, N, exponent):
    """Entries of rows [at, at+N) of bits [B,H,T,d] (a float tensor's bits as integers) with every exponent bit set."""
    count = 0
    for b in range(bits.shape[0]):
        for h in range(bits.shape[1]):
            for t in range(at, at + N):
                for c in range(bits.shape[3]):
                    count += (bits[b, h, t, c] & exponent) == exponent
    return count


def all_finite(x: torch.Tensor) -> torch.Tensor | None:
    """torch.isfinite(x).all() for CPU float tensors x [B,H,N,d] in one integer pass over their bits (a 0-dim bool
    tensor), or None for what it does not cover (other dtypes or shapes)."""
    if x.dtype not in _EXPONENT or x.ndim != 4 or x.device.type != "cpu" or x.stride(-1) != 1:
        return None
    int_dtype, exponent = _EXPONENT[x.dtype]
    bits, at = arrays.readable(x.view(int_dtype))
    return torch.tensor(_count_nonfinite(bits, at, x.shape[2], exponent) == 0)
