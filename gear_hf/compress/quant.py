"""Asymmetric uniform group quantization and bit packing (the quantized backbone D̂).

Shapes: x is [B, H, n, d] (batch, KV heads, tokens, channels).
  axis="channel": each group is one channel over `group` consecutive tokens   -> stats [B, H, n/group, d]
  axis="token":   each group is `group` consecutive channels of one token     -> stats [B, H, n, ceil(d/group)]
                  (a last group shorter than `group` when d is not a multiple: only real channels are coded)
Codes are packed in units (`pack_unit`): along tokens for axis="channel" (a group's codes stay together),
along channels for axis="token". 2/4/8 bits: 8/bits codes per byte, low bits first. 3 bits: 8 codes in 3
bytes, a 2-bit plane (two bytes, as 2-bit packing) followed by a 1-bit plane (one byte: the high bit of code j
at bit j).
Codes of per-channel widths (`pack_planes`, keys with bits allocated per channel): bit planes of 8 tokens.
Statistics (`STATS`): "16" = a scale and a minimum per group in the 16-bit side dtype; "8" = two uint8 codes per group,
a scale on a logarithmic grid (`LOG_SCALES`) and a zero point (`stats8`), for groups whose range contains 0 or lies
near it (values per token).
"""

from __future__ import annotations

import sys

import torch

BITS = (2, 3, 4, 8)
STATS = ("16", "8")

# The scale codes of 8-bit statistics: code 0 = scale 0 (an empty or constant-zero group), code k >= 1 =
# 2^((k - 161) / 8) rounded to bf16: 2^-20 .. 2^11.75 in steps of 2^(1/8) (9%). A table, not exp2, so every reader
# decodes the same values; in bf16 (as `decode_stats8`'s minimum) so code x scale is exact in float32, and a kernel's
# FMA gives the oracle's multiply-then-add bit for bit, as with 16-bit statistics.
LOG_SCALES = torch.cat([torch.zeros(1), torch.exp2((torch.arange(1, 256, dtype=torch.float64) - 161) / 8)]) \
    .to(torch.bfloat16).float()

def levels(bits: int) -> int:
    return (1 << bits) - 1


def top_code(bits) -> int | torch.Tensor:
    """The highest code: an int for one width, a float32 tensor for per-channel widths (a uint8 tensor)."""
    return levels(bits) if isinstance(bits, int) else (1 << bits.to(torch.int32)).sub_(1).float()


def pack_unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of one packing unit: codes are packed in whole units."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {', '.join(map(str, BITS))}")
    return (8, 3) if bits == 3 else (8 // bits, 1)


def codes_per_unit(bits, allocated: bool = False) -> int:
    """Codes of one packing unit along the packed dim: `pack_unit`'s, or the 8 tokens of a bit-plane unit when the
    widths are allocated per channel (`pack_planes`)."""
    return PLANE_TOKENS if allocated else pack_unit(bits)[0]


def packed_length(length: int, bits: int) -> int:
    """Bytes holding `length` codes (a multiple of the unit's code count)."""
    codes, nbytes = pack_unit(bits)
    if length % codes:
        raise ValueError(f"cannot pack {length} codes of {bits} bits: not a multiple of {codes}")
    return length // codes * nbytes


def _shifts(bits: int, per_byte: int, ndim: int, dim: int, device) -> torch.Tensor:
    """Bit offsets of the codes in a byte, shaped to broadcast along dim+1 of an unsqueezed tensor."""
    shape = [1] * (ndim + 1)
    shape[dim + 1] = per_byte
    return torch.arange(0, bits * per_byte, bits, dtype=torch.uint8, device=device).view(shape)


def _pack_fields(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """8/bits codes of `bits` bits per byte along dim (dim % (8/bits) == 0), low bits first."""
    per_byte = 8 // bits
    fields = codes.unflatten(dim, (codes.shape[dim] // per_byte, per_byte))  # [..., bytes, per_byte, ...]
    packed = fields.select(dim + 1, 0).clone(memory_format=torch.contiguous_format)  # code 0: the low bits
    for j in range(1, per_byte):  # disjoint bit fields: or-ing the shifted codes assembles each byte
        packed |= fields.select(dim + 1, j) << (bits * j)
    return packed


def _unpack_fields(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per_byte = 8 // bits
    shape = list(packed.shape)
    shape[dim] *= per_byte
    codes = (packed.unsqueeze(dim + 1) >> _shifts(bits, per_byte, packed.ndim, dim, packed.device)) & levels(bits)
    return codes.reshape(shape)


def pack_codes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) -> packed uint8 bytes along `dim` (see the module docstring)."""
    unit, _ = pack_unit(bits)
    codes = codes.to(torch.uint8)
    if unit == 1:
        return codes
    dim = dim % codes.ndim
    packed_length(codes.shape[dim], bits)  # checks the length
    if bits != 3:
        return _pack_fields(codes, bits, dim)
    units = codes.shape[dim] // 8
    grouped = codes.reshape(*codes.shape[:dim], units, 8, *codes.shape[dim + 1:])  # [..., units, 8, ...]
    low = _pack_fields(grouped & 3, 2, dim + 1)  # [..., units, 2, ...]
    high = _pack_fields(grouped >> 2, 1, dim + 1)  # [..., units, 1, ...]
    return torch.cat([low, high], dim=dim + 1).reshape(*codes.shape[:dim], units * 3, *codes.shape[dim + 1:])


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`: packed bytes -> uint8 codes along `dim` (contiguous)."""
    unit, nbytes = pack_unit(bits)
    if unit == 1:
        return packed
    dim = dim % packed.ndim
    if bits == 3 and dim == packed.ndim - 1 and _LITTLE_ENDIAN:  # along the last dim (values per token)
        return _unpack_3bit_last(packed)
    if bits == 3:
        units = packed.shape[dim] // 3
        grouped = packed.reshape(*packed.shape[:dim], units, 3, *packed.shape[dim + 1:])
        low = _unpack_fields(grouped.narrow(dim + 1, 0, 2), 2, dim + 1)  # [..., units, 8, ...]
        high = _unpack_fields(grouped.narrow(dim + 1, 2, 1), 1, dim + 1)
        return (low | (high << 2)).reshape(*packed.shape[:dim], units * 8, *packed.shape[dim + 1:])
    per_byte = unit
    if dim == packed.ndim - 1 and _LITTLE_ENDIAN:
        return _spread_bytes(packed, bits)
    shape = list(packed.shape)
    shape[dim] *= per_byte
    if packed.stride(-1) == 1 and packed.shape[-1] % 4 == 0 and packed.storage_offset() % 4 == 0:
        # Four bytes at a time: shifting an int32 word by bits*j moves the j-th code of each of its bytes to that
        # byte's low bits, and the repeated mask drops what crossed a byte boundary. The planes land on a new axis
        # after `dim` ([..., m, per_byte, ..., W]): the codes in order. One shift per plane into its slot (a
        # broadcast shift over a short last dim runs at a fraction of the speed), then one mask for all.
        words = packed.view(torch.int32)
        mask = int.from_bytes(bytes([levels(bits)]) * 4, "little", signed=True)
        planes = words.new_empty(*words.shape[: dim + 1], per_byte, *words.shape[dim + 1:])
        for j, plane in enumerate(planes.unbind(dim + 1)):
            torch.bitwise_right_shift(words, bits * j, out=plane)
        return planes.bitwise_and_(mask).view(torch.uint8).reshape(shape)
    return _unpack_fields(packed, bits, dim)


_LITTLE_ENDIAN = sys.byteorder == "little"


PLANE_TOKENS = 8  # per-channel widths are packed as bit planes of this many tokens (one byte per plane)
MAX_CHANNEL_BITS = 8


def _plane_bytes(bits: torch.Tensor, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (channel c, plane j) lives in an 8-token unit of `row_bytes` bytes, for widths bits [B,H,C,d]:
    (byte index [B,H,C,1,d*8] long, kept [B,H,C,1,d*8] bool: j < bits[c]). Channel c's planes start at the sum of
    the widths before it. Unused chunk slots (widths 0) keep nothing."""
    widths = bits.long()
    start = widths.cumsum(-1) - widths  # [B,H,C,d]
    plane = torch.arange(MAX_CHANNEL_BITS, device=bits.device)
    index = (start.unsqueeze(-1) + plane).flatten(-2).unsqueeze(3)  # [B,H,C,1,d*8]
    kept = (plane < widths.unsqueeze(-1)).flatten(-2).unsqueeze(3)
    return index.clamp_(max=max(row_bytes - 1, 0)), kept


def _transpose_bits8(words: torch.Tensor) -> torch.Tensor:
    """Each int64 of `words` as an 8x8 bit matrix (byte r = row r, bit c = column c) transposed: bit c of byte r
    becomes bit r of byte c. Three masked swaps (Hacker's Delight 7-3); the masks drop what an arithmetic right
    shift of a negative word brings in."""
    x = words.clone()
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> shift)) & mask
        x ^= t ^ (t << shift)
    return x


def pack_planes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Codes [B,H,n,d] of per-channel widths bits [B,H,C,d] (C chunks of n/C tokens, widths 1..8 with the same
    sum S over d for every (B, H, C)) -> [B,H,n/8,S] uint8.

    Per 8 tokens, channel c takes bits[c] bytes (its planes, low first: bit t of plane j = bit j of token t's code),
    channels in order: n*S/8 bytes hold exactly the codes' bits."""
    B, H, n, d = codes.shape
    C = bits.shape[2]
    row_bytes = int(bits[0, 0, 0].long().sum()) if bits.numel() else 0
    units = codes.view(B, H, C, n // C // PLANE_TOKENS, PLANE_TOKENS, d)  # [B,H,C,U,8 tokens,d]
    words = units.transpose(-1, -2).contiguous().view(torch.int64)  # [B,H,C,U,d,1]: byte t = token t's code
    planes = _transpose_bits8(words).view(torch.uint8).flatten(-2)  # [B,H,C,U,d*8]: byte j = plane j
    index, kept = _plane_bytes(bits, row_bytes)
    index = torch.where(kept, index, row_bytes).expand(planes.shape)  # dropped planes go to a spare last byte
    out = planes.new_zeros(*planes.shape[:4], row_bytes + 1).scatter_(-1, index, planes)
    return out[..., :row_bytes].reshape(B, H, n // PLANE_TOKENS, row_bytes)


def unpack_planes(packed: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_planes`: [B,H,n/8,S] with bits [B,H,C,d] -> uint8 codes [B,H,n,d]."""
    B, H, units, row_bytes = packed.shape
    C, d = bits.shape[2], bits.shape[3]
    rows = packed.view(B, H, C, units // C, row_bytes)
    index, kept = _plane_bytes(bits, row_bytes)
    planes = rows.gather(-1, index.expand(B, H, C, units // C, -1)).mul_(kept)  # [B,H,C,U,d*8]: byte j = plane j
    codes = _transpose_bits8(planes.view(torch.int64)).view(torch.uint8)  # [B,H,C,U,d*8]: byte t = token t's code
    return codes.view(B, H, C, units // C, d, PLANE_TOKENS).transpose(-1, -2).reshape(B, H, units * PLANE_TOKENS, d)


def _unpack_3bit_last(packed: torch.Tensor) -> torch.Tensor:
    """3-bit units packed along the last dim [..., 3U] -> uint8 codes [..., 8U]: each unit's 2-bit plane spread a code
    per byte (`_spread_bytes`), its 1-bit plane shifted out bit by bit; a few whole-tensor ops instead of field loops
    over a short last dim (the reference path reads every value this way each step)."""
    units = packed.view(*packed.shape[:-1], -1, 3)  # [..., U, 3]
    low = _spread_bytes(units[..., :2], 2)  # [..., U, 8]: codes' low 2 bits
    high = units[..., 2:].bitwise_right_shift(torch.arange(8, dtype=torch.uint8, device=packed.device))
    return low.bitwise_or_(high.bitwise_and_(1).bitwise_left_shift_(2)).view(*packed.shape[:-1], -1)


def _spread_bytes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes packed along the last dim -> uint8 codes [..., L * 8/bits], by spreading each byte's bit fields over
    the bytes of a wider integer (code j -> byte j, little-endian): a few whole-tensor integer ops, where
    unpacking into planes would have to interleave them byte by byte (slow for a short last dim)."""
    if bits == 2:  # byte c3c2c1c0 -> int32 bytes (c0, c1, c2, c3)
        # x * (1 + 2^k) == x | x << k where the two never share a bit: an in-place multiply, no shifted copy
        x = packed.to(torch.int32).contiguous()
        x.mul_(1 + (1 << 12)).bitwise_and_(0x000F000F)  # c1c0 at bits 0-3, c3c2 at bits 16-19
        x.mul_(1 + (1 << 6)).bitwise_and_(0x03030303)  # c1 -> bits 8-9, c3 -> bits 24-25
    else:  # 4 bits: byte c1c0 -> int16 bytes (c0, c1)
        x = packed.to(torch.int16).contiguous()
        x.bitwise_or_(x << 4).bitwise_and_(0x0F0F)
    return x.view(torch.uint8)


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


def _stored_stats(lo: torch.Tensor, hi: torch.Tensor, top, stats_dtype: torch.dtype):
    """(minimum, scale) in stats_dtype for groups spanning [lo, hi] (float32), such that
    minimum <= lo and minimum + top * scale >= hi in float32 (top: the highest code, `top_code`).

    Why: rounded to nearest, a stored minimum above lo or a scale rounded down would clamp the group's
    extremes to code 0 / `top`, up to ~1 step away at 8 bits in bf16; with the range covered, every entry
    is within half a step of its code. Empty groups (lo = hi = 0) keep minimum 0, scale 0.
    """
    minimum = lo.to(stats_dtype)
    minimum = torch.where(minimum.float() > lo, _next_toward(minimum, float("-inf")), minimum)
    m = minimum.float()
    # divide by a tensor on hi's device: CUDA turns division by a Python scalar into a multiplication by its
    # reciprocal (not correctly rounded), the kernels divide with IEEE rounding (div_rn), as the CPU does
    scale = ((hi - m) / (top if isinstance(top, torch.Tensor) else hi.new_tensor(float(top)))).to(stats_dtype)
    short = m + top * scale.float() < hi  # two roundings, no FMA: the kernel checks the same way
    scale = torch.where(short, _next_toward(scale, float("inf")), scale)
    return minimum, scale


def decode_stats8(scale_code: torch.Tensor, zero_code: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, scale) float32 of 8-bit statistics: scale = LOG_SCALES[scale_code], minimum = -(zero_code * top
    / 255) * scale (float32 operations in that order) rounded down to a bf16 value, so that it stays <= the range
    the zero point was chosen to cover."""
    scale = LOG_SCALES.to(scale_code.device)[scale_code.long()]
    exact = -(zero_code.float() * top / 255 * scale)
    minimum = exact.to(torch.bfloat16)
    minimum = torch.where(minimum.float() > exact, torch.nextafter(minimum, torch.full_like(minimum, float("-inf"))),
                          minimum)
    return minimum.float(), scale


def stats8(lo: torch.Tensor, hi: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale code, zero-point code), uint8, of groups spanning [lo, hi] (float32): the smallest grid scale with a
    zero point whose decoded range covers [lo, hi] (as `_stored_stats`: every entry within half a step of its code).
    A range of one sign takes zero point 0 (all >= 0) or top (all <= 0): coarse when it lies far from 0 (why keys,
    grouped per channel, keep 16-bit statistics). A range wider than the grid's largest scale raises a ValueError."""
    step = top / 255  # the zero points' grid: z = code * top / 255, codes 0..255 spanning [0, top]
    need = torch.where(lo > 0, hi / top, torch.where(hi < 0, -lo / top, (hi - lo) / (top - step)))
    table = LOG_SCALES.to(lo.device)
    if bool((need > table[-1]).any()):
        raise ValueError(f"8-bit statistics (value_statistics='8') cover ranges up to {top * table[-1].item():.4g} "
                         f"per group; a group spans {(hi - lo).max().item():.4g}: use value_statistics='16'")

    def zero_point(scale_code: torch.Tensor) -> torch.Tensor:  # the smallest grid zero point with minimum <= lo
        scale = table[scale_code]
        return torch.ceil((-lo / torch.where(scale > 0, scale, 1.0)).clamp(0, top) / step).clamp_(max=255)

    scale_code = torch.searchsorted(table, need.contiguous())  # the first code whose scale >= need (0 for need 0)
    for _ in range(3):  # float32 rounding of the decoded range: one code up where it falls short
        zero_code = zero_point(scale_code)
        minimum, scale = decode_stats8(scale_code, zero_code, top)
        short = ((minimum > lo) | (minimum + top * scale < hi)) & (scale_code < 255)
        if not bool(short.any()):
            break
        scale_code = torch.where(short, scale_code + 1, scale_code)
    else:
        zero_code = zero_point(scale_code)
    return scale_code.to(torch.uint8), zero_code.to(torch.uint8)


def _group_error(xg: torch.Tensor, eg: torch.Tensor, member: int, minimum: torch.Tensor, scale: torch.Tensor,
                 top) -> torch.Tensor:
    """Squared quantization error of each group (excluded entries not counted) with these stored stats."""
    m, s = minimum.float().unsqueeze(member), scale.float().unsqueeze(member)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    approx = _clamp_codes(torch.round((xg - m) / safe), top, member) * s + m
    return (approx - xg).square_().masked_fill_(eg, 0.0).sum(dim=member)


# Range search: each end of a group's [min, max] may move inward by one of these fractions of the width.
# Why these: the least-squares range of a uniform quantizer on ~64-128 Gaussian-like entries clips each end by
# ~20% of the width at 2 bits, ~8% at 3 and ~0-3% at 4 (more with heavy tails); 0 keeps plain min/max.
RANGE_SEARCH_SHRINKS = (0.0, 0.03, 0.06, 0.1, 0.14, 0.19, 0.25, 0.32)


def _searched_stats(xg: torch.Tensor, eg: torch.Tensor, member: int, lo: torch.Tensor, hi: torch.Tensor,
                    top, stats_dtype: torch.dtype):
    """(minimum, scale) of the candidate range with the least squared error of each group: [lo, hi] with each
    end moved inward by a fraction of RANGE_SEARCH_SHRINKS (entries beyond a clipped end take the end code).
    Plain min/max is a candidate and wins ties, so no group's error exceeds min/max's (as stored)."""
    width = hi - lo
    best_min, best_scale = _stored_stats(lo, hi, top, stats_dtype)
    best_err = _group_error(xg, eg, member, best_min, best_scale, top)
    for low_cut in RANGE_SEARCH_SHRINKS:
        for high_cut in RANGE_SEARCH_SHRINKS:
            if low_cut == high_cut == 0.0:
                continue
            minimum, scale = _stored_stats(lo + low_cut * width, hi - high_cut * width, top, stats_dtype)
            err = _group_error(xg, eg, member, minimum, scale, top)
            better = err < best_err
            best_min = torch.where(better, minimum, best_min)
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.where(better, err, best_err)
    return best_min, best_scale


def _clamp_codes(codes: torch.Tensor, top, member: int) -> torch.Tensor:
    """codes (grouped, float) clamped to [0, top] in place; a per-channel top [B,H,1,d] broadcasts over the groups."""
    if isinstance(top, int):
        return codes.clamp_(0, top)
    return torch.minimum(codes.clamp_(min=0), top.unsqueeze(member), out=codes)


def quantize(x: torch.Tensor, bits, axis: str, group: int, exclude: torch.Tensor | None = None,
             stats_dtype: torch.dtype | None = None, range_search: bool = False, stats: str = "16"):
    """Quantize x [B,H,n,d]; entries where `exclude` is True take no part in min/max (outliers, padding).
    bits: one width, or per-channel widths (uint8 [B,H,1,d], axis="channel" only: `pack_planes` stores them).

    Returns (codes uint8 unpacked [B,H,n,d], scale, minimum) with scale/minimum in `stats_dtype`
    (default x.dtype). Codes are computed against the *stored* scale and minimum, so dequantizing is exact
    to what was decided here.
    range_search: choose each group's range (scale, minimum) among clipped candidates for the least squared
    error of its entries instead of taking min/max (`_searched_stats`); same stored format.
    stats="8": 8-bit statistics (`stats8`, one width, min/max ranges): scale and minimum are then their stored uint8
    codes (scale code, zero-point code; `decode_stats8` gives the values the codes were computed against).
    """
    stats_dtype = stats_dtype or x.dtype
    n, d = x.shape[-2:]
    xg, member = _grouped(x, axis, group)  # in x's dtype: every use below computes in float32 (exact casts)
    eg = None  # excluded entries, grouped as xg
    if exclude is not None:
        eg = _grouped(exclude, axis, group)[0]
    if axis == "token" and d % group:  # padded channels are not data
        pad_mask = torch.arange(xg.shape[3] * group, device=x.device).view(-1, group) >= d
        eg = pad_mask if eg is None else eg | pad_mask
    if eg is None:
        buffer = None
        lo, hi = xg.amin(dim=member).float(), xg.amax(dim=member).float()
    else:  # one float32 buffer for the masked copies and then the codes
        buffer = xg.to(torch.float32, copy=True).masked_fill_(eg, float("inf"))
        lo = buffer.amin(dim=member)
        hi = buffer.masked_fill_(eg, float("-inf")).amax(dim=member)
    empty = torch.isinf(lo)  # every entry excluded: the group carries nothing
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    if not isinstance(bits, int) and axis != "channel":
        raise ValueError(f"per-channel bit widths need axis='channel', got axis={axis!r}")
    top = top_code(bits)
    stored = None
    if stats == "8":
        if range_search or not isinstance(bits, int):
            raise ValueError("8-bit statistics take one width and min/max ranges (no range_search, no per-channel "
                             "widths)")
        stored = stats8(lo, hi, top)
        minimum, scale = decode_stats8(*stored, top)
    elif range_search:
        eg = torch.zeros_like(xg, dtype=torch.bool) if eg is None else eg
        minimum, scale = _searched_stats(xg, eg, member, lo, hi, top, stats_dtype)
    else:
        minimum, scale = _stored_stats(lo, hi, top, stats_dtype)
    safe_scale = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = torch.sub(xg, minimum.float().unsqueeze(member), out=buffer)  # [B,H,n/g,g,d] / [B,H,n,G,g] float32
    # (xg promoted to float32 inside the subtraction: no float32 copy of x)
    codes = codes.div_(safe_scale.unsqueeze(member)).round_()
    codes = _clamp_codes(codes, top, member).to(torch.uint8).reshape(*x.shape[:2], n, -1)
    scale, minimum = stored if stored is not None else (scale, minimum)
    return codes[..., :d], scale, minimum  # padded channels (a short last value group) are not codes


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, axis: str, group: int,
               d: int, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [B,H,n,d] (unpacked) with their stats -> [B,H,n,d] in out_dtype (computed in float32).
    out: an optional float32 [B,H,n,d] tensor to write into (when the groups split d evenly)."""
    cg, member = _grouped(codes, axis, group)  # a short last value group is padded with code 0 here
    scale, minimum = scale.float().unsqueeze(member), minimum.float().unsqueeze(member)
    if out is not None and out.dtype == torch.float32 and cg.numel() == codes.numel():
        target = out.view(cg.shape)
        # cast, then scale and shift in place (the reference path dequantizes the whole history every step):
        # three plain passes run faster than one mixed-dtype uint8 x float32 multiply, and give the same values
        target.copy_(cg).mul_(scale).add_(minimum)
        return out
    x = cg.float().mul_(scale).add_(minimum).reshape(*codes.shape[:3], -1)
    x = x if x.shape[-1] == d else x[..., :d]
    if out is not None:
        return out.copy_(x)
    return x.to(out_dtype)
