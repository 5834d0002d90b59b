"""Key tiles of the reconstruction kernel (`reconstruct_kernel`): a BN-token tile of a run stored per channel over
token groups, decoded in registers to float32 [BN, C] -- codes of 2/3/4/8 bits masked in place in their 32-bit words
(`_word_channel_tile`), allocated widths as bit planes (`_plane_tile`) -- and the low-rank term of rank <= 4 as float32
multiply-adds (`_factor_row`, `_lowrank_fma`), the alternative to the tensor-core dot of `ops._lowrank_dot`."""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import _lowrank_dot
from .tiles import _channel_stats
from .unpack import _plane_bytes, _plane_words, _planes_to_codes


@triton.jit
def _stack(x0, x1, x2, x3, x4, x5, x6, x7, N: tl.constexpr):
    """The first N (1, 2, 4 or 8) of x0..x7 [R, Q, 4] stacked along a new last axis: [R, Q, 4, N]."""
    R: tl.constexpr = x0.shape[0]
    Q: tl.constexpr = x0.shape[1]
    if N == 1:
        return tl.reshape(x0, [R, Q, 4, 1])
    elif N == 2:
        return tl.join(x0, x1)
    elif N == 4:
        return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [R, Q, 4, 4])
    else:
        even = tl.reshape(tl.join(tl.join(x0, x4), tl.join(x2, x6)), [R, Q, 4, 4])
        odd = tl.reshape(tl.join(tl.join(x1, x5), tl.join(x3, x7)), [R, Q, 4, 4])
        return tl.reshape(tl.join(even, odd), [R, Q, 4, 8])


@triton.jit
def _in_place(t, MASK: tl.constexpr):
    """Each byte k of the words t [R, Q] masked in place: [R, Q, 4], code k = (t & MASK << 8k), i.e. its code
    times 2^(8k) (one mask per code; the place value leaves through `_byte_scales`)."""
    return tl.reshape(tl.join(tl.join(t & MASK, t & (MASK << 16)), tl.join(t & (MASK << 8), t & (MASK << 24))),
                      [t.shape[0], t.shape[1], 4])


@triton.jit
def _byte_scales(sc):
    """sc [R, C] times 2^(-8k), k = c % 4 (the place value of channel c's byte in a word; exact)."""
    R: tl.constexpr = sc.shape[0]
    C: tl.constexpr = sc.shape[1]
    e, o = tl.split(tl.reshape(sc, [R, C // 4, 2, 2]))  # [R, C/4, 2] each: k = 2a + b, b = 0 (e) or 1 (o)
    e0, e1 = tl.split(e)  # k = 0, 2
    o0, o1 = tl.split(o)  # k = 1, 3
    e = tl.join(e0, e1 * 1.52587890625e-05)  # 2^-16
    o = tl.join(o0 * 0.00390625, o1 * 5.9604644775390625e-08)  # 2^-8, 2^-24
    return tl.reshape(tl.join(e, o), [R, C])


@triton.jit
def _unit_codes(codes_b, s_codes, unit0, slot_end, cw, SET: tl.constexpr, RS: tl.constexpr, BITS: tl.constexpr,
                UNIT: tl.constexpr, MASK: tl.constexpr):
    """The codes, masked in place, of the words of units unit0 + SET*RS + [0, RS) (rows s_codes bytes apart) at
    word columns cw [1, C/4]: uint32 [RS, C/4, 4 (byte k), UNIT (token j)], token j's shift done once per word."""
    units = unit0 + SET * RS + tl.arange(0, RS)
    w = tl.load((codes_b + units[:, None] * s_codes).to(tl.pointer_type(tl.int32)) + cw,
                mask=(units * UNIT < slot_end)[:, None], other=0).to(tl.uint32, bitcast=True)
    t0 = _in_place(w, MASK)
    if UNIT > 1:
        t1 = _in_place(w >> BITS, MASK)
    else:
        t1 = t0
    if UNIT > 2:
        t2 = _in_place(w >> 4, MASK)
        t3 = _in_place(w >> 6, MASK)
    else:
        t2 = t0
        t3 = t0
    return _stack(t0, t1, t2, t3, t0, t0, t0, t0, UNIT)


@triton.jit
def _word_channel_tile(codes_b, scale_b, min_b, s_codes, s_scale, slot, slot0, slot_end, tvalid, ch, ch0,
                       BITS: tl.constexpr, UNIT: tl.constexpr, GROUP: tl.constexpr, STATS_ROW: tl.constexpr,
                       SETS: tl.constexpr):
    """`tiles._per_channel_tile`'s D̂ of 2/3/4/8-bit codes (no bit planes), float32 [BN, C], from 32-bit words of 4
    channels' bytes (3 bits: one word from each of a unit's three byte rows). Each code is masked in place in its
    word (its token's shift of the word done once per word), converted, and multiplied by its channel's scale times
    2^(-8k) (k: the channel's byte in the word; `_byte_scales`, per tile): one mask, one conversion and one
    multiply-add per code instead of a shift, an extraction, a conversion and a multiply-add."""
    BN: tl.constexpr = slot.shape[0]
    C: tl.constexpr = ch.shape[0]
    R: tl.constexpr = BN // UNIT
    cw = (ch0 // 4 + tl.arange(0, C // 4))[None, :]
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 3:  # a unit: 3 byte rows, the 2-bit plane of tokens 0-3, of tokens 4-7, then the 1-bit plane
        units = slot0 // UNIT + tl.arange(0, R)
        um = (units * UNIT < slot_end)[:, None]
        rows = (codes_b + (units * 3)[:, None] * s_codes).to(tl.pointer_type(tl.int32)) + cw
        w0 = tl.load(rows, mask=um, other=0).to(tl.uint32, bitcast=True)
        w1 = tl.load(rows + s_codes // 4, mask=um, other=0).to(tl.uint32, bitcast=True)
        w2 = tl.load(rows + 2 * (s_codes // 4), mask=um, other=0).to(tl.uint32, bitcast=True)
        P2: tl.constexpr = 0x03030303
        P1: tl.constexpr = 0x04040404
        t0 = _in_place(w0 & P2 | (w2 << 2) & P1, MASK)
        t1 = _in_place((w0 >> 2) & P2 | (w2 << 1) & P1, MASK)
        t2 = _in_place((w0 >> 4) & P2 | w2 & P1, MASK)
        t3 = _in_place((w0 >> 6) & P2 | (w2 >> 1) & P1, MASK)
        t4 = _in_place(w1 & P2 | (w2 >> 2) & P1, MASK)
        t5 = _in_place((w1 >> 2) & P2 | (w2 >> 3) & P1, MASK)
        t6 = _in_place((w1 >> 4) & P2 | (w2 >> 4) & P1, MASK)
        t7 = _in_place((w1 >> 6) & P2 | (w2 >> 5) & P1, MASK)
        code = tl.reshape(tl.permute(_stack(t0, t1, t2, t3, t4, t5, t6, t7, 8), (0, 3, 1, 2)), [BN, C])
    else:  # UNIT tokens per byte, token j at bits BITS*j; SETS > 1: the rows read as S sets of R/S consecutive
        # units, each set a word of every thread, so a thread holds S rows of a word column (fewer channels: fewer
        # statistics per tile)
        S: tl.constexpr = SETS
        c0 = _unit_codes(codes_b, s_codes, slot0 // UNIT, slot_end, cw, 0, R // S, BITS, UNIT, MASK)
        if S == 1:  # [R, C/4, 4, UNIT] -> token-major
            code = tl.reshape(tl.permute(c0, (0, 3, 1, 2)), [BN, C])
        else:
            c1 = _unit_codes(codes_b, s_codes, slot0 // UNIT, slot_end, cw, 1, R // S, BITS, UNIT, MASK)
            if S == 2:
                code = tl.join(c0, c1)  # [R/S, C/4, 4, UNIT, 2]
            else:
                c2 = _unit_codes(codes_b, s_codes, slot0 // UNIT, slot_end, cw, 2, R // S, BITS, UNIT, MASK)
                c3 = _unit_codes(codes_b, s_codes, slot0 // UNIT, slot_end, cw, 3, R // S, BITS, UNIT, MASK)
                code = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [R // S, C // 4, 4, UNIT, 4])
            code = tl.reshape(tl.permute(code, (4, 0, 3, 1, 2)), [BN, C])  # token = (set * R/S + row) * UNIT + j
    sc, mn = _channel_stats(scale_b, min_b, s_scale, slot, slot0, tvalid, ch, ch0, GROUP, STATS_ROW)
    return code.to(tl.float32) * _byte_scales(sc) + mn


@triton.jit
def _factor_row(bm_b, s_bm, b_rows, as_b, bs_b, chunk, r: tl.constexpr, R: tl.constexpr):
    """Column r of B at rows b_rows [C] as float32 (int8 factors: times the chunk's a_scale·b_scale of rank r);
    zeros when r >= R."""
    if r < R:
        b = tl.load(bm_b + b_rows * s_bm + r).to(tl.float32)
        if bm_b.dtype.element_ty == tl.int8:
            b = b * (tl.load(as_b + chunk * R + r).to(tl.float32) * tl.load(bs_b + chunk * R + r).to(tl.float32))
    else:
        b = tl.zeros(b_rows.shape, tl.float32)
    return b


@triton.jit
def _lowrank_fma(x1, x2, a_b, s_a, slot, tvalid, p0, q0, p1, q1, p2, q2, p3, q3, R: tl.constexpr):
    """x1, x2 [BN, C] + A·Bᵀ of rank R <= 4 in float32 multiply-adds (R per element): A's columns at store slots
    `slot` [BN]; (p_r, q_r) [C]: B's column r at the channels of x1 and of x2 (`_factor_row`, read once per run)."""
    for r in tl.static_range(R):
        a = tl.load(a_b + slot * s_a + r, mask=tvalid, other=0).to(tl.float32)[:, None]
        if r == 0:
            x1 += a * p0[None, :]
            x2 += a * q0[None, :]
        elif r == 1:
            x1 += a * p1[None, :]
            x2 += a * q1[None, :]
        elif r == 2:
            x1 += a * p2[None, :]
            x2 += a * q2[None, :]
        else:
            x1 += a * p3[None, :]
            x2 += a * q3[None, :]
    return x1, x2


@triton.jit
def _plane_tile(codes_b, scale_b, min_b, widths, offset, need1, need2, mlo, mhi, slot, slot0, slot_end, tvalid, ch,
                ch0, a, bt, ROW: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                STATS_ROW: tl.constexpr, DT: tl.constexpr):
    """`tiles._per_channel_tile` of bit planes, with the chunk's plane offsets and masks read once
    (`unpack._plane_offsets`, `_plane_masks`): float32 [BN, C]."""
    BN: tl.constexpr = slot.shape[0]
    C: tl.constexpr = ch.shape[0]
    if ROW % 4 == 0:  # rows of whole words
        lo, hi = _plane_words(codes_b, ROW, offset, need1, need2, mlo, mhi, slot0, slot_end, BN, C)
    else:
        lo, hi = _plane_bytes(codes_b, ROW, widths, offset, slot0, slot_end, BN, C)
    sc, mn = _channel_stats(scale_b, min_b, D, slot, slot0, tvalid, ch, ch0, GROUP, STATS_ROW)
    k = _planes_to_codes(lo, hi, BN, C).to(tl.float32) * sc + mn
    if R > 0:
        k = _lowrank_dot(a, bt, k, DT)
    return k
