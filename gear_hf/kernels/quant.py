"""Quantize + pack kernels: the quantized backbone D̂ written directly in the layout `ChunkStore` stores.

    axis="channel" (keys): one group = one channel over `group` consecutive tokens
        codes [B,H,n/cpb,d] uint8 (packed along tokens), scale/minimum [B,H,n/group,d]
    axis="token"   (values): one group = `group` consecutive channels of one token (the last may be short)
        codes [B,H,n,P(d)] uint8 (packed along channels), scale/minimum [B,H,n,ceil(d/group)]
    P(m): bytes of m codes (d rounded up to a whole packing unit); 3 bits: 8 codes in 3 bytes (2-bit plane,
    then 1-bit plane), see gear_hf.compress.quant

Bit for bit the same as `gear_hf.compress.quant.quantize` followed by `pack_codes`: min/max in float32 over
the entries not excluded, the stats rounded to `stats_dtype` (then stepped one ulp down / up where the stored
minimum / scale would not cover the group's range), codes computed against the *stored* stats with
IEEE division (`div_rn`: plain `/` is approximate on GPUs), round-half-to-even (torch.round), and no
fused multiply-add contraction (enable_fp_fusion=False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compress.quant import BITS, pack_unit, packed_length
from . import interpreting

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _round_half_even(y):
    """torch.round: round to nearest, ties to even (exact for |y| < 2^23; callers clamp y first)."""
    f = tl.floor(y)
    frac = y - f  # exact
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 when f is odd
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@triton.jit
def _to_stats(x, STATS_DT: tl.constexpr):
    """float32 -> STATS_DT with round-to-nearest-even (bf16 is rounded by hand: the CPU interpreter truncates)."""
    if STATS_DT == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16) << 16
        x = u.to(tl.float32, bitcast=True)
    return x.to(STATS_DT)


@triton.jit
def _next_toward(x, UP: tl.constexpr, STATS_DT: tl.constexpr):
    """torch.nextafter(x, +-inf) in STATS_DT for float32 x holding a value exact in STATS_DT: the bit pattern
    (sign-magnitude) moves one unit away from zero, or toward it, and 0 goes to the smallest subnormal of the
    direction's sign. One unit is 0x10000 of the float32 pattern for bf16, 1 of the fp16/fp32 pattern."""
    if STATS_DT == tl.float16:
        u = x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        SIGN: tl.constexpr = 0x8000
        UNIT: tl.constexpr = 1
    else:
        u = x.to(tl.uint32, bitcast=True)
        SIGN: tl.constexpr = 0x80000000
        UNIT: tl.constexpr = 0x10000 if STATS_DT == tl.bfloat16 else 1
    mag = u & (SIGN - 1)
    sign = u & SIGN
    if UP:
        away = x >= 0.0  # +-0 included: its neighbour is away from zero
        sign = tl.where(x == 0.0, 0, sign)
    else:
        away = x <= 0.0
        sign = tl.where(x == 0.0, SIGN, sign)
    u = sign | tl.where(away, mag + UNIT, mag - UNIT)
    if STATS_DT == tl.float16:
        return u.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _stored_stats(lo, hi, LEVELS: tl.constexpr, STATS_DT: tl.constexpr):
    """(minimum, scale) as float32 values exact in STATS_DT, with minimum <= lo and minimum + LEVELS*scale >= hi:
    round to nearest, then one ulp down / up where that fell short (as `quant._stored_stats`), so no entry
    of the group is clamped."""
    mn = _to_stats(lo, STATS_DT).to(tl.float32)
    mn = tl.where(mn > lo, _next_toward(mn, False, STATS_DT), mn)
    sc = _to_stats(tl.math.div_rn(hi - mn, LEVELS * 1.0), STATS_DT).to(tl.float32)
    sc = tl.where(mn + LEVELS * sc < hi, _next_toward(sc, True, STATS_DT), sc)
    return mn, sc


@triton.jit
def _codes_from(x, mn, sc, LEVELS: tl.constexpr):
    """Codes (int32) of x against stored stats mn/sc (float32 values of the stored dtype)."""
    safe = tl.where(sc > 0.0, sc, 1.0)
    y = tl.math.div_rn(x - mn, safe)
    y = tl.minimum(tl.maximum(y, -1.0), LEVELS + 1.0)  # anything outside rounds then clamps the same way
    code = _round_half_even(y)
    code = tl.minimum(tl.maximum(code, 0.0), LEVELS * 1.0)
    return code.to(tl.int32)


@triton.jit
def _pack3(code, j, AXIS: tl.constexpr):
    """Codes [.., 8 (code j of a unit, along AXIS), ..] -> the unit's 3 bytes (each the tile reduced over AXIS):
    codes 0-3's low 2 bits, codes 4-7's low 2 bits (2j bits up), then the high bits (bit j)."""
    low = (code & 3) << ((j % 4) * 2)
    b0 = tl.sum(tl.where(j < 4, low, 0), axis=AXIS)
    b1 = tl.sum(tl.where(j >= 4, low, 0), axis=AXIS)
    b2 = tl.sum(((code >> 2) & 1) << j, axis=AXIS)
    return b0, b1, b2


@triton.jit
def _quant_channel_kernel(
    x_ptr, ex_ptr, codes_ptr, scale_ptr, min_ptr,
    H, n_tokens, d,
    sxb, sxh, sxn, seb, seh, sen,
    scb, sch, scn, ssb, ssh, ssn, smb, smh, smn,
    GROUP: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr, SUB_B: tl.constexpr, D_P2: tl.constexpr,
    HAS_EXCLUDE: tl.constexpr, STATS_DT: tl.constexpr,
):
    """One program = one group of GROUP tokens of one (row, head), all channels; tiles [SUB_B, CPB, D_P2]
    hold SUB_B bytes' worth of tokens (byte i, code j <-> token i*CPB + j)."""
    pid_bh = tl.program_id(0)
    gi = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs_i = tl.arange(0, SUB_B)
    offs_j = tl.arange(0, CPB)
    offs_c = tl.arange(0, D_P2)
    cmask = offs_c < d
    x_base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    e_base = ex_ptr + b.to(tl.int64) * seb + h.to(tl.int64) * seh
    tok0 = gi * GROUP
    lo = tl.full([D_P2], float("inf"), tl.float32)
    hi = tl.full([D_P2], float("-inf"), tl.float32)
    for start in range(0, GROUP, SUB_B * CPB):
        rel = start + offs_i[:, None, None] * CPB + offs_j[None, :, None]  # [SUB_B, CPB, 1]
        ok = (rel < GROUP) & cmask[None, None, :]
        tok = tok0 + rel
        x = tl.load(x_base + tok * sxn + offs_c[None, None, :], mask=ok, other=0.0).to(tl.float32)
        use = ok
        if HAS_EXCLUDE:
            ex = tl.load(e_base + tok * sen + offs_c[None, None, :], mask=ok, other=1)
            use = use & (ex == 0)
        lo = tl.minimum(lo, tl.min(tl.min(tl.where(use, x, float("inf")), axis=1), axis=0))
        hi = tl.maximum(hi, tl.max(tl.max(tl.where(use, x, float("-inf")), axis=1), axis=0))
    empty = lo == float("inf")
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    mn, sc = _stored_stats(lo, hi, LEVELS, STATS_DT)
    tl.store(scale_ptr + b.to(tl.int64) * ssb + h.to(tl.int64) * ssh + gi * ssn + offs_c, sc.to(STATS_DT), mask=cmask)
    tl.store(min_ptr + b.to(tl.int64) * smb + h.to(tl.int64) * smh + gi * smn + offs_c, mn.to(STATS_DT), mask=cmask)
    shifts = offs_j * BITS
    c_base = codes_ptr + b.to(tl.int64) * scb + h.to(tl.int64) * sch
    for start in range(0, GROUP, SUB_B * CPB):
        rel = start + offs_i[:, None, None] * CPB + offs_j[None, :, None]
        ok = (rel < GROUP) & cmask[None, None, :]
        x = tl.load(x_base + (tok0 + rel) * sxn + offs_c[None, None, :], mask=ok, other=0.0).to(tl.float32)
        code = _codes_from(x, mn[None, None, :], sc[None, None, :], LEVELS)
        bmask = ((start + offs_i * CPB) < GROUP)[:, None] & cmask[None, :]
        if BITS == 3:  # a unit of 8 tokens -> 3 byte rows: 2-bit plane (2 bytes), then the high-bit plane
            b0, b1, b2 = _pack3(tl.where(ok, code, 0), offs_j[None, :, None], 1)  # [SUB_B, D_P2] each
            unit_row = (tok0 + start) // 8 + offs_i  # GROUP % 8 == 0: a group's units are its own
            ptr = c_base + (unit_row * 3)[:, None] * scn + offs_c[None, :]
            tl.store(ptr, b0.to(tl.uint8), mask=bmask)
            tl.store(ptr + scn, b1.to(tl.uint8), mask=bmask)
            tl.store(ptr + 2 * scn, b2.to(tl.uint8), mask=bmask)
        else:
            packed = tl.sum(tl.where(ok, code << shifts[None, :, None], 0), axis=1)  # [SUB_B, D_P2]
            byte_row = (tok0 + start) // CPB + offs_i  # GROUP % CPB == 0: a group's bytes are its own
            tl.store(c_base + byte_row[:, None] * scn + offs_c[None, :], packed.to(tl.uint8), mask=bmask)


@triton.jit
def _quant_token_kernel(
    x_ptr, ex_ptr, codes_ptr, scale_ptr, min_ptr,
    H, n_tokens, d, n_groups, code_width,
    sxb, sxh, sxn, seb, seh, sen,
    scb, sch, scn, ssb, ssh, ssn, smb, smh, smn,
    GROUP: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr, BLOCK_T: tl.constexpr,
    GB_P2: tl.constexpr, HAS_EXCLUDE: tl.constexpr, STATS_DT: tl.constexpr,
):
    """One program = BLOCK_T tokens of one (row, head), looping over the channel groups; per group a tile
    [BLOCK_T, GB_P2, CPB] with channel = group*GROUP + byte*CPB + j (GROUP % CPB == 0: bytes never straddle
    groups; 3 bits: CPB = 8 codes per unit of 3 bytes). Channels past d are excluded from the stats and coded 0
    (only within the last packing unit; nothing past it is stored), as in the reference."""
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    LEVELS: tl.constexpr = (1 << BITS) - 1
    GB: tl.constexpr = GROUP // CPB
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = tok[:, None, None]
    b_i = tl.arange(0, GB_P2)[None, :, None]
    j_i = tl.arange(0, CPB)[None, None, :]
    tmask = tok < n_tokens
    x_base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    e_base = ex_ptr + b.to(tl.int64) * seb + h.to(tl.int64) * seh
    c_base = codes_ptr + b.to(tl.int64) * scb + h.to(tl.int64) * sch
    s_base = scale_ptr + b.to(tl.int64) * ssb + h.to(tl.int64) * ssh
    m_base = min_ptr + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    shifts = j_i * BITS
    for gi in range(0, n_groups):
        ch = gi * GROUP + b_i * CPB + j_i  # [1, GB_P2, CPB]
        in_tile = (t3 < n_tokens) & (b_i < GB)
        is_data = in_tile & (ch < d)
        x = tl.load(x_base + t3 * sxn + ch, mask=is_data, other=0.0).to(tl.float32)
        use = is_data
        if HAS_EXCLUDE:
            ex = tl.load(e_base + t3 * sen + ch, mask=is_data, other=1)
            use = use & (ex == 0)
        lo = tl.min(tl.min(tl.where(use, x, float("inf")), axis=2), axis=1)  # [BLOCK_T]
        hi = tl.max(tl.max(tl.where(use, x, float("-inf")), axis=2), axis=1)
        empty = lo == float("inf")
        lo = tl.where(empty, 0.0, lo)
        hi = tl.where(empty, 0.0, hi)
        mn, sc = _stored_stats(lo, hi, LEVELS, STATS_DT)  # [BLOCK_T] each
        tl.store(s_base + tok * ssn + gi, sc.to(STATS_DT), mask=tmask)
        tl.store(m_base + tok * smn + gi, mn.to(STATS_DT), mask=tmask)
        code = tl.where(is_data, _codes_from(x, mn[:, None, None], sc[:, None, None], LEVELS), 0)
        if BITS == 3:  # GB units of 8 channels, 3 bytes each
            b0, b1, b2 = _pack3(code, j_i, 2)  # [BLOCK_T, GB_P2] each
            col = (gi * GB + tl.arange(0, GB_P2)) * 3
            bmask = tmask[:, None] & ((tl.arange(0, GB_P2) < GB) & (col < code_width))[None, :]
            ptr = c_base + tok[:, None] * scn + col[None, :]
            tl.store(ptr, b0.to(tl.uint8), mask=bmask)
            tl.store(ptr + 1, b1.to(tl.uint8), mask=bmask)
            tl.store(ptr + 2, b2.to(tl.uint8), mask=bmask)
        else:
            packed = tl.sum(tl.where(in_tile, code << shifts, 0), axis=2)  # [BLOCK_T, GB_P2]
            byte_col = gi * GB + tl.arange(0, GB_P2)
            bmask = tmask[:, None] & ((tl.arange(0, GB_P2) < GB) & (byte_col < code_width))[None, :]
            tl.store(c_base + tok[:, None] * scn + byte_col[None, :], packed.to(tl.uint8), mask=bmask)


def _p2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("gear_hf Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "gear_hf.kernels modules are imported (CPU interpreter)")


def _strides3(t: torch.Tensor):
    if t.stride(-1) != 1:
        raise ValueError("the last dim of every kernel operand must be contiguous")
    return t.stride(0), t.stride(1), t.stride(2)


def codes_per_unit(bits: int) -> int:
    """Codes in one packing unit (a byte; 3 bytes for 3 bits: gear_hf.compress.quant.pack_unit)."""
    return pack_unit(bits)[0]


def output_shapes(shape, bits: int, axis: str, group: int):
    """(codes, scale/minimum) shapes for x of `shape` [B,H,n,d], as the torch engine stores them."""
    B, H, n, d = shape
    if axis == "channel":
        return (B, H, packed_length(n, bits), d), (B, H, n // group, d)
    unit = codes_per_unit(bits)
    return (B, H, n, packed_length(-(-d // unit) * unit, bits)), (B, H, n, -(-d // group))


def _launch(kernel, grid, args, kwargs, plan: list | None) -> None:
    """Run kernel[grid](*args, **kwargs), or only record it in `plan` (scripts/dev/compile_check.py)."""
    if plan is None:
        kernel[grid](*args, **kwargs)
    else:
        plan.append((kernel, grid, args, kwargs))


def quantize_pack(x: torch.Tensor, bits: int, axis: str, group: int, exclude: torch.Tensor | None = None,
                  stats_dtype: torch.dtype | None = None, out=None, _plan: list | None = None):
    """Quantize x [B,H,n,d] and pack the codes: returns (codes uint8 packed, scale, minimum).

    Equal, bit for bit, to `pack_codes(quantize(x, bits, axis, group, exclude, stats_dtype)[0], bits, dim)`
    with dim -2 (channel) / -1 (token), and the same scale/minimum. `group` as in `quantize` (use
    ChunkSpec.group_for for KCVT). exclude: bool [B,H,n,d], entries kept out of min/max (outliers, padding).
    out: optional (codes, scale, minimum) tensors (e.g. views into a ChunkStore's fields) to write into.
    """
    if bits not in BITS:
        raise ValueError(f"bits={bits}: 2, 3, 4 or 8")
    if axis not in ("channel", "token"):
        raise ValueError(f"axis={axis!r}: 'channel' or 'token'")
    if _plan is None:
        _check_device(x)
    B, H, n, d = x.shape
    cpb = codes_per_unit(bits)
    stats_dtype = stats_dtype or x.dtype
    if stats_dtype not in _TL_DTYPES or x.dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtypes x={x.dtype} stats={stats_dtype}")
    if group % cpb:
        raise ValueError(f"group={group} is not a multiple of {cpb} codes per packing unit")
    if axis == "channel" and n % group:
        raise ValueError(f"{n} tokens do not split into key groups of {group} tokens")
    code_shape, stat_shape = output_shapes(x.shape, bits, axis, group)
    if out is None:
        codes = torch.empty(code_shape, dtype=torch.uint8, device=x.device)
        scale = torch.empty(stat_shape, dtype=stats_dtype, device=x.device)
        minimum = torch.empty(stat_shape, dtype=stats_dtype, device=x.device)
    else:
        codes, scale, minimum = out
        if tuple(codes.shape) != code_shape or tuple(scale.shape) != stat_shape or tuple(minimum.shape) != stat_shape:
            raise ValueError(f"out shapes {tuple(codes.shape)}/{tuple(scale.shape)} != {code_shape}/{stat_shape}")
        if codes.dtype != torch.uint8 or scale.dtype != stats_dtype or minimum.dtype != stats_dtype:
            raise TypeError("out dtypes must be uint8 / stats_dtype / stats_dtype")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if B * H * n == 0:
        return codes, scale, minimum
    has_ex = exclude is not None
    ex = exclude.to(torch.uint8).contiguous() if has_ex else x  # dummy pointer when absent
    if has_ex and tuple(ex.shape) != tuple(x.shape):
        raise ValueError(f"exclude shape {tuple(ex.shape)} != x shape {tuple(x.shape)}")
    strides = (*_strides3(x), *_strides3(ex), *_strides3(codes), *_strides3(scale), *_strides3(minimum))
    stats_tl = _TL_DTYPES[stats_dtype]
    if axis == "channel":
        sub_b = max(1, min(_p2(group // cpb), 2048 // (cpb * _p2(d))))  # tiles of <= 2048 elements
        grid = (B * H, n // group)
        _launch(_quant_channel_kernel, grid, (x, ex, codes, scale, minimum, H, n, d, *strides),
                dict(GROUP=group, BITS=bits, CPB=cpb, SUB_B=sub_b, D_P2=_p2(d), HAS_EXCLUDE=has_ex,
                     STATS_DT=stats_tl, num_warps=4, enable_fp_fusion=False), _plan)
    else:
        n_groups = -(-d // group)
        block_t = max(1, min(64, 1024 // _p2(group)))
        grid = (B * H, triton.cdiv(n, block_t))
        _launch(_quant_token_kernel, grid, (x, ex, codes, scale, minimum, H, n, d, n_groups, code_shape[-1],
                                            *strides),
                dict(GROUP=group, BITS=bits, CPB=cpb, BLOCK_T=block_t, GB_P2=_p2(group // cpb), HAS_EXCLUDE=has_ex,
                     STATS_DT=stats_tl, num_warps=4, enable_fp_fusion=False), _plan)
    return codes, scale, minimum
