"""Tiles of the fused decode kernel: one block of compressed tokens (keys per channel, values per token or per
channel, key outliers, low-rank terms) or of full-precision tokens (sink, buffer), decoded in registers and fed to
the online softmax."""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import (
    _dot,
    _lowrank_a,
    _lowrank_dot,
    _lowrank_values,
    _rope,
    _sincos,
    _softmax_step,
    _unrotate_halves,
)
from .unpack import _load_rows, _plane_codes, _unpack_3bit_units, _unpack_words

OUTLIERS_PER_STEP = tl.constexpr(32)  # key outliers applied per one-hot dot


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
    if scale_b.dtype.element_ty == tl.uint8:  # (an else below, not code after a return: the compiler generates both)
        sc, mn = _stats8(tl.load(scale_b + offsets, mask=mask, other=0), tl.load(min_b + offsets, mask=mask, other=0),
                         TOP)
    else:
        sc = tl.load(scale_b + offsets, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(min_b + offsets, mask=mask, other=0.0).to(tl.float32)
    return sc, mn


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
