"""bf16 as torch rounds it, for the numba loops: float32 -> bf16 bits (nearest even, or the value below), bits ->
float32, one ulp; a side-information element or a group's (scale, minimum) as float32."""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from ...compress.quant import LOG_SCALES


@numba.njit
def round_bf16(v):
    """float32 -> bf16 bits, rounded to nearest even (NaN -> 0x7FC0), as torch converts."""
    if v != v:
        return np.uint16(0x7FC0)
    u = np.float32(v).view(np.uint32)
    return np.uint16((u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16))


@numba.njit
def bf16_value(bits):
    """bf16 bits -> float32 (exact)."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit
def bf16_step(bits, up):
    """The bf16 neighbour one ulp toward +inf (up) or -inf, as torch.nextafter: zero steps to the smallest
    subnormal of that sign, an infinity toward itself stays."""
    magnitude = bits & 0x7FFF
    if magnitude > 0x7F80:  # NaN
        return np.uint16(bits)
    if magnitude == 0:
        return np.uint16(0x0001 if up else 0x8001)
    away = up == (bits < 0x8000)  # moving away from zero
    if away:
        return np.uint16(bits if magnitude == 0x7F80 else bits + 1)
    return np.uint16(bits - 1)


@numba.njit
def floor_bf16(v):
    """float32 -> bf16 bits of the largest bf16 value <= v: round to nearest, then one ulp toward -inf where that went
    up (as `quant._stored_stats` rounds a minimum; `quant.decode_stats8` a zero point's)."""
    nearest = round_bf16(v)
    return bf16_step(nearest, False) if bf16_value(nearest) > v else nearest


def side_value(x):
    """A side-information element as float32: bf16 bits (int16: the fields read in place) or a number."""
    raise NotImplementedError("numba only: called from the CPU kernels")


@overload(side_value)
def _side_value(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        return lambda x: bf16_value(x)
    return lambda x: np.float32(x)


@numba.njit
def side_entry(raw, b, h, i, j):
    """Entry (i, j) of side information held as its bytes, raw uint8 [B,H,m,k,w] (`read._side_bytes`: one array type
    for every side dtype, so one signature of each kernel that reads it), as float32: w = 1, an int8 code (a low-rank
    factor's, scaled by the caller); 2, bf16; 4, float32 (fp16 models' side information, cast). Little-endian."""
    w = raw.shape[4]
    if w == 1:
        return np.float32(np.int8(raw[b, h, i, j, 0]))
    low = np.uint32(raw[b, h, i, j, 0]) | (np.uint32(raw[b, h, i, j, 1]) << np.uint32(8))
    if w == 2:
        return bf16_value(low)
    high = np.uint32(raw[b, h, i, j, 2]) | (np.uint32(raw[b, h, i, j, 3]) << np.uint32(8))
    return np.uint32(low | (high << np.uint32(16))).view(np.float32)


# 8-bit statistics (`quant.stats8`): the scale codes' table, a compile-time constant of the loops (a format constant:
# the on-disk cache keys on this folder's sources, not on quant.py's)
_LOG_SCALES = LOG_SCALES.numpy().astype(np.float32)


@numba.njit
def decode_stats8(scale_code, zero_code, top):
    """(scale, minimum) float32 of 8-bit statistics' uint8 codes, as `quant.decode_stats8` decodes them, bit for bit:
    -(zero_code * top / 255 * scale) in float32, in that order, then floored to bf16; top: the group's highest code."""
    s = _LOG_SCALES[scale_code]
    exact = -((np.float32(zero_code) * np.float32(top) / np.float32(255)) * s)
    return s, bf16_value(floor_bf16(exact))


def stats_value(scale, minimum, top):
    """(scale, minimum) float32 of one group's stored statistics: 16-bit fields (bf16 bits or numbers), or 8-bit
    statistics' uint8 scale and zero-point codes (`decode_stats8`); top: the group's highest code."""
    raise NotImplementedError("numba only: called from the CPU kernels")


@overload(stats_value)
def _stats_value(scale, minimum, top):
    if isinstance(scale, types.Integer) and scale.bitwidth == 8:
        return lambda scale, minimum, top: decode_stats8(scale, minimum, top)
    return lambda scale, minimum, top: (side_value(scale), side_value(minimum))


@numba.njit
def stored_stats(scale, minimum, top, b, h, first, count, k, out):
    """out [2, >=count*k] float32 = (scales, minimums) of rows first .. first+count-1 of statistics [b, h], k entries
    a row, row-major; the statistics held as their bytes [B,H,m,k*w] (`read._stats_bytes`: one array type for every
    statistics format, so one signature of each kernel that reads runs), w bytes an entry: 1, 8-bit statistics'
    codes, decoded as `quant.decode_stats8` decodes them, bit for bit (top: the group's highest code); 2, bf16 bits;
    4, float32 (fp16 models' statistics). (The width is settled once a call: decided per entry, it slowed the value
    planes by a third.)"""
    width = scale.shape[3] // k
    if width == 1:
        for i in range(count):
            for j in range(k):
                out[0, i * k + j], out[1, i * k + j] = decode_stats8(scale[b, h, first + i, j],
                                                                     minimum[b, h, first + i, j], top)
    elif width == 2:
        scales, minimums = scale[b, h].view(np.uint16), minimum[b, h].view(np.uint16)
        for i in range(count):
            for j in range(k):
                out[0, i * k + j] = bf16_value(scales[first + i, j])
                out[1, i * k + j] = bf16_value(minimums[first + i, j])
    else:
        scales, minimums = scale[b, h].view(np.float32), minimum[b, h].view(np.float32)
        for i in range(count):
            for j in range(k):
                out[0, i * k + j], out[1, i * k + j] = scales[first + i, j], minimums[first + i, j]
