"""CPU kernel (numba): a centered buffer's stored centers (`gear_hf.cache.channel_centers.ChannelCenters`) as the
float32 (scales, centers) [B,H,2,d] the kernels read, in one call.

What `ChannelCenters._decoded` computes in torch, bit for bit: keys' centers widened from bf16, their scales
2^(low + above) (powers of two, built in the exponent bits: exact, as torch's exp2 product is; past float32's range:
inf, or subnormal below 2^-126); values' int8 centers times their head's bf16 step in float32, scales 1. In torch
that is a dozen small operations per stream and step; here one call.

Covered (`centers_supported`): bf16 side information (bf16 and float32 models), CPU tensors; anything else is
decoded by the torch oracle.
"""

from __future__ import annotations

import numpy as np
import torch

from .bf16 import side_value as _value
from .jit import kernel

_F32 = np.float32


@kernel()
def _power_of_two_bits(e):
    """The float32 bits of 2^e for an integer e: exact (subnormal below -126, 0 below -149, inf above 127)."""
    if e > 127:
        return np.int32(0x7F800000)
    if e >= -126:
        return np.int32((e + 127) << 23)
    if e >= -149:
        return np.int32(1) << np.int32(e + 149)
    return np.int32(0)


@kernel()
def _decode_scaled(center, low, above, out):
    """center [B,H,d] (bf16 bits), low [B,H] int8, above [B,H,ceil(d/2)] uint8 (each channel's exponent above low, 4
    bits, the even channel in the low nibble) -> out [B,H,2,d] float32: row 0 the scales 2^(low + above), row 1 the
    centers."""
    B, H, d = center.shape
    bits = out.view(np.int32)
    for b in range(B):
        for h in range(H):
            for c in range(d):
                nibble = (np.int32(above[b, h, c // 2]) >> np.int32(4 * (c % 2))) & np.int32(15)
                bits[b, h, 0, c] = _power_of_two_bits(np.int32(low[b, h]) + nibble)
                out[b, h, 1, c] = _value(center[b, h, c])


@kernel()
def _decode_values(center, step, out):
    """center [B,H,d] int8 codes, step [B,H] (bf16 bits) -> out [B,H,2,d] float32: scales 1, centers code * step."""
    B, H, d = center.shape
    for b in range(B):
        for h in range(H):
            s = _value(step[b, h])
            for c in range(d):
                out[b, h, 0, c] = _F32(1.0)
                out[b, h, 1, c] = _F32(center[b, h, c]) * s


def centers_supported(fields: dict[str, torch.Tensor]) -> bool:
    """True when `decode_centers` covers these stored fields (bf16 side information on the CPU)."""
    side = fields.get("center") if "low" in fields else fields.get("step")
    return side is not None and side.dtype == torch.bfloat16 and side.device.type == "cpu"


def decode_centers(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 [B,H,2,d] (scales, centers) of `ChannelCenters.fields` (`centers_supported`): keys' {"center",
    "low", "above"}, or values' {"center", "step"}."""
    if not centers_supported(fields):
        raise ValueError(f"decode_centers: fields {sorted(fields)} with side dtype "
                         f"{[t.dtype for t in fields.values()]} are not covered (allowed: bf16 side information on the "
                         "CPU; see centers_supported)")
    center = fields["center"]
    B, H, d = center.shape
    out = torch.empty(B, H, 2, d, dtype=torch.float32)
    if "low" in fields:
        _decode_scaled(center.contiguous().view(torch.int16).numpy(), fields["low"].contiguous().numpy(),
                       fields["above"].contiguous().numpy(), out.numpy())
    else:
        _decode_values(center.contiguous().numpy(), fields["step"].contiguous().view(torch.int16).numpy(),
                       out.numpy())
    return out
