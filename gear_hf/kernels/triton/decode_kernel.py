"""The fused decode kernel (one program per row, KV head, 16-row query tile and split) and the kernel merging its
splits (see gear_hf.kernels.triton for what they compute)."""

from __future__ import annotations

import triton
import triton.language as tl

from .buffer_tiles import _buffer_blocks, _dense_block, _held_chunk_blocks
from .ops import _lowrank_bt
from .tiles import _compressed_block, _query_tile, _row_blocks, _split_blocks

# Integer arguments whose values move during generation (lengths, splits, strides of storage that grows):
# never specialized on (a value of 1 or a new divisibility by 16 would otherwise compile a new kernel).
_MAIN_DYNAMIC = ["sqb", "sqh", "sqq", "spos", "window", "s_sink_h", "s_buf_kh", "s_buf_vh",
                 "s_pkc", "s_pks", "s_pka", "s_pkb", "p_tiles", "p_seg",
                 "s_pvc", "s_pvs", "s_pvsp", "s_pva", "s_pvb",
                 "s_dkc", "s_dks", "s_dka", "s_dkb", "d_seg", "s_dow", "s_dot", "s_pow", "s_pot",
                 "s_dvc", "s_dvs", "s_dvsp", "s_dva", "s_dvb", "H_KV", "M_TILES", "NSPLIT",
                 "s_pkas", "s_pvas", "s_dkas", "s_dvas", "s_pkw", "s_dkw",
                 "s_tkc", "s_tks", "s_tke", "s_tvc", "s_tvs", "s_tve", "s_stg", "stg_n", "s_tka",
                 "s_tva"]


@triton.jit(do_not_specialize=_MAIN_DYNAMIC)
def _decode_attention_kernel(
    q_ptr, sqb, sqh, sqq, lim_ptr, rows_ptr, pos_ptr, spos, freq_ptr, attn_scale, sm_scale, window,
    sink_k, sink_v, s_sink_h, buf_k, buf_v, s_buf_kh, s_buf_vh,
    # a buffer held per token (T_K_BITS / T_V_BITS > 0, `buffer_tiles._buffer_block`): codes, scale, minimum, the step's
    # exact tokens; which they are (per row: stg [B, stg_n]; stg_n = 0: none staged); else placeholders
    tkc, tks, tkm, tke, s_tkc, s_tks, s_tke, tvc, tvs, tvm, tve, s_tvc, s_tvs, s_tve, stg, s_stg, stg_n,
    # centered buffers (T_K_AFF / T_V_AFF): per channel scale and center [B,H,2,D] float32 (values': in the basis ROT_V
    # attends them in), else placeholders
    tka, s_tka, tva, s_tva,
    # prompt chunk: keys (codes, scale, min, A, B) + sorted outliers (where, value, tile offsets), values
    pkc, pks, pkm, pka, pkb, s_pkc, s_pks, s_pka, s_pkb, pow_, pov, pot, s_pow, s_pot, p_tiles, p_seg,
    pkas, pkbs, s_pkas,  # int8 factors: per-column scales of A and B (unused with 16-bit factors)
    pkw, s_pkw,  # key widths per channel [B,H,chunks,D] (P_K_PLANES), else a placeholder
    pvc, pvs, pvm, pvsv, pvsi, pva, pvb, s_pvc, s_pvs, s_pvsp, s_pva, s_pvb, pvas, pvbs, s_pvas,
    # decode chunks
    dkc, dks, dkm, dka, dkb, s_dkc, s_dks, s_dka, s_dkb, dow, dov, dot_, s_dow, s_dot, d_seg, dkas, dkbs, s_dkas,
    dkw, s_dkw,
    dvc, dvs, dvm, dvsv, dvsi, dva, dvb, s_dvc, s_dvs, s_dvsp, s_dva, s_dvb, dvas, dvbs, s_dvas,
    had_ptr,  # [D/2, D/2] Sylvester matrix in the dot dtype (rotated storage), else a placeholder
    acc_ptr, ml_ptr, H_KV, M_TILES, NSPLIT,
    G: tl.constexpr, QL: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, HAS_SINK: tl.constexpr,
    ROT_K: tl.constexpr, ROT_V: tl.constexpr,
    T_K_BITS: tl.constexpr, T_K_ROT: tl.constexpr, T_V_BITS: tl.constexpr, T_V_ROT: tl.constexpr,
    T_K_AFF: tl.constexpr, T_V_AFF: tl.constexpr,
    P_K_BITS: tl.constexpr, P_K_UNIT: tl.constexpr, P_K_GROUP: tl.constexpr, P_K_R: tl.constexpr,
    P_K_SPARSE: tl.constexpr, P_K_STATS_ROW: tl.constexpr, P_K_PLANES: tl.constexpr, P_K_ROW: tl.constexpr,
    P_V_BITS: tl.constexpr, P_V_UNIT: tl.constexpr,
    P_V_GROUP: tl.constexpr, P_V_R: tl.constexpr, P_V_K2: tl.constexpr, P_V_CODES_W: tl.constexpr,
    P_V_STATS_W: tl.constexpr, P_V_BY_CHANNEL: tl.constexpr, P_V_STATS_ROW: tl.constexpr,
    D_K_BITS: tl.constexpr, D_K_UNIT: tl.constexpr, D_K_GROUP: tl.constexpr, D_K_R: tl.constexpr,
    D_K_SPARSE: tl.constexpr, D_K_STATS_ROW: tl.constexpr, D_K_PLANES: tl.constexpr, D_K_ROW: tl.constexpr,
    D_V_BITS: tl.constexpr, D_V_UNIT: tl.constexpr,
    D_V_GROUP: tl.constexpr, D_V_R: tl.constexpr, D_V_K2: tl.constexpr, D_V_CODES_W: tl.constexpr,
    D_V_STATS_W: tl.constexpr, D_V_BY_CHANNEL: tl.constexpr, D_V_STATS_ROW: tl.constexpr,
    HELD_V: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = pid // M_TILES
    mt = pid % M_TILES
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    b64 = b.to(tl.int64)
    bh64 = b64 * H_KV + kvh
    PER_CHUNK: tl.constexpr = NB // BN
    s_len, p_len, c_cnt, f_len, e1, e2, e3, total = _row_blocks(rows_ptr, b, BN, NB)
    q_scale = attn_scale * sm_scale
    mvalid, qi, h_offs, q_rows, q1, q2 = _query_tile(q_ptr, b64, sqb, sqh, sqq, kvh, mt, q_scale, G, QL, HALF)
    freq = tl.load(freq_ptr + h_offs)
    limit = tl.load(lim_ptr + b * QL + qi, mask=mvalid, other=-1)

    lo, hi = _split_blocks(limit, mvalid, window, s_len, p_len, c_cnt, f_len, total, split, NSPLIT, BN, NB)
    n_offs = tl.arange(0, BN)
    pos_b = pos_ptr + b64 * spos

    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, D], tl.float32)

    if HAS_SINK:
        for blk in range(lo, tl.minimum(hi, e1)):
            slot = blk * BN + n_offs
            tvalid = slot < s_len
            m_i, l_i, acc = _dense_block(q1, q2, sink_k + bh64 * s_sink_h, sink_v + bh64 * s_sink_h, D, slot,
                                         slot, tvalid, pos_b, freq, limit, mvalid,
                                         window, m_i, l_i, acc, had_ptr, D, HALF, DT, FAST, ROT_V)

    if P_K_BITS > 0:
        # the prompt chunk's Bᵀ (keys: two halves, values) is the same for every block: loaded once
        pkbt1 = _lowrank_bt(pkb + bh64 * s_pkb, P_K_R, h_offs, pkas + bh64 * s_pkas, pkbs + bh64 * s_pkas, 0, P_K_R, DT)
        pkbt2 = _lowrank_bt(pkb + bh64 * s_pkb, P_K_R, h_offs + HALF, pkas + bh64 * s_pkas, pkbs + bh64 * s_pkas, 0,
                            P_K_R, DT)
        pvbt = _lowrank_bt(pvb + bh64 * s_pvb, P_V_R, tl.arange(0, D), pvas + bh64 * s_pvas, pvbs + bh64 * s_pvas, 0,
                           P_V_R, DT)
        for blk in range(tl.maximum(lo, e1), tl.minimum(hi, e2)):
            slot0 = (blk - e1) * BN
            slot = slot0 + n_offs
            tvalid = slot < p_len
            t = s_len + slot
            m_i, l_i, acc = _compressed_block(
                q1, q2, q_rows, t, slot, slot0, p_len, tvalid, slot0, pos_b, freq_ptr, freq, q_scale, limit,
                mvalid, window, m_i, l_i, acc,
                pkc + bh64 * s_pkc, pks + bh64 * s_pks, pkm + bh64 * s_pks, pka + bh64 * s_pka, P_K_ROW, D, P_K_R,
                pow_ + bh64 * s_pow, pov + bh64 * s_pow, pot + bh64 * s_pot, p_tiles, 0, s_len, pkw + bh64 * s_pkw,
                pvc + bh64 * s_pvc, pvs + bh64 * s_pvs, pvm + bh64 * s_pvs, pvsv + bh64 * s_pvsp,
                pvsi + bh64 * s_pvsp, pva + bh64 * s_pva, P_V_CODES_W, P_V_STATS_W, P_V_K2, P_V_R,
                pkbt1, pkbt2, pvbt, had_ptr,
                D, HALF, BN, DT, FAST, ROT_K, P_K_BITS, P_K_UNIT, P_K_GROUP, P_K_R, P_K_SPARSE, P_K_STATS_ROW,
                P_K_PLANES, P_V_BITS, P_V_UNIT, P_V_GROUP, P_V_R, P_V_K2, P_V_BY_CHANNEL, P_V_STATS_ROW)

    if D_K_BITS > 0:
        # chunk by chunk: each chunk's Bᵀ (keys: two halves, values) is loaded once for its NB/BN blocks
        d_lo = tl.maximum(lo, e2)
        d_hi = tl.minimum(hi, e3)
        if HELD_V:  # the row's newest chunk: its values are at the value buffer's front (after this loop)
            d_hi = tl.minimum(d_hi, e3 - PER_CHUNK)
        for chunk in range((d_lo - e2) // PER_CHUNK, tl.cdiv(d_hi - e2, PER_CHUNK)):
            if D_K_R > 0:
                dkbt1 = _lowrank_bt(dkb + bh64 * s_dkb, D_K_R, chunk * D + h_offs, dkas + bh64 * s_dkas,
                                    dkbs + bh64 * s_dkas, chunk, D_K_R, DT)
                dkbt2 = _lowrank_bt(dkb + bh64 * s_dkb, D_K_R, chunk * D + HALF + h_offs, dkas + bh64 * s_dkas,
                                    dkbs + bh64 * s_dkas, chunk, D_K_R, DT)
            else:
                dkbt1 = 0
                dkbt2 = 0
            if D_V_R > 0:
                dvbt = _lowrank_bt(dvb + bh64 * s_dvb, D_V_R, chunk * D + tl.arange(0, D), dvas + bh64 * s_dvas,
                                   dvbs + bh64 * s_dvas, chunk, D_V_R, DT)
            else:
                dvbt = 0
            first_blk = e2 + chunk * PER_CHUNK
            for blk in range(tl.maximum(d_lo, first_blk), tl.minimum(d_hi, first_blk + PER_CHUNK)):
                j = blk - e2
                slot0 = j * BN  # decode chunks are contiguous along the store's slot axis
                slot = slot0 + n_offs
                tvalid = slot < c_cnt * NB
                t = s_len + p_len + slot
                m_i, l_i, acc = _compressed_block(
                    q1, q2, q_rows, t, slot, slot0, c_cnt * NB, tvalid, slot0 - chunk * NB, pos_b, freq_ptr,
                    freq, q_scale, limit, mvalid, window, m_i, l_i, acc,
                    dkc + bh64 * s_dkc, dks + bh64 * s_dks, dkm + bh64 * s_dks, dka + bh64 * s_dka, D_K_ROW, D,
                    D_K_R, dow + bh64 * s_dow, dov + bh64 * s_dow, dot_ + bh64 * s_dot + chunk * (NB // 16 + 1),
                    NB // 16, chunk * d_seg, s_len + p_len + chunk * NB, dkw + bh64 * s_dkw + chunk * D,
                    dvc + bh64 * s_dvc, dvs + bh64 * s_dvs, dvm + bh64 * s_dvs, dvsv + bh64 * s_dvsp,
                    dvsi + bh64 * s_dvsp, dva + bh64 * s_dva, D_V_CODES_W, D_V_STATS_W, D_V_K2, D_V_R,
                    dkbt1, dkbt2, dvbt, had_ptr, D, HALF, BN, DT, FAST, ROT_K, D_K_BITS, D_K_UNIT, D_K_GROUP,
                    D_K_R, D_K_SPARSE, D_K_STATS_ROW, D_K_PLANES, D_V_BITS, D_V_UNIT, D_V_GROUP, D_V_R, D_V_K2,
                    D_V_BY_CHANNEL, D_V_STATS_ROW)

        if HELD_V:
            m_i, l_i, acc = _held_chunk_blocks(
                lo, hi, e2, e3, s_len, p_len, c_cnt, q1, q2, q_rows, pos_b, freq_ptr, freq, q_scale, limit, mvalid,
                window, m_i, l_i, acc, dkc + bh64 * s_dkc, dks + bh64 * s_dks, dkm + bh64 * s_dks, dka + bh64 * s_dka,
                dkb + bh64 * s_dkb, dow + bh64 * s_dow, dov + bh64 * s_dow, dot_ + bh64 * s_dot, d_seg,
                dkas + bh64 * s_dkas, dkbs + bh64 * s_dkas, dkw + bh64 * s_dkw, had_ptr,
                buf_v + bh64 * s_buf_vh, tvc + bh64 * s_tvc, tvs + bh64 * s_tvs, tvm + bh64 * s_tvs,
                tva + bh64 * s_tva, tve + bh64 * s_tve, stg + b64 * s_stg, stg_n, D, HALF, BN, NB, DT, FAST, ROT_K,
                D_K_BITS, D_K_UNIT, D_K_GROUP, D_K_R, D_K_SPARSE, D_K_STATS_ROW, D_K_PLANES, D_K_ROW, ROT_V, T_V_BITS,
                T_V_ROT, T_V_AFF)

    m_i, l_i, acc = _buffer_blocks(
        lo, hi, e3, s_len, p_len, c_cnt, f_len, q1, q2, buf_k + bh64 * s_buf_kh, buf_v + bh64 * s_buf_vh, pos_b,
        freq, limit, mvalid, window, m_i, l_i, acc, had_ptr, tkc + bh64 * s_tkc, tks + bh64 * s_tks,
        tkm + bh64 * s_tks, tke + bh64 * s_tke, tka + bh64 * s_tka, tvc + bh64 * s_tvc, tvs + bh64 * s_tvs,
        tvm + bh64 * s_tvs, tva + bh64 * s_tva, tve + bh64 * s_tve, stg + b64 * s_stg, stg_n, HELD_V, D, HALF, BN,
        NB, DT, FAST, ROT_V, T_K_BITS, T_K_ROT, T_V_BITS, T_V_ROT, T_K_AFF, T_V_AFF)

    ws = pid.to(tl.int64) * NSPLIT + split
    r16 = tl.arange(0, 16)
    tl.store(acc_ptr + ws * (16 * D) + r16[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(ml_ptr + ws * 32 + r16, m_i)
    tl.store(ml_ptr + ws * 32 + 16 + r16, l_i)


@triton.jit(do_not_specialize=["sob", "soq", "soh", "H_KV", "M_TILES", "NSPLIT", "s_cb", "s_ch"])
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, sob, soq, soh, H_KV, M_TILES, NSPLIT, had_ptr, center_ptr, s_cb, s_ch,
                    G: tl.constexpr, QL: tl.constexpr, D: tl.constexpr, ROT_V: tl.constexpr,
                    CENTER: tl.constexpr):
    """out[b, qi, kvh*G + g] = merge of the splits' (m, l, acc) for query row m = g*QL + qi. ROT_V: the values
    were attended in the rotated basis, P·(V·H)·H = P·V: un-rotated here, once per output row. CENTER: the values
    were handed centered (`StreamView.center`, float32 [B,H,D] at center_ptr): a row that attends anything takes
    its KV head's center (the weights sum to one)."""
    pid_bh = tl.program_id(0)
    m = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    base = (pid_bh.to(tl.int64) * M_TILES + m // 16) * NSPLIT
    row = m % 16
    d_offs = tl.arange(0, D)
    m_max = float("-inf")
    for sp in range(0, NSPLIT):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (base + sp) * 32 + row))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    num = tl.zeros([D], tl.float32)
    den = 0.0
    for sp in range(0, NSPLIT):
        w = tl.exp2(tl.load(ml_ptr + (base + sp) * 32 + row) - m_safe)
        den += tl.load(ml_ptr + (base + sp) * 32 + 16 + row) * w
        num += tl.load(acc_ptr + (base + sp) * (16 * D) + row * D + d_offs) * w
    out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)  # a row that sees nothing: zeros
    if ROT_V:  # out·H_D = D^-1/2 [(o1 + o2)·S, (o1 - o2)·S] (see _unrotate_halves), as sums over [D/2, D/2] tiles
        HALF: tl.constexpr = D // 2
        r = tl.arange(0, HALF)
        s_half = tl.load(had_ptr + r[:, None] * HALF + r[None, :]).to(tl.float32)
        o = tl.reshape(out, [2, HALF])
        o1 = tl.sum(tl.where(tl.arange(0, 2)[:, None] == 0, o, 0.0), axis=0)
        o2 = tl.sum(tl.where(tl.arange(0, 2)[:, None] == 1, o, 0.0), axis=0)
        norm = 1.0 / tl.sqrt_rn(tl.full([], D, tl.float32))
        u = tl.sum((o1 + o2)[:, None] * s_half, axis=0) * norm
        w = tl.sum((o1 - o2)[:, None] * s_half, axis=0) * norm
        out = tl.reshape(tl.join(u, w).trans(1, 0), [D])
    if CENTER:
        center = tl.load(center_ptr + b.to(tl.int64) * s_cb + kvh * s_ch + d_offs)
        out = tl.where(den > 0.0, out + center, out)
    g = m // QL
    qi = m % QL
    o = out_ptr + b.to(tl.int64) * sob + qi * soq + (kvh * G + g) * soh + d_offs
    tl.store(o, out.to(out_ptr.dtype.element_ty))
