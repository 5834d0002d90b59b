"""Asymmetric uniform group quantization and bit packing (the quantized backbone D̂).

Shapes: x is [B, H, n, d] (batch, KV heads, tokens, channels).
  axis="channel": each group is one channel over `group` consecutive tokens   -> stats [B, H, n/group, d]
  axis="token":   each group is `group` consecutive channels of one token     -> stats [B, H, n, ceil(d/group)]
Codes are packed 8/bits per byte: along tokens for axis="channel" (a group's codes stay together), along
channels for axis="token".
"""

from __future__ import annotations

import torch

def levels(bits: int) -> int:
    return (1 << bits) - 1


def codes_per_byte(bits: int) -> int:
    return 8 // bits


def _shifts(bits: int, ndim: int, dim: int, device) -> torch.Tensor:
    """Bit offsets of the codes in a byte, shaped to broadcast along dim+1 of an unsqueezed tensor."""
    shape = [1] * (ndim + 1)
    shape[dim + 1] = codes_per_byte(bits)
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device).view(shape)


def pack_codes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) -> uint8 bytes holding 8/bits codes each along `dim`: code i*cpb + j sits
    in byte i at bits [j*bits, (j+1)*bits)."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return codes.to(torch.uint8)
    dim = dim % codes.ndim
    n = codes.shape[dim]
    if n % per_byte:
        raise ValueError(f"cannot pack {n} codes of {bits} bits along dim {dim}: not a multiple of {per_byte}")
    split = (*codes.shape[:dim], n // per_byte, per_byte, *codes.shape[dim + 1:])
    grouped = codes.to(torch.uint8).reshape(split)
    # disjoint bit fields: the sum is the bitwise or
    return (grouped << _shifts(bits, codes.ndim, dim, codes.device)).sum(dim=dim + 1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 bytes -> uint8 codes, 8/bits times longer along `dim` (contiguous)."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return packed
    dim = dim % packed.ndim
    shape = list(packed.shape)
    shape[dim] *= per_byte
    if packed.stride(-1) == 1 and packed.shape[-1] % 4 == 0 and packed.storage_offset() % 4 == 0:
        # Four bytes at a time: shifting an int32 word moves the j-th code of each of its bytes to that byte's
        # low bits, and the repeated mask drops what crossed a byte boundary (same codes, fewer, wider ops).
        words = packed.view(torch.int32)
        mask = int.from_bytes(bytes([levels(bits)]) * 4, "little", signed=True)
        planes = [((words >> (bits * j)) & mask).view(torch.uint8) for j in range(per_byte)]
        return torch.stack(planes, dim=dim + 1).reshape(shape)
    codes = (packed.unsqueeze(dim + 1) >> _shifts(bits, packed.ndim, dim, packed.device)) & levels(bits)
    return codes.reshape(shape)


def _grouped(x: torch.Tensor, axis: str, group: int) -> tuple[torch.Tensor, int]:
    """A view of x [B,H,n,d] with one axis per group member, and that axis:
    channel -> [B,H,n/g,g,d] (axis 3); token -> [B,H,n,d_pad/g,g] (axis 4, channels zero-padded)."""
    B, H, n, d = x.shape
    if axis == "channel":
        if n % group:
            raise ValueError(f"{n} tokens do not split into key groups of {group} tokens")
        return x.reshape(B, H, n // group, group, d), 3
    pad = (-d) % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(B, H, n, (d + pad) // group, group), 4


def _next_toward(t: torch.Tensor, direction: float) -> torch.Tensor:
    """The neighbour of t one ulp of t.dtype toward `direction` (+-inf); 0 steps to the smallest subnormal."""
    return torch.nextafter(t, torch.full_like(t, direction))


def _stored_stats(lo: torch.Tensor, hi: torch.Tensor, top: int, stats_dtype: torch.dtype):
    """(minimum, scale) in stats_dtype for groups spanning [lo, hi] (float32), such that
    minimum <= lo and minimum + top * scale >= hi in float32 (top: the highest code).

    Why: rounded to nearest, a stored minimum above lo or a scale rounded down would clamp the group's
    extremes to code 0 / `top`, up to ~1 step away at 8 bits in bf16; with the range covered, every entry
    is within half a step of its code. Empty groups (lo = hi = 0) keep minimum 0, scale 0.
    """
    minimum = lo.to(stats_dtype)
    minimum = torch.where(minimum.float() > lo, _next_toward(minimum, float("-inf")), minimum)
    m = minimum.float()
    scale = ((hi - m) / top).to(stats_dtype)
    short = m + top * scale.float() < hi  # two roundings, no FMA: the kernel checks the same way
    scale = torch.where(short, _next_toward(scale, float("inf")), scale)
    return minimum, scale


def quantize(x: torch.Tensor, bits: int, axis: str, group: int, exclude: torch.Tensor | None = None,
             stats_dtype: torch.dtype | None = None):
    """Quantize x [B,H,n,d]; entries where `exclude` is True take no part in min/max (outliers, padding).

    Returns (codes uint8 unpacked [B,H,n,d_pad], scale, minimum) with scale/minimum in `stats_dtype`
    (default x.dtype). Codes are computed against the *stored* scale and minimum, so dequantizing is exact
    to what was decided here.
    """
    stats_dtype = stats_dtype or x.dtype
    n, d = x.shape[-2:]
    xg, member = _grouped(x.float(), axis, group)
    if exclude is not None:
        eg = _grouped(exclude.to(torch.uint8), axis, group)[0].bool()
    else:
        eg = torch.zeros_like(xg, dtype=torch.bool)
    if axis == "token" and d % group:  # padded channels are not data
        pad_mask = torch.arange(xg.shape[3] * group, device=x.device).view(-1, group) >= d
        eg = eg | pad_mask
    lo = xg.masked_fill(eg, float("inf")).amin(dim=member)
    hi = xg.masked_fill(eg, float("-inf")).amax(dim=member)
    empty = torch.isinf(lo)  # every entry excluded: the group carries nothing
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    minimum, scale = _stored_stats(lo, hi, levels(bits), stats_dtype)
    safe_scale = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = torch.round((xg - minimum.float().unsqueeze(member)) / safe_scale.unsqueeze(member))
    codes = codes.clamp_(0, levels(bits)).to(torch.uint8)
    return codes.reshape(*x.shape[:2], n, -1), scale, minimum  # token axis keeps the padded channels


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, axis: str, group: int,
               d: int, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [B,H,n,d_pad] (unpacked) with their stats -> [B,H,n,d] in out_dtype (computed in float32).
    out: an optional float32 [B,H,n,d] tensor to write into (when d needs no padding)."""
    cg, member = _grouped(codes, axis, group)
    # uint8 codes times float32 scale promotes inside the multiply: the same values as cg.float() * scale,
    # without a float copy of the codes (the reference path dequantizes the whole history every step)
    scale, minimum = scale.float().unsqueeze(member), minimum.float().unsqueeze(member)
    if out is not None and out.dtype == torch.float32 and codes.shape[-1] == d:
        target = out.view(cg.shape)
        torch.mul(cg, scale, out=target)
        target.add_(minimum)
        return out
    x = (cg * scale + minimum).reshape(*codes.shape[:3], -1)
    x = x if x.shape[-1] == d else x[..., :d]
    if out is not None:
        return out.copy_(x)
    return x.to(out_dtype)
