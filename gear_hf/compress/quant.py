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


def pack_codes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) -> uint8 bytes holding 8/bits codes each, along `dim` (low bits first)."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return codes.to(torch.uint8)
    moved = codes.to(torch.uint8).movedim(dim, -1)  # [..., n]
    n = moved.shape[-1]
    if n % per_byte:
        raise ValueError(f"cannot pack {n} codes of {bits} bits along dim {dim}: not a multiple of {per_byte}")
    grouped = moved.reshape(*moved.shape[:-1], n // per_byte, per_byte)  # [..., n/per_byte, per_byte]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # [per_byte]
    packed = (grouped << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bit fields: sum == bitwise or
    return packed.movedim(-1, dim).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 bytes -> uint8 codes, 8/bits times longer along `dim`."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return packed
    moved = packed.movedim(dim, -1)  # [..., n/per_byte]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (moved.unsqueeze(-1) >> shifts) & levels(bits)  # [..., n/per_byte, per_byte]
    return codes.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """View x [B,H,n,d] so that each quantization group lies along the last dim."""
    B, H, n, d = x.shape
    if axis == "channel":
        if n % group:
            raise ValueError(f"{n} tokens do not split into key groups of {group} tokens")
        return x.reshape(B, H, n // group, group, d).transpose(-1, -2)  # [B, H, n/g, d, g]
    pad = (-d) % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(B, H, n, (d + pad) // group, group)  # [B, H, n, d/g, g]


def _ungrouped(xg: torch.Tensor, axis: str, n: int, d: int) -> torch.Tensor:
    if axis == "channel":
        B, H, ng, _, g = xg.shape
        return xg.transpose(-1, -2).reshape(B, H, n, d)
    return xg.reshape(*xg.shape[:3], -1)[..., :d]


def quantize(x: torch.Tensor, bits: int, axis: str, group: int, exclude: torch.Tensor | None = None,
             stats_dtype: torch.dtype | None = None):
    """Quantize x [B,H,n,d]; entries where `exclude` is True take no part in min/max (outliers, padding).

    Returns (codes uint8 unpacked [B,H,n,d_pad], scale, minimum) with scale/minimum in `stats_dtype`
    (default x.dtype). Codes are computed against the *stored* scale and minimum, so dequantizing is exact
    to what was decided here.
    """
    stats_dtype = stats_dtype or x.dtype
    xf = x.float()
    xg = _grouped(xf, axis, group)  # [..., g]
    if exclude is not None:
        eg = _grouped(exclude.to(torch.uint8), axis, group).bool()
    else:
        eg = torch.zeros_like(xg, dtype=torch.bool)
    if axis == "token" and x.shape[-1] % group:  # padded channels are not data
        pad_mask = torch.zeros(xg.shape[-2] * group, dtype=torch.bool, device=x.device)
        pad_mask[x.shape[-1]:] = True
        eg = eg | pad_mask.view(-1, group)
    lo = xg.masked_fill(eg, float("inf")).amin(dim=-1)
    hi = xg.masked_fill(eg, float("-inf")).amax(dim=-1)
    empty = torch.isinf(lo)  # every entry excluded: the group carries nothing
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    minimum = lo.to(stats_dtype)
    scale = ((hi - lo) / levels(bits)).to(stats_dtype)
    safe_scale = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = torch.round((xg - minimum.float().unsqueeze(-1)) / safe_scale.unsqueeze(-1))
    codes = codes.clamp_(0, levels(bits)).to(torch.uint8)
    if axis == "channel":
        codes = _ungrouped(codes, axis, x.shape[-2], x.shape[-1])
    else:
        codes = codes.reshape(*codes.shape[:3], -1)  # keep the padded channels: they are packed too
    return codes, scale, minimum


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, axis: str, group: int,
               d: int, out_dtype: torch.dtype) -> torch.Tensor:
    """codes [B,H,n,d_pad] (unpacked) with their stats -> [B,H,n,d] in out_dtype."""
    n = codes.shape[-2]
    if axis == "channel":
        cg = _grouped(codes, axis, group).float()  # [B,H,n/g,d,g]
        xg = cg * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
        return _ungrouped(xg, axis, n, d).to(out_dtype)
    cg = codes.reshape(*codes.shape[:3], -1, group).float()  # [B,H,n,d_pad/g,g]
    xg = cg * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return xg.reshape(*xg.shape[:3], -1)[..., :d].to(out_dtype)
