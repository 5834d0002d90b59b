"""CPU compression kernel, the outlier choice (numba): `outliers.select_outliers` on every vector of a (row, head)
plane, bit for bit (ties ranked by position): the k largest and k smallest entries of each channel (keys) or token
(values), one vector at a time (`_extremes`) or, for few slots, every vector at once on ranking keys
(`_extremes_lanes`); `_choose` picks between them for a plane. Used by `compress._compress`."""

from __future__ import annotations

import numba
import numpy as np

from .jit import kernel

_F32 = np.float32
_FLT_MAX = _F32(np.finfo(np.float32).max)
_INF = _F32(np.inf)


# -- the outlier choice (select_outliers on one vector) ------------------------------------------------------
@numba.njit
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


@kernel()
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


@numba.njit
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


@numba.njit
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


@kernel()
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


@kernel()
def _rank_keys(row, p, top_key, low_key):
    """Entry p of every vector (row [N]): top_key (the largest ranks first) and low_key (the smallest first)."""
    for j in range(row.shape[0]):
        bits = np.int64(_F32(row[j]).view(np.int32))
        magnitude = bits & 0x7FFFFFFF
        order = (-magnitude if bits < 0 else magnitude) << 32
        top_key[j] = order | (_LOW - p)
        low_key[j] = order | p


@kernel()
def _keep_largest(prev, cur, key):
    """One slot of ranked lists (slot s-1: prev, slot s: cur) after `key` came in, by min/max (vectorizes)."""
    for j in range(key.shape[0]):
        cur[j] = max(cur[j], min(prev[j], key[j]))


@kernel()
def _keep_smallest(prev, cur, key):
    for j in range(key.shape[0]):
        cur[j] = min(cur[j], max(prev[j], key[j]))


@kernel()
def _key_value(key):
    """The float32 value a ranking key holds (-0.0 reads as +0.0)."""
    order = key >> 32
    sign = np.uint32(np.uint32(order < 0) << np.uint32(31))
    return np.uint32(np.uint32(abs(order)) | sign).view(_F32)


@kernel()
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


@numba.njit
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


@kernel()
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


# Up to this many list slots (k+1 largest, 2k+1 smallest) the outliers of a plane's vectors are ranked all at once
# (`_extremes_lanes`), beyond one vector at a time (`_extremes`). Only the speed depends on it.
_MAX_LANE_SLOTS = 11


@numba.njit
def _transpose(plane, out):
    """out [d, n] = plane [n, d]ᵀ, in tiles of 16 rows (whole cache lines written)."""
    n, d = plane.shape
    for t0 in range(0, n, 16):
        for c in range(d):
            for t in range(t0, min(n, t0 + 16)):
                out[c, t] = plane[t, c]


@numba.njit
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
