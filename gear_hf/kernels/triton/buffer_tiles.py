"""Tiles of the fused decode kernel that read the buffer: full-precision tokens (sink, buffer), a buffer held per
token (`views.CodedTailView`, decoded in registers, this step's own tokens exact), and a row's newest decode chunk
whose values are held at the front of the value buffer (`GearConfig.value_buffer_size`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import _dot, _lowrank_bt, _rope, _softmax_step, _unrotate_halves
from .tiles import _compressed_scores, _value_tile
from .unpack import _load_rows, _unpack_words

TAIL_TOKENS = tl.constexpr(16)  # tokens per step of a buffer held per token (`_buffer_block`)
HELD_TOKENS = tl.constexpr(32)  # tokens per step of a held chunk (`_held_chunk_blocks`)


@triton.jit
def _held_block(
    q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale, limit, mvalid,
    window, m_i, l_i, acc,
    kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, kbt1, kbt2, had_ptr,
    buf_v, tvc, tvs, tvm, tva, tve, stg_b, stg_n, vslot,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, ROT_K: tl.constexpr,
    K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_SPARSE: tl.constexpr,
    K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr, ROT_V: tl.constexpr, T_V_BITS: tl.constexpr,
    T_V_ROT: tl.constexpr, T_V_AFF: tl.constexpr,
):
    """One block of a row's newest decode chunk whose values are held (`GearConfig.value_buffer_size`): keys from the
    compressed chunk (`_compressed_scores`), values from the value buffer at its slots `vslot` [BN]: full precision at
    buf_v (rows of D elements), or held per token (T_V_BITS > 0; tvc/tvs/tvm: the head's codes, scale, minimum;
    `_tail_values`; centered: T_V_AFF, tva), a staged one (stg_b [stg_n] flags) exact from tve (rows of D elements)."""
    s = _compressed_scores(q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale,
                           mvalid, kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, kbt1, kbt2,
                           had_ptr, D, HALF, BN, DT, FAST, ROT_K, K_BITS, K_UNIT, K_GROUP, K_R, K_SPARSE,
                           K_STATS_ROW, K_PLANES)
    if T_V_BITS > 0:
        staged = tl.load(stg_b + vslot, mask=tvalid & (vslot < stg_n), other=0) != 0
        v = _tail_values(tvc, tvs, tvm, vslot, tvalid & (staged == 0), had_ptr, D, T_V_BITS, T_V_ROT, ROT_V, DT,
                         tva, T_V_AFF)
        if tl.max(staged.to(tl.int32), axis=0) > 0:  # (masked loads: zeros where a token is coded)
            v += _dense_values(tve, vslot * D, staged[:, None], had_ptr, D, HALF, DT, ROT_V)
    else:
        v = _dense_values(buf_v, vslot * D, tvalid[:, None], had_ptr, D, HALF, DT, ROT_V)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


@triton.jit
def _held_chunk_blocks(
    lo, hi, e2, e3, s_len, p_len, c_cnt, q1, q2, q_rows, pos_b, freq_ptr, freq, q_scale, limit, mvalid, window,
    m_i, l_i, acc,
    dkc, dks, dkm, dka, dkb, dow, dov, dot_, d_seg, dkas, dkbs, dkw, had_ptr, buf_v, tvc, tvs, tvm, tva, tve,
    stg_b, stg_n,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr,
    ROT_K: tl.constexpr, K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr,
    K_SPARSE: tl.constexpr, K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr, K_ROW: tl.constexpr,
    ROT_V: tl.constexpr, T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr, T_V_AFF: tl.constexpr,
):
    """This split's blocks of the row's newest decode chunk (c_cnt - 1, blocks [e3 - NB/BN, e3)) when its values are
    held at the front of the value buffer (`_held_block`); the pointers are the head's (decode keys: the kernel's d*
    arguments; the value buffer (buf_v: full precision, rows of D elements; or held per token) and the values' staged
    flags)."""
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
                    dkw + chunk * D, kbt1, kbt2, had_ptr, buf_v, tvc, tvs, tvm, tva, tve, stg_b, stg_n,
                    slot - chunk * NB, D, HALF, HB, DT, FAST, ROT_K, K_BITS, K_UNIT, K_GROUP, K_R, K_SPARSE,
                    K_STATS_ROW, K_PLANES, ROT_V, T_V_BITS, T_V_ROT, T_V_AFF)
    return m_i, l_i, acc


@triton.jit
def _dense_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit,
                 mvalid, window, m_i, l_i, acc, had_ptr, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                 FAST: tl.constexpr, ROT_V: tl.constexpr):
    """Full-precision tokens (sink or buffer) at store slots `slot`."""
    return _tile_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                       had_ptr, 0, 0, 0, 0, 0, 0, 0, 0, D, HALF, DT, FAST, ROT_V, 0, False, 0, False, False,
                       False)


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
                 ROT: tl.constexpr, DT: tl.constexpr, aff, AFF: tl.constexpr):
    """The coded tokens (mask coded [BN]) at slots `slot` of a buffer held per token (`views.CodedTailView`) as
    halves float32 [BN, D/2]: code * scale + minimum (one scale and minimum per token), times H when ROT (the
    Walsh–Hadamard rotation, its own inverse: codes of x·H back to x, or codes of x to x·H). A half's codes are
    32-bit words of D*BITS/64 bytes (8-bit codes, or 4-bit codes two a byte, the even channel in the low nibble).
    AFF (a centered buffer): then each channel times aff[c] plus aff[D + c] (the head's scales and centers)."""
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
    if AFF:
        c = tl.arange(0, HALF)
        x1 = x1 * tl.load(aff + c)[None, :] + tl.load(aff + D + c)[None, :]
        x2 = x2 * tl.load(aff + HALF + c)[None, :] + tl.load(aff + D + HALF + c)[None, :]
    return x1, x2


@triton.jit
def _tail_values(codes_b, scale_b, min_b, slot, coded, had_ptr, D: tl.constexpr, BITS: tl.constexpr,
                 ROT: tl.constexpr, ROT_V: tl.constexpr, DT: tl.constexpr, aff, AFF: tl.constexpr):
    """Values of the coded tokens (mask coded [BN]) at slots `slot` of a buffer held per token, float32 [BN, D] in
    the basis the kernel attends values in (ROT_V: rotated): as stored when ROT == ROT_V (ROT: codes of v·H; one
    group per token, read as `_value_tile` reads a run of values per token), else turned by halves
    (`_tail_halves`). AFF (a centered value buffer): then each channel times aff[c] plus aff[D + c], given in that
    basis (`views.affine_in_basis`)."""
    if ROT == ROT_V:
        v = _value_tile(codes_b, scale_b, min_b, scale_b, scale_b, D * BITS // 8, 1, 0, slot, coded, D, BITS, 1, D,
                        0, 1)
        if AFF:
            c = tl.arange(0, D)
            v = v * tl.load(aff + c)[None, :] + tl.load(aff + D + c)[None, :]
    else:
        v1, v2 = _tail_halves(codes_b, scale_b, min_b, slot, coded, had_ptr, D, BITS, True, DT, aff, AFF)
        v = tl.reshape(tl.permute(tl.join(v1, v2), (0, 2, 1)), [v1.shape[0], D])
    return v


@triton.jit
def _tile_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                had_ptr, tkc, tks, tkm, tka, tvc, tvs, tvm, tva, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                FAST: tl.constexpr, ROT_V: tl.constexpr, T_K_BITS: tl.constexpr, T_K_ROT: tl.constexpr,
                T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr, T_K_AFF: tl.constexpr, T_V_AFF: tl.constexpr):
    """The tokens at store slots `slot` (mask tvalid): keys and values at full precision at k_b/v_b (rows of s_tok
    elements), or, for a stream whose buffer is held per token (T_K_BITS / T_V_BITS > 0: the head's codes, scale and
    minimum; centered: T_K_AFF / T_V_AFF, tka / tva), decoded in registers (keys: `_tail_halves`, values:
    `_tail_values`)."""
    m2 = tvalid[:, None]
    rows = slot * s_tok  # [BN]
    if T_K_BITS > 0:
        k1, k2 = _tail_halves(tkc, tks, tkm, slot, tvalid, had_ptr, D, T_K_BITS, T_K_ROT, DT, tka, T_K_AFF)
    else:
        k1 = _load_rows(k_b + rows, m2, HALF)
        k2 = _load_rows(k_b + rows + HALF, m2, HALF)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    k1, k2 = _rope(k1, k2, pos, freq, FAST)
    s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
    if T_V_BITS > 0:
        v = _tail_values(tvc, tvs, tvm, slot, tvalid, had_ptr, D, T_V_BITS, T_V_ROT, ROT_V, DT, tva, T_V_AFF)
    else:
        v = _dense_values(v_b, rows, m2, had_ptr, D, HALF, DT, ROT_V)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


@triton.jit
def _buffer_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit, mvalid, window, m_i, l_i, acc,
                  had_ptr, tkc, tks, tkm, tke, tka, tvc, tvs, tvm, tva, tve, stg_b, stg_n, D: tl.constexpr,
                  HALF: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, ROT_V: tl.constexpr,
                  T_K_BITS: tl.constexpr, T_K_ROT: tl.constexpr, T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr,
                  T_K_AFF: tl.constexpr, T_V_AFF: tl.constexpr):
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
                                    mvalid, window, m_i, l_i, acc, had_ptr, tkc, tks, tkm, tka, tvc, tvs, tvm, tva, D,
                                    HALF, DT, FAST, ROT_V, T_K_BITS, T_K_ROT, T_V_BITS, T_V_ROT, T_K_AFF, T_V_AFF)
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
                   m_i, l_i, acc, had_ptr, tkc, tks, tkm, tke, tka, tvc, tvs, tvm, tva, tve, stg_b, stg_n,
                   HELD_V: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                   DT: tl.constexpr, FAST: tl.constexpr, ROT_V: tl.constexpr, T_K_BITS: tl.constexpr,
                   T_K_ROT: tl.constexpr, T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr, T_K_AFF: tl.constexpr,
                   T_V_AFF: tl.constexpr):
    """This split's buffer blocks [max(lo, e3), hi) (`_buffer_block`): the row's f_len buffer tokens (rows of D
    elements) follow its s_len sink, p_len prompt-chunk and c_cnt x NB decode-chunk tokens. A buffer held per token
    is attended in TAIL_TOKENS-token steps (its tiles decoded in registers set the kernel's register peak), a
    full-precision one in BN-token blocks. HELD_V: a row with decode chunks holds its newest chunk of values at the
    front of its value buffer, so its first buffer token is the value buffer's slot NB (vshift); the staged flags
    stg_b are then the values' (the same tokens are staged in both streams, vshift slots apart)."""
    TAIL_BN: tl.constexpr = TAIL_TOKENS if (T_K_BITS + T_V_BITS > 0) and BN > TAIL_TOKENS else BN
    f_offs = tl.arange(0, TAIL_BN)
    vshift = 0
    if HELD_V:
        vshift = tl.where(c_cnt > 0, NB, 0)
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
                had_ptr, tkc, tks, tkm, tke, tka, tvc, tvs, tvm, tva, tve, stg_b, stg_n, D, HALF, DT, FAST, ROT_V,
                T_K_BITS, T_K_ROT, T_V_BITS, T_V_ROT, T_K_AFF, T_V_AFF)
    return m_i, l_i, acc
