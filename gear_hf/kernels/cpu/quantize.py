"""CPU compression kernel, quantization (numba): a plane's group statistics and codes (`quant.quantize`: 16-bit
statistics as `quant._stored_stats` rounds them, 8-bit ones as `quant.stats8` chooses them), the outliers' exact codes
and values (`gear.exact_outliers`) and the residual R = X - D̂ - S the low-rank term is fitted to, bit for bit (the
same float32 operations in the same order). Used by `compress._compress`."""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from .bf16 import _LOG_SCALES
from .bf16 import bf16_step as _bf16_next
from .bf16 import bf16_value as _f32
from .bf16 import decode_stats8 as _decode_stats8
from .bf16 import floor_bf16 as _floor_bf16
from .bf16 import round_bf16 as _bf16
from .bf16 import stats_value as _stats_value

_F32 = np.float32
_INF = _F32(np.inf)


@numba.njit
def _in_model(v, model_bf16):
    """v rounded to the model dtype (bf16 or float32) and back to float32."""
    return _f32(_bf16(v)) if model_bf16 else v


# -- quantization (quant.quantize, quant._stored_stats) -------------------------------------------------------
@numba.njit
def _stats(lo, hi, top):
    """(minimum, scale) bf16 bits for a group spanning [lo, hi], as `quant._stored_stats`; an empty group (lo
    infinite) is [0, 0]."""
    lo, hi = _nonempty(lo, hi)
    minimum = _floor_bf16(lo)
    m = _f32(minimum)
    scale = _bf16((hi - m) / _F32(top))
    if m + _F32(top) * _f32(scale) < hi:
        scale = _bf16_next(scale, True)
    return minimum, scale


@numba.njit
def _nonempty(lo, hi):
    """[lo, hi], or [0, 0] for an empty group (lo infinite: every entry excluded), as `quant.quantize` takes it."""
    if lo == _INF or lo == -_INF:
        return _F32(0.0), _F32(0.0)
    return lo, hi


_TOP_SCALE = _LOG_SCALES[-1]  # the 8-bit grid's largest scale


@numba.njit
def _stats8(lo, hi, top):
    """(scale code, zero-point code, fits) of 8-bit statistics for a group spanning [lo, hi], as `quant.stats8`
    chooses them (the same float32 operations; its whole-chunk loop of up to three steps taken per group, which
    gives each group the same codes). fits: the range is within the grid (else `quant.stats8` raises; the codes are
    then clamped, unspecified)."""
    lo, hi = _nonempty(lo, hi)
    t = _F32(top)
    step = _F32(top / 255)  # (a Python float in the oracle, cast to float32 where it divides)
    if lo > 0:
        need = hi / t
    elif hi < 0:
        need = -lo / t
    else:
        need = (hi - lo) / _F32(top - top / 255)
    fits = not need > _TOP_SCALE
    start, end = 0, _LOG_SCALES.shape[0]  # torch.searchsorted (left): the first code whose scale >= need
    while start < end:
        mid = (start + end) >> 1
        if not _LOG_SCALES[mid] >= need:
            start = mid + 1
        else:
            end = mid
    code = min(start, 255)
    zero = _zero_point(lo, code, t, step)
    for _ in range(3):  # the decoded range in float32 may fall short of [lo, hi]: one code up
        s, m = _decode_stats8(code, zero, top)
        if (m > lo or m + t * s < hi) and code < 255:
            code += 1
            zero = _zero_point(lo, code, t, step)
        else:
            break
    return np.uint8(code), zero, fits


@numba.njit
def _zero_point(lo, code, top, step):
    """The smallest grid zero point (uint8 code) with a decoded minimum <= lo, for scale code `code` (`quant.stats8`;
    top float32, step = top / 255 in float32)."""
    s = _LOG_SCALES[code]
    z = np.ceil(min(max(-lo / (s if s > 0 else _F32(1.0)), _F32(0.0)), top) / step)
    return np.uint8(min(z, _F32(255.0)))


def _encode_group(scale, minimum, at, lo, hi, top):
    """Write the statistics of the group spanning [lo, hi] at scale[at] and minimum[at] (16-bit fields: bf16 bits,
    `_stats`; 8-bit: uint8 codes, `_stats8`); return (minimum, scale) float32 as they decode, and whether the range
    fits (always, for 16 bits)."""
    raise NotImplementedError("numba only: called from the CPU kernels")


@overload(_encode_group)
def _encode_group_impl(scale, minimum, at, lo, hi, top):
    if isinstance(scale.dtype, types.Integer) and scale.dtype.bitwidth == 8:
        def encode8(scale, minimum, at, lo, hi, top):
            scale[at], minimum[at], fits = _stats8(lo, hi, top)
            s, m = _decode_stats8(scale[at], minimum[at], top)
            return m, s, fits
        return encode8

    def encode16(scale, minimum, at, lo, hi, top):
        minimum[at], scale[at] = _stats(lo, hi, top)
        return _f32(minimum[at]), _f32(scale[at]), True
    return encode16


@numba.njit
def _code(v, m, safe, top):
    c = np.rint((v - m) / safe)
    return np.uint8(min(max(c, _F32(0.0)), _F32(top)))


@numba.njit
def _safe(s):
    """The codes' divisor: the scale, or 1 where it is 0 (an empty or constant-zero group)."""
    return s if s > 0 else _F32(1.0)


@numba.njit
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
            m[c], safe[c] = _f32(minimum[g, c]), _safe(_f32(scale[g, c]))
        for t in range(g * group, (g + 1) * group):
            for c in range(d):
                codes[t, c] = _code(plane[t, c], m[c], safe[c], tops[c])


@numba.njit
def _quantize_token(plane, excluded, group, top, scale, minimum, codes):
    """Groups of `group` channels per token (the last one shorter when group does not split d): stats [n, G], 16-bit
    (bf16 bits) or 8-bit (uint8 codes, `_encode_group`). Returns whether every group's range fits (8-bit grid)."""
    n, d = plane.shape
    G = scale.shape[1]
    fits = True
    for t in range(n):
        for k in range(G):
            lo, hi = _INF, -_INF
            for c in range(k * group, min(d, (k + 1) * group)):
                v = plane[t, c]
                lo = min(lo, _INF if excluded[t, c] else v)
                hi = max(hi, -_INF if excluded[t, c] else v)
            m, s, group_fits = _encode_group(scale, minimum, (t, k), lo, hi, top)
            fits &= group_fits
            safe = _safe(s)
            for c in range(k * group, min(d, (k + 1) * group)):
                codes[t, c] = _code(plane[t, c], m, safe, top)
    return fits


# -- an outlier's code and value (gear.exact_outliers) --------------------------------------------------------
_CODE_STEPS = (0, 1, -1, 2, -2)
_ULP_STEPS = (0, 1, -1, 2, -2)


@numba.njit
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


@numba.njit
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
                s_g, m_g = _stats_value(scale[g], minimum[g], top)
                codes[t, c], sparse[at] = _exact(plane[t, c], codes[t, c], s_g, m_g, top, model_bf16)
            else:
                sparse[at] = 0


@numba.njit
def _residual(plane, codes, channel_axis, group, top, scale, minimum, k, slot_index, slot_used, sparse, out):
    """out [n, d] = X - (D̂ + S): D̂ = code*scale + minimum (statistics as stored: 16-bit, or 8-bit decoded, top
    their highest code), S added at the used slots (as scatter_add adds every slot, an unused one adding 0 at
    index 0)."""
    n, d = plane.shape
    if channel_axis:
        for t in range(n):
            g = t // group
            for c in range(d):
                s, m = _stats_value(scale[g, c], minimum[g, c], top)
                out[t, c] = plane[t, c] - (_F32(codes[t, c]) * s + m)
    else:
        for t in range(n):
            for g in range(scale.shape[1]):
                s, m = _stats_value(scale[t, g], minimum[t, g], top)
                for c in range(g * group, min(d, (g + 1) * group)):
                    out[t, c] = plane[t, c] - (_F32(codes[t, c]) * s + m)
    for v in range(d if channel_axis else n):
        unused = False
        for s in range(k):
            if not slot_used[v, s]:
                unused = True
                continue
            t, c = (slot_index[v, s], v) if channel_axis else (v, slot_index[v, s])
            out[t, c] = plane[t, c] - _approx(codes, channel_axis, group, top, scale, minimum, sparse, t, c, s, v)
        if unused:  # unused slots (index 0) add 0 to entry 0 after its own S, if it has one
            t, c = (0, v) if channel_axis else (v, 0)
            first = (0, c) if channel_axis else (t, 0)
            s0, m0 = _stats_value(scale[first], minimum[first], top)
            approx = _F32(codes[t, c]) * s0 + m0
            for s in range(k):
                if slot_used[v, s] and slot_index[v, s] == 0:
                    approx = _approx(codes, channel_axis, group, top, scale, minimum, sparse, t, c, s, v)
            out[t, c] = plane[t, c] - (approx + _F32(0.0))


@numba.njit
def _approx(codes, channel_axis, group, top, scale, minimum, sparse, t, c, s, v):
    """D̂ + S at outlier entry (t, c) of slot s of vector v."""
    g = (t // group, c) if channel_axis else (t, c // group)
    s_g, m_g = _stats_value(scale[g], minimum[g], top)
    return _F32(codes[t, c]) * s_g + m_g + _f32(sparse[(s, v) if channel_axis else (v, s)])
