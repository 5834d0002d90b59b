"""bf16 as torch rounds it, for the numba loops: float32 -> bf16 bits (nearest even), bits -> float32, one ulp."""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload


@numba.njit(inline="always")
def round_bf16(v):
    """float32 -> bf16 bits, rounded to nearest even (NaN -> 0x7FC0), as torch converts."""
    if v != v:
        return np.uint16(0x7FC0)
    u = np.float32(v).view(np.uint32)
    return np.uint16((u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16))


@numba.njit(inline="always")
def bf16_value(bits):
    """bf16 bits -> float32 (exact)."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit(inline="always")
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


def side_value(x):
    """A side-information element as float32: bf16 bits (int16: the fields read in place) or a number."""
    raise NotImplementedError("numba only: called from the CPU kernels")


@overload(side_value, inline="always")
def _side_value(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        return lambda x: bf16_value(x)
    return lambda x: np.float32(x)
