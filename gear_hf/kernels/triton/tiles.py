"""Tiles of the fused decode kernel: one block of compressed tokens (keys per channel, values per token or per
channel, key outliers, low-rank terms) or of full-precision tokens (sink, buffer), decoded in registers and fed to
the online softmax."""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import (
    _dot,
    _lowrank_a,
    _lowrank_bt,
    _lowrank_dot,
    _lowrank_values,
    _rope,
    _sincos,
    _softmax_step,
    _unrotate_halves,
)
from .unpack import _load_rows, _plane_codes, _unpack_3bit_units, _unpack_words

OUTLIERS_PER_STEP = tl.constexpr(32)  # key outliers applied per one-hot dot
TAIL_TOKENS = tl.constexpr(16)  # tokens per step of a buffer held per token (`_buffer_block`)
HELD_TOKENS = tl.constexpr(32)  # tokens per step of a held chunk (`_held_chunk_blocks`)


@triton.jit
def _channel_stats(scale_b, min_b, s_scale, slot, slot0, tvalid, ch, ch0, GROUP: tl.constexpr,
                   STATS_ROW: tl.constexpr):
    """(scale, minimum) float32 of a run stored per channel over token groups at store slots `slot` [BN] and
    channels `ch` [C] (from ch0): [1, C] when STATS_ROW (the slots lie in one group, from slot0), else [BN, C]."""
    C: tl.constexpr = ch.shape[0]
    if STATS_ROW:  # one row of the group's statistics, [1, C]
        srow = (slot0 // GROUP) * s_scale + ch0 + tl.zeros([1], tl.int32)
        sc = _load_rows(scale_b + srow, tl.full([1, 1], True, tl.int1), C)
        mn = _load_rows(min_b + srow, tl.full([1, 1], True, tl.int1), C)
    else:
        srow = (slot // GROUP)[:, None] * s_scale + ch[None, :]
        sc = tl.load(scale_b + srow, mask=tvalid[:, None], other=0.0).to(tl.float32)
        mn = tl.load(min_b + srow, mask=tvalid[:, None], other=0.0).to(tl.float32)
    return sc, mn


@triton.jit
def _per_channel_tile(codes_b, scale_b, min_b, s_codes, s_scale, slot, slot0, slot_end, tvalid, ch, ch0, a, bt,
                      widths_b, BITS: tl.constexpr, UNIT: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                      STATS_ROW: tl.constexpr, DT: tl.constexpr, PLANES: tl.constexpr):
    """A run stored per channel over token groups (axis="channel": keys, a half of head_dim at a time; values with
    value_axis="channel", all channels) at store slots `slot` [BN] (slot0 + arange, valid below slot_end) and
    channels `ch` [C] (from ch0): D̂ + A·Bᵀ in float32 [BN, C] (a: the block's `_lowrank_a`, bt: the chunk's
    `_lowrank_bt` of these channels; R=0: no low-rank term).
    STATS_ROW: the block lies inside one quantization group (starting at slot0): one row of scale/minimum.
    PLANES: widths per channel (widths_b: the chunk's), stored as bit planes; s_codes: bytes per 8 tokens."""
    BN: tl.constexpr = slot.shape[0]
    C: tl.constexpr = ch.shape[0]
    if PLANES:
        code = _plane_codes(codes_b, s_codes, widths_b, slot0, slot_end, ch0, BN, C)
    elif BITS != 3:  # 32-bit words of 4 channels' bytes (UNIT tokens each): [BN/UNIT, C/4, 4, UNIT] -> [BN, C]
        units = slot0 // UNIT + tl.arange(0, BN // UNIT)
        rows = (codes_b + units[:, None] * s_codes).to(tl.pointer_type(tl.int32))
        w = tl.load(rows + (ch0 // 4 + tl.arange(0, C // 4))[None, :], mask=(units * UNIT < slot_end)[:, None],
                    other=0)
        code = tl.reshape(_unpack_words(w, BITS), [BN // UNIT, C // 4, 4, UNIT])
        code = tl.reshape(tl.permute(code, (0, 3, 1, 2)), [BN, C])
    else:  # 3 bits, units of 3 bytes: [BN/8, C, 8] -> [BN, C], token = unit * 8 + j
        units = slot0 // UNIT + tl.arange(0, BN // UNIT)
        code = _unpack_3bit_units(codes_b + (units * 3)[:, None] * s_codes + ch[None, :], s_codes,
                                  (units * UNIT < slot_end)[:, None])
        code = tl.reshape(tl.permute(code, (0, 2, 1)), [BN, C])
    sc, mn = _channel_stats(scale_b, min_b, s_scale, slot, slot0, tvalid, ch, ch0, GROUP, STATS_ROW)
    k = code.to(tl.float32) * sc + mn
    if R > 0:  # + A·Bᵀ on the tensor cores (rank padded to 16 with zeros)
        k = _lowrank_dot(a, bt, k, DT)
    return k


@triton.jit
def _stats8(scale_code, zero_code, TOP: tl.constexpr):
    """(scale, minimum) float32 of 8-bit statistics (uint8 codes, any shape) as `quant.decode_stats8` decodes them,
    bit for bit: scale = LOG_SCALES[code], minimum = -(zero_code * TOP / 255 * scale) (float32, that order, the division
    rounded to nearest) rounded down to a bf16 value. LOG_SCALES[k] (k >= 1: 2^((k-161)/8) in bf16) = 2^q times
    LOG_SCALES[161 + r] for k - 161 = 8q + r: built exactly from eight constants, no table in memory."""
    k = scale_code.to(tl.int32)
    q = (k + 7) // 8 - 21  # floor((k - 161) / 8), on non-negative operands
    r = (k + 7) % 8
    frac = tl.where(r == 0, 1.0, tl.where(r == 1, 1.09375, tl.where(r == 2, 1.1875, tl.where(
        r == 3, 1.296875, tl.where(r == 4, 1.4140625, tl.where(r == 5, 1.5390625, tl.where(
            r == 6, 1.6796875, 1.8359375)))))))
    scale = tl.where(k == 0, 0.0, frac * ((q + 127) << 23).to(tl.float32, bitcast=True))
    # zero_code * TOP / 255 rounded to nearest: a product by the rounded reciprocal and one FMA correction (exact for
    # every code and top, checked exhaustively in tests/test_kernels_tc.py; a division costs a subroutine call)
    x = zero_code.to(tl.float32) * TOP
    inv = 1.0 / 255.0
    q = x * inv
    ratio = tl.fma(tl.fma(-q, 255.0, x), inv, q)
    exact = -(ratio * scale)
    bits = exact.to(tl.int32, bitcast=True)
    kept = bits & -65536  # the bf16 toward zero; a negative value with dropped bits: one bf16 ulp further from zero
    away = ((kept != bits) & (bits < 0)).to(tl.int32)
    return scale, (kept + (away << 16)).to(tl.float32, bitcast=True)


@triton.jit
def _load_token_stats(scale_b, min_b, offsets, mask, TOP: tl.constexpr):
    """(scale, minimum) float32 of the groups at `offsets` (any shape): 16-bit fields, or 8-bit statistics' uint8
    codes (`_stats8`; TOP: the group's highest code)."""
    if scale_b.dtype.element_ty == tl.uint8:
        return _stats8(tl.load(scale_b + offsets, mask=mask, other=0), tl.load(min_b + offsets, mask=mask, other=0),
                       TOP)
    return tl.load(scale_b + offsets, mask=mask, other=0.0).to(tl.float32), \
        tl.load(min_b + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _token_stats(scale_b, min_b, s_scale, slot, tvalid, D: tl.constexpr, GROUP: tl.constexpr, STATS_W: tl.constexpr,
                 mult, TOP: tl.constexpr):
    """(scale, minimum) float32 [BN, D] of a run stored per token over channel groups at store slots `slot` [BN],
    both times `mult` (a factor folded into the dequantization); TOP: the highest code (8-bit statistics)."""
    BN: tl.constexpr = slot.shape[0]
    m2 = tvalid[:, None]
    if STATS_W * GROUP == D:  # whole groups: one load per group, broadcast over its channels in registers
        g = tl.arange(0, STATS_W)
        sc, mn = _load_token_stats(scale_b, min_b, slot[:, None] * s_scale + g[None, :], m2, TOP)
        sc = tl.reshape(tl.broadcast_to((sc * mult)[:, :, None], [BN, STATS_W, GROUP]), [BN, D])
        mn = tl.reshape(tl.broadcast_to((mn * mult)[:, :, None], [BN, STATS_W, GROUP]), [BN, D])
    else:
        sc, mn = _load_token_stats(scale_b, min_b, slot[:, None] * s_scale + (tl.arange(0, D) // GROUP)[None, :], m2,
                                   TOP)
        sc = sc * mult
        mn = mn * mult
    return sc, mn


@triton.jit
def _value_tile(codes_b, scale_b, min_b, spv_b, spi_b, s_codes, s_scale, s_sp, slot, tvalid,
                D: tl.constexpr, BITS: tl.constexpr, UNIT: tl.constexpr, GROUP: tl.constexpr, K2: tl.constexpr,
                STATS_W: tl.constexpr):
    """Values (axis="token") at store slots `slot` [BN], all channels: D̂ + S in float32 [BN, D]."""
    c = tl.arange(0, D)
    m2 = tvalid[:, None]
    BN: tl.constexpr = slot.shape[0]
    if BITS == 3:  # 8 codes in 3 bytes: byte by byte
        units = tl.arange(0, D // UNIT)
        code = tl.reshape(_unpack_3bit_units(codes_b + slot[:, None] * s_codes + (units * 3)[None, :], 1, m2), [BN, D])
    else:  # a row is D*BITS/8 bytes, a multiple of 4: loaded as 32-bit words (4x fewer loads, fewer rows per thread)
        WORDS: tl.constexpr = D * BITS // 32
        rows = (codes_b + slot[:, None] * s_codes).to(tl.pointer_type(tl.int32))
        w = tl.load(rows + tl.arange(0, WORDS)[None, :], mask=m2, other=0)
        code = tl.reshape(_unpack_words(w, BITS), [BN, D])
    sc, mn = _token_stats(scale_b, min_b, s_scale, slot, tvalid, D, GROUP, STATS_W, 1.0, (1 << BITS) - 1)
    v = code.to(tl.float32) * sc + mn
    for s in tl.static_range(K2):  # a token's outliers, added where their channel is (no extra [BN, D] tile)
        idx = tl.load(spi_b + slot * s_sp + s, mask=tvalid, other=-1).to(tl.int32)
        val = tl.load(spv_b + slot * s_sp + s, mask=tvalid, other=0.0).to(tl.float32)
        v = tl.where(idx[:, None] == c[None, :], v + val[:, None], v)
    return v


@triton.jit
def _key_outlier_scores(s, q_rows, mvalid, ow_b, ov_b, ot_b, n_tiles, seg, tok0, t_base, pos_b, freq_ptr,
                        q_scale, D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, OE: tl.constexpr,
                        IEEE: tl.constexpr, FAST: tl.constexpr):
    """s [M, BN] += exact score terms of the key outliers of chunk-local tokens [tok0, tok0 + BN) (sorted by
    token; ot_b: the chunk's per-16-token offsets into its segment `seg` of ow_b/ov_b). An outlier v at
    (token t, channel j) adds v·(q_j cos_tj ± q_{j±d/2} sin_tj) to score t, through a one-hot [OE, BN] dot."""
    u0 = tok0 // 16
    lo = tl.load(ot_b + u0)
    hi = tl.load(ot_b + tl.minimum(u0 + BN // 16, n_tiles))
    n_offs = tl.arange(0, BN)
    LOG2D: tl.constexpr = D.bit_length() - 1
    # Per-outlier quantities (position, channel, cos/sin, value) on 1D [OE] vectors (one entry per thread of a
    # warp), then broadcast over the query rows; the one-hot along the block's tokens is [OE, BN].
    e_en = tl.arange(0, OE)[:, None] + tl.zeros([OE, BN], tl.int32)
    for e0 in range(lo, hi, OE):
        e = e0 + tl.arange(0, OE)
        ev = e < hi
        where = tl.load(ow_b + seg + e, mask=ev, other=0)
        w1 = tl.load(ov_b + seg + e, mask=ev, other=0.0).to(tl.float32) * q_scale
        ch1 = where & (D - 1)  # where >= 0 and D a power of two: shifts and masks, not signed division
        pos = tl.load(pos_b + t_base + (where >> LOG2D), mask=ev, other=0)
        cos1, sin1 = _sincos(pos.to(tl.float32) * tl.load(freq_ptr + ch1 % HALF), FAST)
        ch = ch1[None, :]
        cos = cos1[None, :]
        sin = tl.where(ch1 < HALF, sin1, -sin1)[None, :]
        w = w1[None, :]
        m2 = mvalid[:, None] & ev[None, :]
        qv = tl.load(q_rows[:, None] + ch, mask=m2, other=0.0).to(tl.float32)
        qp = tl.load(q_rows[:, None] + (ch + HALF) % D, mask=m2, other=0.0).to(tl.float32)
        contrib = (qv * cos + qp * sin) * w  # [M, OE]
        et = e0 + e_en
        tok = tl.load(ow_b + seg + et, mask=et < hi, other=-D) >> LOG2D  # [OE, BN]
        onehot = tl.where((tok - tok0) == n_offs[None, :], 1.0, 0.0)
        if IEEE:
            s += tl.dot(contrib, onehot, input_precision="ieee")
        else:
            s += tl.dot(contrib, onehot, input_precision="tf32")
    return s


@triton.jit
def _compressed_scores(
    q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale, mvalid,
    kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, kbt1, kbt2, had_ptr,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, ROT_K: tl.constexpr,
    K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_SPARSE: tl.constexpr,
    K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr,
):
    """Scores [M, BN] of the query rows against one block of compressed keys (see `_compressed_block`)."""
    h_offs = tl.arange(0, HALF)
    ka16 = _lowrank_a(ka, s_ka, slot, tvalid, K_R, DT) if K_R > 0 else 0  # shared by both halves
    k1 = _per_channel_tile(kc, ks, km, s_kc, s_ks, slot, slot0, slot_end, tvalid, h_offs, 0, ka16, kbt1, kw,
                           K_BITS, K_UNIT, K_GROUP, K_R, K_STATS_ROW, DT, K_PLANES)
    k2 = _per_channel_tile(kc, ks, km, s_kc, s_ks, slot, slot0, slot_end, tvalid, h_offs + HALF, HALF, ka16, kbt2,
                           kw, K_BITS, K_UNIT, K_GROUP, K_R, K_STATS_ROW, DT, K_PLANES)
    if ROT_K:  # stored keys are k·H (Walsh–Hadamard): un-rotate before RoPE, k·H·H = k
        k1, k2 = _unrotate_halves(k1, k2, had_ptr, D, DT)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    k1, k2 = _rope(k1, k2, pos, freq, FAST)
    s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
    if K_SPARSE:
        s = _key_outlier_scores(s, q_rows, mvalid, ow, ov, ot, n_tiles, seg, tok0, t_base, pos_b, freq_ptr,
                                q_scale, D, HALF, BN, OUTLIERS_PER_STEP, DT == tl.float32, FAST)
    return s


@triton.jit
def _compressed_block(
    q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale, limit, mvalid,
    window, m_i, l_i, acc,
    kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw,
    vc, vs, vm, vsv, vsi, va, s_vc, s_vs, s_vsp, s_va, kbt1, kbt2, vbt, had_ptr,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, ROT_K: tl.constexpr,
    K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_SPARSE: tl.constexpr,
    K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr,
    V_BITS: tl.constexpr, V_UNIT: tl.constexpr, V_GROUP: tl.constexpr, V_R: tl.constexpr, V_K2: tl.constexpr,
    V_BY_CHANNEL: tl.constexpr, V_STATS_ROW: tl.constexpr,
):
    """One block of compressed tokens; kbt1/kbt2/vbt: the chunk's `_lowrank_bt` (key halves, values); kw: the chunk's
    key widths (K_PLANES: widths per channel, kc's rows are s_kc bytes per 8 tokens).
    V_BY_CHANNEL: values stored per channel over token groups (value_axis="channel", no outliers): read like keys."""
    s = _compressed_scores(q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale,
                           mvalid, kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, kbt1, kbt2,
                           had_ptr, D, HALF, BN, DT, FAST, ROT_K, K_BITS, K_UNIT, K_GROUP, K_R, K_SPARSE,
                           K_STATS_ROW, K_PLANES)
    if V_BY_CHANNEL:  # codes packed along tokens, a row of statistics per token group: the keys' layout
        v = _per_channel_tile(vc, vs, vm, s_vc, s_vs, slot, slot0, slot_end, tvalid, tl.arange(0, D), 0, 0, 0, 0,
                              V_BITS, V_UNIT, V_GROUP, 0, V_STATS_ROW, DT, False)
    else:
        v = _value_tile(vc, vs, vm, vsv, vsi, s_vc, s_vs, s_vsp, slot, tvalid, D, V_BITS, V_UNIT, V_GROUP, V_K2,
                        s_vs)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    if V_R > 0:
        acc = _lowrank_values(acc, p, _lowrank_a(va, s_va, slot, tvalid, V_R, DT), vbt, DT)
    return m_i, l_i, acc


@triton.jit
def _held_block(
    q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale, limit, mvalid,
    window, m_i, l_i, acc,
    kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, kbt1, kbt2, had_ptr,
    tvc, tvs, tvm, tve, stg_b, stg_n, vslot,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, ROT_K: tl.constexpr,
    K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_SPARSE: tl.constexpr,
    K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr, ROT_V: tl.constexpr, T_V_BITS: tl.constexpr,
    T_V_ROT: tl.constexpr,
):
    """One block of a row's newest decode chunk whose values are held (`GearConfig.value_buffer_size`): keys from the
    compressed chunk (`_compressed_scores`), values from the value buffer held per token at its slots `vslot` [BN]
    (tvc/tvs/tvm: the head's codes, scale, minimum; `_tail_values`), a staged one (stg_b [stg_n] flags) exact from tve
    (rows of D elements)."""
    s = _compressed_scores(q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale,
                           mvalid, kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, kbt1, kbt2,
                           had_ptr, D, HALF, BN, DT, FAST, ROT_K, K_BITS, K_UNIT, K_GROUP, K_R, K_SPARSE,
                           K_STATS_ROW, K_PLANES)
    staged = tl.load(stg_b + vslot, mask=tvalid & (vslot < stg_n), other=0) != 0
    v = _tail_values(tvc, tvs, tvm, vslot, tvalid & (staged == 0), had_ptr, D, T_V_BITS, T_V_ROT, ROT_V, DT)
    if tl.max(staged.to(tl.int32), axis=0) > 0:  # (masked loads: zeros where a token is coded)
        v += _dense_values(tve, vslot * D, staged[:, None], had_ptr, D, HALF, DT, ROT_V)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


@triton.jit
def _held_chunk_blocks(
    lo, hi, e2, e3, s_len, p_len, c_cnt, q1, q2, q_rows, pos_b, freq_ptr, freq, q_scale, limit, mvalid, window,
    m_i, l_i, acc,
    dkc, dks, dkm, dka, dkb, dow, dov, dot_, d_seg, dkas, dkbs, dkw, had_ptr, tvc, tvs, tvm, tve, stg_b, stg_n,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr,
    ROT_K: tl.constexpr, K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr,
    K_SPARSE: tl.constexpr, K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr, K_ROW: tl.constexpr,
    ROT_V: tl.constexpr, T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr,
):
    """This split's blocks of the row's newest decode chunk (c_cnt - 1, blocks [e3 - NB/BN, e3)) when its values are
    held at the front of the value buffer (`_held_block`); the pointers are the head's (decode keys: the kernel's d*
    arguments; the value buffer held per token and the values' staged flags)."""
    PER_CHUNK: tl.constexpr = NB // BN
    # 32-token steps at most: the register kernel's key tiles (`_compressed_scores`) beside a decoded value tile spill
    # at 64 tokens (the tensor-core kernel's blocks; sm_90 compile report: 201 spill ops)
    HB: tl.constexpr = HELD_TOKENS if BN > HELD_TOKENS else BN
    chunk = c_cnt - 1
    h_lo = tl.maximum(tl.maximum(lo, e2), e3 - PER_CHUNK)
    h_hi = tl.minimum(hi, e3)
    if h_lo < h_hi:  # (none when the row has no decode chunk: h_lo >= e2 = e3)
        h_offs = tl.arange(0, HALF)
        n_offs = tl.arange(0, HB)
        if K_R > 0:
            kbt1 = _lowrank_bt(dkb, K_R, chunk * D + h_offs, dkas, dkbs, chunk, K_R, DT)
            kbt2 = _lowrank_bt(dkb, K_R, chunk * D + HALF + h_offs, dkas, dkbs, chunk, K_R, DT)
        else:
            kbt1 = 0
            kbt2 = 0
        for blk in range(h_lo, h_hi):
            for sub in range(0, BN // HB):
                slot0 = (blk - e2) * BN + sub * HB  # decode chunks are contiguous along the key store's slot axis
                slot = slot0 + n_offs
                tvalid = slot < c_cnt * NB
                t = s_len + p_len + slot
                m_i, l_i, acc = _held_block(
                    q1, q2, q_rows, t, slot, slot0, c_cnt * NB, tvalid, slot0 - chunk * NB, pos_b, freq_ptr, freq,
                    q_scale, limit, mvalid, window, m_i, l_i, acc, dkc, dks, dkm, dka, K_ROW, D, K_R, dow, dov,
                    dot_ + chunk * (NB // 16 + 1), NB // 16, chunk * d_seg, s_len + p_len + chunk * NB,
                    dkw + chunk * D, kbt1, kbt2, had_ptr, tvc, tvs, tvm, tve, stg_b, stg_n, slot - chunk * NB, D, HALF,
                    HB, DT, FAST, ROT_K, K_BITS, K_UNIT, K_GROUP, K_R, K_SPARSE, K_STATS_ROW, K_PLANES, ROT_V,
                    T_V_BITS, T_V_ROT)
    return m_i, l_i, acc


@triton.jit
def _dense_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit,
                 mvalid, window, m_i, l_i, acc, had_ptr, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                 FAST: tl.constexpr, ROT_V: tl.constexpr):
    """Full-precision tokens (sink or buffer) at store slots `slot`."""
    return _tile_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                       had_ptr, 0, 0, 0, 0, 0, 0, D, HALF, DT, FAST, ROT_V, 0, False, 0, False)


@triton.jit
def _dense_values(v_b, rows, m2, had_ptr, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                  ROT_V: tl.constexpr):
    """Full-precision values at rows [BN] (element offsets) of v_b: float32 [BN, D], in the rotated basis when
    ROT_V."""
    if ROT_V:  # the compressed values are attended in the rotated basis (v·H); the output is un-rotated once
        v1, v2 = _unrotate_halves(_load_rows(v_b + rows, m2, HALF), _load_rows(v_b + rows + HALF, m2, HALF),
                                  had_ptr, D, DT)
        v = tl.reshape(tl.permute(tl.join(v1, v2), (0, 2, 1)), [v1.shape[0], D])
    else:
        v = tl.load(v_b + rows[:, None] + tl.arange(0, D)[None, :], mask=m2, other=0.0)
    return v


@triton.jit
def _tail_halves(codes_b, scale_b, min_b, slot, coded, had_ptr, D: tl.constexpr, BITS: tl.constexpr,
                 ROT: tl.constexpr, DT: tl.constexpr):
    """The coded tokens (mask coded [BN]) at slots `slot` of a buffer held per token (`views.CodedTailView`) as
    halves float32 [BN, D/2]: code * scale + minimum (one scale and minimum per token), times H when ROT (the
    Walsh–Hadamard rotation, its own inverse: codes of x·H back to x, or codes of x to x·H). A half's codes are
    32-bit words of D*BITS/64 bytes (8-bit codes, or 4-bit codes two a byte, the even channel in the low nibble)."""
    HALF: tl.constexpr = D // 2
    BN: tl.constexpr = slot.shape[0]
    sc = tl.load(scale_b + slot, mask=coded, other=0.0).to(tl.float32)[:, None]
    mn = tl.load(min_b + slot, mask=coded, other=0.0).to(tl.float32)[:, None]
    words = (codes_b + slot[:, None] * (D * BITS // 8)).to(tl.pointer_type(tl.int32))
    w_offs = tl.arange(0, HALF * BITS // 32)[None, :]
    w1 = tl.load(words + w_offs, mask=coded[:, None], other=0)
    w2 = tl.load(words + HALF * BITS // 32 + w_offs, mask=coded[:, None], other=0)
    x1 = tl.reshape(_unpack_words(w1, BITS), [BN, HALF]).to(tl.float32) * sc + mn
    x2 = tl.reshape(_unpack_words(w2, BITS), [BN, HALF]).to(tl.float32) * sc + mn
    if ROT:
        x1, x2 = _unrotate_halves(x1, x2, had_ptr, D, DT)
    return x1, x2


@triton.jit
def _tail_values(codes_b, scale_b, min_b, slot, coded, had_ptr, D: tl.constexpr, BITS: tl.constexpr,
                 ROT: tl.constexpr, ROT_V: tl.constexpr, DT: tl.constexpr):
    """Values of the coded tokens (mask coded [BN]) at slots `slot` of a buffer held per token, float32 [BN, D] in
    the basis the kernel attends values in (ROT_V: rotated): as stored when ROT == ROT_V (ROT: codes of v·H; one
    group per token, read as `_value_tile` reads a run of values per token), else turned by halves
    (`_tail_halves`)."""
    if ROT == ROT_V:
        v = _value_tile(codes_b, scale_b, min_b, scale_b, scale_b, D * BITS // 8, 1, 0, slot, coded, D, BITS, 1, D,
                        0, 1)
    else:
        v1, v2 = _tail_halves(codes_b, scale_b, min_b, slot, coded, had_ptr, D, BITS, True, DT)
        v = tl.reshape(tl.permute(tl.join(v1, v2), (0, 2, 1)), [v1.shape[0], D])
    return v


@triton.jit
def _tile_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                had_ptr, tkc, tks, tkm, tvc, tvs, tvm, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                FAST: tl.constexpr, ROT_V: tl.constexpr, T_K_BITS: tl.constexpr, T_K_ROT: tl.constexpr,
                T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr):
    """The tokens at store slots `slot` (mask tvalid): keys and values at full precision at k_b/v_b (rows of s_tok
    elements), or, for a stream whose buffer is held per token (T_K_BITS / T_V_BITS > 0: the head's codes, scale and
    minimum), decoded in registers (keys: `_tail_halves`, values: `_tail_values`)."""
    m2 = tvalid[:, None]
    rows = slot * s_tok  # [BN]
    if T_K_BITS > 0:
        k1, k2 = _tail_halves(tkc, tks, tkm, slot, tvalid, had_ptr, D, T_K_BITS, T_K_ROT, DT)
    else:
        k1 = _load_rows(k_b + rows, m2, HALF)
        k2 = _load_rows(k_b + rows + HALF, m2, HALF)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    k1, k2 = _rope(k1, k2, pos, freq, FAST)
    s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
    if T_V_BITS > 0:
        v = _tail_values(tvc, tvs, tvm, slot, tvalid, had_ptr, D, T_V_BITS, T_V_ROT, ROT_V, DT)
    else:
        v = _dense_values(v_b, rows, m2, had_ptr, D, HALF, DT, ROT_V)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


@triton.jit
def _buffer_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                  had_ptr, tkc, tks, tkm, tke, tvc, tvs, tvm, tve, stg_b, stg_n, D: tl.constexpr, HALF: tl.constexpr,
                  DT: tl.constexpr, FAST: tl.constexpr, ROT_V: tl.constexpr, T_K_BITS: tl.constexpr,
                  T_K_ROT: tl.constexpr, T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr):
    """Buffer tokens at store slots `slot`: full precision at k_b/v_b (`_dense_block`), or, where a stream's buffer is
    held per token (T_K_BITS / T_V_BITS > 0; `views.CodedTailView`; the kernels pass TAIL_TOKENS-token steps), in two
    steps of the online softmax, each with one kind of tile (two would double its registers): the coded tokens,
    decoded in registers
    (`_tile_block`), then, in blocks that hold any, this step's own tokens (stg_b [stg_n] uint8 flags of the row's
    slots, stg_n = 0 when none is staged), exact from tke/tve (rows of s_tok elements, as k_b/v_b) as full-precision
    tokens."""
    if T_K_BITS + T_V_BITS == 0:
        m_i, l_i, acc = _dense_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window,
                                     m_i, l_i, acc, had_ptr, D, HALF, DT, FAST, ROT_V)
    else:
        staged = tl.load(stg_b + slot, mask=tvalid & (slot < stg_n), other=0) != 0
        m_i, l_i, acc = _tile_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid & (staged == 0), pos_b, freq, limit,
                                    mvalid, window, m_i, l_i, acc, had_ptr, tkc, tks, tkm, tvc, tvs, tvm, D, HALF, DT,
                                    FAST, ROT_V, T_K_BITS, T_K_ROT, T_V_BITS, T_V_ROT)
        if tl.max(staged.to(tl.int32), axis=0) > 0:
            if T_K_BITS > 0:
                k_exact = tke
            else:
                k_exact = k_b
            if T_V_BITS > 0:
                v_exact = tve
            else:
                v_exact = v_b
            m_i, l_i, acc = _dense_block(q1, q2, k_exact, v_exact, s_tok, t, slot, staged, pos_b, freq, limit,
                                         mvalid, window, m_i, l_i, acc, had_ptr, D, HALF, DT, FAST, ROT_V)
    return m_i, l_i, acc


@triton.jit
def _buffer_blocks(lo, hi, e3, s_len, p_len, c_cnt, f_len, q1, q2, buf_k, buf_v, pos_b, freq, limit, mvalid, window,
                   m_i, l_i, acc, had_ptr, tkc, tks, tkm, tke, tvc, tvs, tvm, tve, stg_b, stg_n, vshift,
                   D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr,
                   FAST: tl.constexpr, ROT_V: tl.constexpr, T_K_BITS: tl.constexpr, T_K_ROT: tl.constexpr,
                   T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr):
    """This split's buffer blocks [max(lo, e3), hi) (`_buffer_block`): the row's f_len buffer tokens (rows of D
    elements) follow its s_len sink, p_len prompt-chunk and c_cnt x NB decode-chunk tokens. A buffer held per token
    is attended in TAIL_TOKENS-token steps (its tiles decoded in registers set the kernel's register peak), a
    full-precision one in BN-token blocks. vshift: the value buffer's slot of the first buffer token (NB when the
    row's newest chunk of values is held at its front, else 0); the staged flags stg_b are then the values' (the
    same tokens are staged in both streams, vshift slots apart)."""
    TAIL_BN: tl.constexpr = TAIL_TOKENS if (T_K_BITS + T_V_BITS > 0) and BN > TAIL_TOKENS else BN
    f_offs = tl.arange(0, TAIL_BN)
    buf_v = buf_v + vshift * D
    tvc = tvc + vshift * (D * T_V_BITS // 8)
    tvs = tvs + vshift
    tvm = tvm + vshift
    tve = tve + vshift * D
    stg_b = stg_b + vshift
    stg_n = stg_n - vshift
    for blk in range(tl.maximum(lo, e3), hi):
        for sub in range(0, BN // TAIL_BN):
            slot = (blk - e3) * BN + sub * TAIL_BN + f_offs
            tvalid = slot < f_len
            t = s_len + p_len + c_cnt * NB + slot
            m_i, l_i, acc = _buffer_block(
                q1, q2, buf_k, buf_v, D, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                had_ptr, tkc, tks, tkm, tke, tvc, tvs, tvm, tve, stg_b, stg_n, D, HALF, DT, FAST, ROT_V, T_K_BITS,
                T_K_ROT, T_V_BITS, T_V_ROT)
    return m_i, l_i, acc


@triton.jit
def _blocks_before(t_min, start, length, BN: tl.constexpr):
    """How many BN-token blocks of the segment [start, start+length) end at or before token t_min."""
    n = tl.cdiv(length, BN)
    return tl.where(t_min >= start + length, n, tl.minimum(tl.maximum(t_min - start, 0) // BN, n))


@triton.jit
def _row_blocks(rows_ptr, b, BN: tl.constexpr, NB: tl.constexpr):
    """A row's segment lengths (sink, prompt chunk, decode chunks, buffer: rows_ptr [B, 4]) and its BN-token blocks'
    segment ends: (s_len, p_len, c_cnt, f_len, e1, e2, e3, total); decode chunks are NB tokens each."""
    s_len = tl.load(rows_ptr + b * 4 + 0)
    p_len = tl.load(rows_ptr + b * 4 + 1)
    c_cnt = tl.load(rows_ptr + b * 4 + 2)
    f_len = tl.load(rows_ptr + b * 4 + 3)
    e1 = tl.cdiv(s_len, BN)
    e2 = e1 + tl.cdiv(p_len, BN)
    e3 = e2 + c_cnt * (NB // BN)
    return s_len, p_len, c_cnt, f_len, e1, e2, e3, e3 + tl.cdiv(f_len, BN)


@triton.jit
def _query_tile(q_ptr, b64, sqb, sqh, sqq, kvh, mt, q_scale, G: tl.constexpr, QL: tl.constexpr,
                HALF: tl.constexpr):
    """The program's 16 query rows (GQA group x query length, tile mt) as two float32 halves [16, HALF], scaled:
    (mvalid, qi, h_offs, q_rows [16] pointers, q1, q2). The softmax scale (log2 units) and the rotary
    attention_scaling are folded into the query once: q·(a R k)·s = (a s q)·(R k), so neither is applied per key
    element or per score."""
    m_offs = mt * 16 + tl.arange(0, 16)
    mvalid = m_offs < G * QL
    g = m_offs // QL
    qi = m_offs % QL
    h_offs = tl.arange(0, HALF)
    q_rows = q_ptr + b64 * sqb + (kvh * G + g) * sqh + qi * sqq
    q1 = tl.load(q_rows[:, None] + h_offs[None, :], mask=mvalid[:, None], other=0.0).to(tl.float32) * q_scale
    q2 = tl.load(q_rows[:, None] + HALF + h_offs[None, :], mask=mvalid[:, None], other=0.0).to(tl.float32) * q_scale
    return mvalid, qi, h_offs, q_rows, q1, q2


@triton.jit
def _split_blocks(limit, mvalid, window, s_len, p_len, c_cnt, f_len, total, split, NSPLIT, BN: tl.constexpr,
                  NB: tl.constexpr):
    """This split's blocks [lo, hi) of the row's `total`. Sliding window: blocks that end before the earliest visible
    token of every query are skipped (not just masked), and the splits share only the blocks that remain."""
    first = s_len * 0  # an int32 scalar, like the value the window branch gives it
    if window > 0:
        lowest = tl.min(tl.where(mvalid & (limit >= 0), limit, 2147483647), axis=0)
        t_min = tl.maximum(lowest - window + 1, 0)
        first = _blocks_before(t_min, 0, s_len, BN) + _blocks_before(t_min, s_len, p_len, BN) \
            + _blocks_before(t_min, s_len + p_len, c_cnt * NB, BN) \
            + _blocks_before(t_min, s_len + p_len + c_cnt * NB, f_len, BN)
    per = tl.cdiv(total - first, NSPLIT)
    lo = first + split * per
    return lo, tl.minimum(lo + per, total)
