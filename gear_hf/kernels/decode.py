"""Fused GEAR decode attention: attend straight from a `GearCache` layer's compressed storage.

For each (row, KV head) one program (or `num_splits` programs, flash-decoding style) handles every query head
of the GQA group and every new token of the step (M = group * q_len query rows, padded to >= 16 for tl.dot),
and streams over that row's tokens in row-local order

    [ sink (full precision) | prompt chunk | decode chunks of n_b | buffer (full precision) ]

Compressed blocks are decoded in registers, never written back:

* keys (per channel over token groups): unpack the codes along tokens, dequantize with the group's
  scale/minimum, add the low-rank term A·Bᵀ for the block (r outer products, in registers), then rotate
  the pre-RoPE key by its stored position (cos/sin from the rotary module's inv_freq, so llama3/linear/yarn
  scaling is covered, times attention_scaling) and take q·k with tl.dot;
* the key outliers (fixed k per channel over a whole chunk, token index inside the chunk) are applied in a
  small first kernel as exact score terms: an outlier v at (token t, channel j) adds
  v·(q_j cos_tj ± q_{j±d/2} sin_tj) to score t, scattered with atomics into a fp32 [M, tokens] buffer
  that the main kernel adds to its scores (scanning every chunk's outliers per block would cost
  O(tokens·k·d) for the prompt chunk);
* values (per token over channel groups): unpack along channels, dequantize, add the token's outliers,
  accumulate P·V̂ with tl.dot and the low-rank term as (P·A)·Bᵀ (never A·Bᵀ);
* online softmax in float32 (exp2), causal inside the new tokens and the sliding window on row-local indices
  (padding is not stored, so a row's indices are exactly its real tokens); blocks wholly outside the window
  are skipped, not just masked;
* cos/sin: the float32 angle pos*inv_freq (as HF computes it), reduced to [-pi, pi] exactly enough (~1e-6 rad
  at 3e4 rad), then the hardware sin/cos approximations on the GPU (exact ones in the interpreter).

Operands of tl.dot are cast to the model dtype (fp16/bf16: tensor cores) or stay float32 (`ieee`); under the
CPU interpreter bf16 is upcast to float32 (the interpreter computes bf16 dots wrong). Everything else is
float32. Supported: keys axis="channel", values axis="token" (the defaults) and pre_rope=True; the other
combinations use the torch path (see gear_hf.kernels.fused_supported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting

try:  # fast sin/cos approximations (MUFU) for the GPU; the interpreter has no libdevice
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - other triton layouts
    _libdevice = None

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, DT: tl.constexpr):
    if DT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _sincos(ang, FAST: tl.constexpr):
    """(cos, sin) of float32 angles. The angle is first reduced to about [-pi, pi] with 2*pi split as
    6.28125 (8 bits: k*6.28125 is exact for k < 2^16, and so is the subtraction) + 1.9353072e-3, an error of
    ~1e-6 rad at |angle| ~ 3e4; then sin/cos: the hardware approximations on the GPU (abs error ~5e-7 on
    [-pi, pi]) or exact ones in the interpreter. The angle itself is the float32 product pos*inv_freq, as HF
    computes it."""
    k = tl.floor(ang * 0.15915494309189535 + 0.5)
    r = (ang - k * 6.28125) - k * 1.9353071795864769e-3
    if FAST:
        return _libdevice.fast_cosf(r), _libdevice.fast_sinf(r)
    else:
        return tl.cos(r), tl.sin(r)


@triton.jit
def _rope(k1, k2, pos, freq_ptr, attn_scale, HALF: tl.constexpr, FAST: tl.constexpr):
    """HF rotate_half RoPE of a key tile split in halves [BN, HALF] at positions pos [BN]."""
    f = tl.load(freq_ptr + tl.arange(0, HALF))
    ang = pos.to(tl.float32)[:, None] * f[None, :]
    c, s = _sincos(ang, FAST)
    c = c * attn_scale
    s = s * attn_scale
    return k1 * c - k2 * s, k2 * c + k1 * s


@triton.jit
def _key_half(codes_b, scale_b, min_b, a_b, bm_b, s_codes, s_scale, s_a, s_bm, slot, tvalid, chunk, ch,
              D: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr):
    """Keys (axis="channel") at store slots `slot` [BN] and channels `ch` [C]: D̂ + A·Bᵀ in float32 [BN, C]."""
    m2 = tvalid[:, None]
    byte = tl.load(codes_b + (slot // CPB)[:, None] * s_codes + ch[None, :], mask=m2, other=0).to(tl.int32)
    code = (byte >> ((slot % CPB) * BITS)[:, None]) & ((1 << BITS) - 1)
    srow = (slot // GROUP)[:, None] * s_scale + ch[None, :]
    sc = tl.load(scale_b + srow, mask=m2, other=0.0).to(tl.float32)
    mn = tl.load(min_b + srow, mask=m2, other=0.0).to(tl.float32)
    k = code.to(tl.float32) * sc + mn
    for r in tl.static_range(R):
        a = tl.load(a_b + slot * s_a + r, mask=tvalid, other=0.0).to(tl.float32)
        bb = tl.load(bm_b + (chunk * D + ch) * s_bm + r).to(tl.float32)
        k += a[:, None] * bb[None, :]
    return k


@triton.jit
def _value_tile(codes_b, scale_b, min_b, spv_b, spi_b, s_codes, s_scale, s_sp, slot, tvalid,
                D: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr, GROUP: tl.constexpr, K2: tl.constexpr):
    """Values (axis="token") at store slots `slot` [BN], all channels: D̂ + S in float32 [BN, D]."""
    c = tl.arange(0, D)
    m2 = tvalid[:, None]
    byte = tl.load(codes_b + slot[:, None] * s_codes + (c // CPB)[None, :], mask=m2, other=0).to(tl.int32)
    code = (byte >> ((c % CPB) * BITS)[None, :]) & ((1 << BITS) - 1)
    srow = slot[:, None] * s_scale + (c // GROUP)[None, :]
    sc = tl.load(scale_b + srow, mask=m2, other=0.0).to(tl.float32)
    mn = tl.load(min_b + srow, mask=m2, other=0.0).to(tl.float32)
    v = code.to(tl.float32) * sc + mn
    for s in tl.static_range(K2):
        idx = tl.load(spi_b + slot * s_sp + s, mask=tvalid, other=-1).to(tl.int32)
        val = tl.load(spv_b + slot * s_sp + s, mask=tvalid, other=0.0).to(tl.float32)
        v += tl.where(idx[:, None] == c[None, :], val[:, None], 0.0)
    return v


@triton.jit
def _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT: tl.constexpr):
    """One online-softmax step: s [M, BN] (log2 units), t [BN] row-local key indices."""
    vis = mvalid[:, None] & tvalid[None, :] & (t[None, :] <= limit[:, None])
    if window > 0:
        vis = vis & ((limit[:, None] - t[None, :]) < window)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p, v, DT)
    return m_new, l_i, acc, p


@triton.jit
def _lowrank_values(acc, p, a_b, bm_b, s_a, s_bm, slot, tvalid, chunk, D: tl.constexpr, R: tl.constexpr):
    """acc += (P·A)·Bᵀ for the block: R small outer products, A·Bᵀ never formed."""
    c = tl.arange(0, D)
    for r in tl.static_range(R):
        a = tl.load(a_b + slot * s_a + r, mask=tvalid, other=0.0).to(tl.float32)
        pa = tl.sum(p * a[None, :], axis=1)  # [M]
        bb = tl.load(bm_b + (chunk * D + c) * s_bm + r).to(tl.float32)
        acc += pa[:, None] * bb[None, :]
    return acc


@triton.jit
def _compressed_block(
    q1, q2, t, slot, tvalid, chunk, pos_b, freq_ptr, attn_scale, sm_scale, limit, mvalid, window,
    m_i, l_i, acc, corr_b, s_corr_m, corr_col,
    kc, ks, km, ka, kb, s_kc, s_ks, s_ka, s_kb,
    vc, vs, vm, vsv, vsi, va, vb, s_vc, s_vs, s_vsp, s_va, s_vb,
    D: tl.constexpr, HALF: tl.constexpr, M_PAD: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr,
    K_BITS: tl.constexpr, K_CPB: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_SPARSE: tl.constexpr,
    V_BITS: tl.constexpr, V_CPB: tl.constexpr, V_GROUP: tl.constexpr, V_R: tl.constexpr, V_K2: tl.constexpr,
):
    h_offs = tl.arange(0, HALF)
    k1 = _key_half(kc, ks, km, ka, kb, s_kc, s_ks, s_ka, s_kb, slot, tvalid, chunk, h_offs,
                   D, K_BITS, K_CPB, K_GROUP, K_R)
    k2 = _key_half(kc, ks, km, ka, kb, s_kc, s_ks, s_ka, s_kb, slot, tvalid, chunk, h_offs + HALF,
                   D, K_BITS, K_CPB, K_GROUP, K_R)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    k1, k2 = _rope(k1, k2, pos, freq_ptr, attn_scale, HALF, FAST)
    s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
    if K_SPARSE:
        m_offs = tl.arange(0, M_PAD)
        s += tl.load(corr_b + m_offs[:, None] * s_corr_m + corr_col[None, :],
                     mask=mvalid[:, None] & tvalid[None, :], other=0.0)
    s = s * sm_scale
    v = _value_tile(vc, vs, vm, vsv, vsi, s_vc, s_vs, s_vsp, slot, tvalid, D, V_BITS, V_CPB, V_GROUP, V_K2)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    acc = _lowrank_values(acc, p, va, vb, s_va, s_vb, slot, tvalid, chunk, D, V_R)
    return m_i, l_i, acc


@triton.jit
def _dense_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq_ptr, attn_scale, sm_scale, limit,
                 mvalid, window, m_i, l_i, acc, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                 FAST: tl.constexpr):
    """Full-precision tokens (sink or buffer) at store slots `slot`."""
    h_offs = tl.arange(0, HALF)
    m2 = tvalid[:, None]
    rows = slot[:, None] * s_tok
    k1 = tl.load(k_b + rows + h_offs[None, :], mask=m2, other=0.0).to(tl.float32)
    k2 = tl.load(k_b + rows + HALF + h_offs[None, :], mask=m2, other=0.0).to(tl.float32)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    k1, k2 = _rope(k1, k2, pos, freq_ptr, attn_scale, HALF, FAST)
    s = (_dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)) * sm_scale
    v = tl.load(v_b + rows + tl.arange(0, D)[None, :], mask=m2, other=0.0)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _key_outlier_scores_kernel(
    q_ptr, sqb, sqh, sqq, rows_ptr, pos_ptr, spos, freq_ptr, attn_scale,
    spv_ptr, spi_ptr, s_sp_h, corr_ptr, s_corr_bh, s_corr_m,
    n_slot_rows, chunk_len, k2, H_KV,
    G: tl.constexpr, QL: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, SB: tl.constexpr,
    IS_PROMPT: tl.constexpr, FAST: tl.constexpr,
):
    """corr[b, kvh, m, t - sink_len] += q_m · RoPE_t(S_k) for every key outlier of one chunk store."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    s_len = tl.load(rows_ptr + b * 4 + 0)
    p_len = tl.load(rows_ptr + b * 4 + 1)
    c_cnt = tl.load(rows_ptr + b * 4 + 2)
    if IS_PROMPT:
        n_chunks = (p_len > 0).to(tl.int32)
        base = s_len
    else:
        n_chunks = c_cnt
        base = s_len + p_len
    j = pid_s * SB + tl.arange(0, SB)
    chunk = j // k2
    rvalid = (j < n_slot_rows) & (chunk < n_chunks)
    d_offs = tl.arange(0, D)
    off = (b.to(tl.int64) * H_KV + kvh) * s_sp_h + j[:, None] * D + d_offs[None, :]
    m2 = rvalid[:, None]
    idx = tl.load(spi_ptr + off, mask=m2, other=0).to(tl.int32)
    val = tl.load(spv_ptr + off, mask=m2, other=0.0).to(tl.float32)
    ok = m2 & (val != 0.0)
    tok = base + chunk[:, None] * chunk_len + idx  # row-local token index
    pos = tl.load(pos_ptr + b.to(tl.int64) * spos + tok, mask=ok, other=0).to(tl.float32)
    f = tl.load(freq_ptr + (d_offs % HALF))
    ang = pos * f[None, :]
    cos, sin = _sincos(ang, FAST)
    cos = cos * attn_scale
    sin = sin * attn_scale
    partner = (d_offs + HALF) % D
    sign = tl.where(d_offs < HALF, 1.0, -1.0)
    corr_b = corr_ptr + (b.to(tl.int64) * H_KV + kvh) * s_corr_bh + (tok - s_len)
    for m in range(0, G * QL):
        g = m // QL
        qi = m % QL
        q_row = q_ptr + b.to(tl.int64) * sqb + (kvh * G + g) * sqh + qi * sqq
        qv = tl.load(q_row + d_offs).to(tl.float32)
        qp = tl.load(q_row + partner).to(tl.float32) * sign
        contrib = val * (qv[None, :] * cos + qp[None, :] * sin)
        tl.atomic_add(corr_b + m * s_corr_m, contrib, mask=ok)


@triton.jit
def _blocks_before(t_min, start, length, BN: tl.constexpr):
    """How many BN-token blocks of the segment [start, start+length) end at or before token t_min."""
    n = tl.cdiv(length, BN)
    return tl.where(t_min >= start + length, n, tl.minimum(tl.maximum(t_min - start, 0) // BN, n))


@triton.jit
def _decode_attention_kernel(
    q_ptr, sqb, sqh, sqq, lim_ptr, rows_ptr, pos_ptr, spos, freq_ptr, attn_scale, sm_scale, window,
    sink_k, sink_v, s_sink_h, buf_k, buf_v, s_buf_h,
    # prompt chunk store: keys (codes, scale, min, A, B), values (codes, scale, min, sparse val/idx, A, B)
    pkc, pks, pkm, pka, pkb, s_pkc, s_pks, s_pka, s_pkb,
    pvc, pvs, pvm, pvsv, pvsi, pva, pvb, s_pvc, s_pvs, s_pvsp, s_pva, s_pvb,
    # decode chunk store
    dkc, dks, dkm, dka, dkb, s_dkc, s_dks, s_dka, s_dkb,
    dvc, dvs, dvm, dvsv, dvsi, dva, dvb, s_dvc, s_dvs, s_dvsp, s_dva, s_dvb,
    corr_ptr, s_corr_bh, s_corr_m,
    acc_ptr, ml_ptr, H_KV, NSPLIT,
    G: tl.constexpr, QL: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, HAS_SINK: tl.constexpr,
    P_K_BITS: tl.constexpr, P_K_CPB: tl.constexpr, P_K_GROUP: tl.constexpr, P_K_R: tl.constexpr,
    P_K_SPARSE: tl.constexpr, P_V_BITS: tl.constexpr, P_V_CPB: tl.constexpr, P_V_GROUP: tl.constexpr,
    P_V_R: tl.constexpr, P_V_K2: tl.constexpr, P_V_CODES_W: tl.constexpr, P_V_STATS_W: tl.constexpr,
    D_K_BITS: tl.constexpr, D_K_CPB: tl.constexpr, D_K_GROUP: tl.constexpr, D_K_R: tl.constexpr,
    D_K_SPARSE: tl.constexpr, D_V_BITS: tl.constexpr, D_V_CPB: tl.constexpr, D_V_GROUP: tl.constexpr,
    D_V_R: tl.constexpr, D_V_K2: tl.constexpr, D_V_CODES_W: tl.constexpr, D_V_STATS_W: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    b64 = b.to(tl.int64)
    bh64 = b64 * H_KV + kvh
    s_len = tl.load(rows_ptr + b * 4 + 0)
    p_len = tl.load(rows_ptr + b * 4 + 1)
    c_cnt = tl.load(rows_ptr + b * 4 + 2)
    f_len = tl.load(rows_ptr + b * 4 + 3)
    PER_CHUNK: tl.constexpr = NB // BN
    nb_sink = tl.cdiv(s_len, BN)
    nb_prompt = tl.cdiv(p_len, BN)
    nb_decode = c_cnt * PER_CHUNK
    nb_buf = tl.cdiv(f_len, BN)
    e1 = nb_sink
    e2 = e1 + nb_prompt
    e3 = e2 + nb_decode
    total = e3 + nb_buf

    m_offs = tl.arange(0, M_PAD)
    mvalid = m_offs < G * QL
    g = m_offs // QL
    qi = m_offs % QL
    h_offs = tl.arange(0, HALF)
    q_rows = q_ptr + b64 * sqb + (kvh * G + g) * sqh + qi * sqq
    q1 = tl.load(q_rows[:, None] + h_offs[None, :], mask=mvalid[:, None], other=0.0)
    q2 = tl.load(q_rows[:, None] + HALF + h_offs[None, :], mask=mvalid[:, None], other=0.0)
    limit = tl.load(lim_ptr + b * QL + qi, mask=mvalid, other=-1)

    # Sliding window: blocks that end before the earliest visible token of every query are skipped (not
    # just masked), and the splits share only the blocks that remain.
    first = s_len * 0  # an int32 scalar, like the value the window branch gives it
    if window > 0:
        lowest = tl.min(tl.where(mvalid & (limit >= 0), limit, 2147483647), axis=0)
        t_min = tl.maximum(lowest - window + 1, 0)
        first = _blocks_before(t_min, 0, s_len, BN) + _blocks_before(t_min, s_len, p_len, BN) \
            + _blocks_before(t_min, s_len + p_len, c_cnt * NB, BN) \
            + _blocks_before(t_min, s_len + p_len + c_cnt * NB, f_len, BN)
    per = tl.cdiv(total - first, NSPLIT)
    lo = first + split * per
    hi = tl.minimum(lo + per, total)
    n_offs = tl.arange(0, BN)
    pos_b = pos_ptr + b64 * spos

    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)

    if HAS_SINK:
        for blk in range(lo, tl.minimum(hi, e1)):
            slot = blk * BN + n_offs
            tvalid = slot < s_len
            m_i, l_i, acc = _dense_block(q1, q2, sink_k + bh64 * s_sink_h, sink_v + bh64 * s_sink_h, D, slot,
                                         slot, tvalid, pos_b, freq_ptr, attn_scale, sm_scale, limit, mvalid,
                                         window, m_i, l_i, acc, D, HALF, DT, FAST)

    corr_b = corr_ptr + bh64 * s_corr_bh
    if P_K_BITS > 0:
        for blk in range(tl.maximum(lo, e1), tl.minimum(hi, e2)):
            slot = (blk - e1) * BN + n_offs
            tvalid = slot < p_len
            t = s_len + slot
            m_i, l_i, acc = _compressed_block(
                q1, q2, t, slot, tvalid, 0, pos_b, freq_ptr, attn_scale, sm_scale, limit, mvalid, window,
                m_i, l_i, acc, corr_b, s_corr_m, slot,
                pkc + bh64 * s_pkc, pks + bh64 * s_pks, pkm + bh64 * s_pks, pka + bh64 * s_pka,
                pkb + bh64 * s_pkb, D, D, P_K_R, P_K_R,
                pvc + bh64 * s_pvc, pvs + bh64 * s_pvs, pvm + bh64 * s_pvs, pvsv + bh64 * s_pvsp,
                pvsi + bh64 * s_pvsp, pva + bh64 * s_pva, pvb + bh64 * s_pvb,
                P_V_CODES_W, P_V_STATS_W, P_V_K2, P_V_R, P_V_R,
                D, HALF, M_PAD, DT, FAST, P_K_BITS, P_K_CPB, P_K_GROUP, P_K_R, P_K_SPARSE,
                P_V_BITS, P_V_CPB, P_V_GROUP, P_V_R, P_V_K2)

    if D_K_BITS > 0:
        for blk in range(tl.maximum(lo, e2), tl.minimum(hi, e3)):
            j = blk - e2
            slot = j * BN + n_offs  # decode chunks are contiguous along the store's slot axis
            tvalid = slot < c_cnt * NB
            chunk = j // PER_CHUNK
            t = s_len + p_len + slot
            m_i, l_i, acc = _compressed_block(
                q1, q2, t, slot, tvalid, chunk, pos_b, freq_ptr, attn_scale, sm_scale, limit, mvalid, window,
                m_i, l_i, acc, corr_b, s_corr_m, p_len + slot,
                dkc + bh64 * s_dkc, dks + bh64 * s_dks, dkm + bh64 * s_dks, dka + bh64 * s_dka,
                dkb + bh64 * s_dkb, D, D, D_K_R, D_K_R,
                dvc + bh64 * s_dvc, dvs + bh64 * s_dvs, dvm + bh64 * s_dvs, dvsv + bh64 * s_dvsp,
                dvsi + bh64 * s_dvsp, dva + bh64 * s_dva, dvb + bh64 * s_dvb,
                D_V_CODES_W, D_V_STATS_W, D_V_K2, D_V_R, D_V_R,
                D, HALF, M_PAD, DT, FAST, D_K_BITS, D_K_CPB, D_K_GROUP, D_K_R, D_K_SPARSE,
                D_V_BITS, D_V_CPB, D_V_GROUP, D_V_R, D_V_K2)

    for blk in range(tl.maximum(lo, e3), hi):
        slot = (blk - e3) * BN + n_offs
        tvalid = slot < f_len
        t = s_len + p_len + c_cnt * NB + slot
        m_i, l_i, acc = _dense_block(q1, q2, buf_k + bh64 * s_buf_h, buf_v + bh64 * s_buf_h, D, t, slot, tvalid,
                                     pos_b, freq_ptr, attn_scale, sm_scale, limit, mvalid, window,
                                     m_i, l_i, acc, D, HALF, DT, FAST)

    ws = pid_bh * NSPLIT + split
    tl.store(acc_ptr + ws.to(tl.int64) * (M_PAD * D) + m_offs[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(ml_ptr + ws.to(tl.int64) * (2 * M_PAD) + m_offs, m_i)
    tl.store(ml_ptr + ws.to(tl.int64) * (2 * M_PAD) + M_PAD + m_offs, l_i)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, sob, soq, soh, H_KV, NSPLIT,
                    G: tl.constexpr, QL: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
                    NS_P2: tl.constexpr):
    """out[b, qi, kvh*G + g] = merge of the splits' (m, l, acc) for query row m = g*QL + qi."""
    pid_bh = tl.program_id(0)
    m = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    sp = tl.arange(0, NS_P2)
    smask = sp < NSPLIT
    ws = pid_bh.to(tl.int64) * NSPLIT + sp
    m_s = tl.load(ml_ptr + ws * (2 * M_PAD) + m, mask=smask, other=float("-inf"))
    l_s = tl.load(ml_ptr + ws * (2 * M_PAD) + M_PAD + m, mask=smask, other=0.0)
    m_max = tl.max(m_s, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_s - m_safe)
    d_offs = tl.arange(0, D)
    a = tl.load(acc_ptr + ws[:, None] * (M_PAD * D) + m * D + d_offs[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(a * w[:, None], axis=0)
    den = tl.sum(l_s * w, axis=0)
    out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)  # a row that sees nothing: zeros
    g = m // QL
    qi = m % QL
    o = out_ptr + b.to(tl.int64) * sob + qi * soq + (kvh * G + g) * soh + d_offs
    tl.store(o, out.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
def _p2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _check(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (GearCache storage always is)")
    return t


class _StoreArgs:
    """Pointers, head strides and constexprs of one ChunkStore (keys or values) for the kernel."""

    def __init__(self, store, dummy: torch.Tensor, head_dim: int, prefix: str, key: bool) -> None:
        self.present = store is not None and bool(getattr(store, "fields", None))
        self.constexprs = {}
        if not self.present:
            self.ptrs = [dummy] * (5 if key else 7)
            self.strides = [0] * (4 if key else 5)
            zero = {"BITS": 0, "CPB": 1, "GROUP": 1, "R": 0}
            zero.update({"SPARSE": False} if key else {"K2": 0, "CODES_W": 1, "STATS_W": 1})
            self.constexprs = {f"{prefix}_{k}": v for k, v in zero.items()}
            self.k2 = 0
            return
        f = {name: _check(t, f"{prefix}.{name}") for name, t in store.fields.items()}
        spec = store.spec
        group = spec.group_for(store.chunk_len, head_dim)
        rank = f["lowrank_a"].shape[-1]
        if key:
            if spec.axis != "channel":
                raise NotImplementedError("fused kernel: keys must be stored per channel (key_axis='channel')")
            self.ptrs = [f["codes"], f["scale"], f["minimum"], f["lowrank_a"], f["lowrank_b"]]
            self.strides = [f["codes"].stride(1), f["scale"].stride(1), f["lowrank_a"].stride(1),
                            f["lowrank_b"].stride(1)]
            self.k2 = store.extent["sparse_values"]  # 2k slots per chunk
            self.constexprs = {f"{prefix}_BITS": spec.bits, f"{prefix}_CPB": 8 // spec.bits,
                               f"{prefix}_GROUP": group, f"{prefix}_R": rank, f"{prefix}_SPARSE": self.k2 > 0}
            self.sparse = (f["sparse_values"], f["sparse_index"])
        else:
            if spec.axis != "token":
                raise NotImplementedError("fused kernel: values must be stored per token (value_axis='token')")
            self.ptrs = [f["codes"], f["scale"], f["minimum"], f["sparse_values"], f["sparse_index"],
                         f["lowrank_a"], f["lowrank_b"]]
            self.strides = [f["codes"].stride(1), f["scale"].stride(1), f["sparse_values"].stride(1),
                            f["lowrank_a"].stride(1), f["lowrank_b"].stride(1)]
            self.k2 = f["sparse_values"].shape[-1]
            self.constexprs = {f"{prefix}_BITS": spec.bits, f"{prefix}_CPB": 8 // spec.bits,
                               f"{prefix}_GROUP": group, f"{prefix}_R": rank, f"{prefix}_K2": self.k2,
                               f"{prefix}_CODES_W": f["codes"].shape[-1],
                               f"{prefix}_STATS_W": f["scale"].shape[-1]}
        if store.chunk_len % (8 // spec.bits) or (key and group % (8 // spec.bits)):
            raise NotImplementedError(f"fused kernel: chunk of {store.chunk_len} tokens / group {group} does not "
                                      f"align with {8 // spec.bits} codes per byte")


def _launch(kernel, grid, args, kwargs, plan: list | None) -> None:
    """Run kernel[grid](*args, **kwargs), or only record it in `plan` (gear_hf.kernels.compile_check)."""
    if plan is None:
        kernel[grid](*args, **kwargs)
    else:
        plan.append((kernel, grid, args, kwargs))


def _num_splits(max_blocks: int, programs: int, device: torch.device) -> int:
    if max_blocks <= 1:
        return 1
    if device.type != "cuda":
        return min(2, max_blocks)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(programs, 1))
    return max(1, min(want, -(-max_blocks // 4), 64))


def decode_attention(query: torch.Tensor, key_stream, value_stream, *, rows: torch.Tensor, limits: torch.Tensor,
                     positions: torch.Tensor, buffer_size: int, scaling: float, inv_freq: torch.Tensor,
                     attention_scaling: float = 1.0, sliding_window: int | None = None, out: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                     row_lengths: list[list[int]] | None = None, _plan: list | None = None) -> torch.Tensor:
    """Attention of `query` [B,Hq,q,d] (already rotated) over one GearCache layer's streams.

    rows: int32 [B,4] (sink_len, prefill_len, decode_chunks, buffer_len) per row; limits: int32 [B,q], the
    row-local index of each query token (-1: padding, sees nothing); positions: int32 [B, >=tokens] row-local
    positions. row_lengths: the same four per-row numbers as python lists (avoids a device sync; read from
    `rows` when omitted). Returns out [B, q, Hq, d] in query's dtype (HF's attention-function layout).
    _plan: record the launches in this list instead of running them (gear_hf.kernels.compile_check).
    """
    if _plan is None and query.device.type != "cuda" and not interpreting():
        raise RuntimeError("gear_hf fused attention needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "gear_hf.kernels modules are imported (CPU interpreter)")
    B, Hq, QL, D = query.shape
    if D < 32 or D & (D - 1):
        raise NotImplementedError(f"fused kernel: head_dim {D} must be a power of two >= 32")
    buf_k, buf_v = key_stream.buffer.data, value_stream.buffer.data
    Hkv = buf_k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split into {Hkv} KV heads")
    G = Hq // Hkv
    M = G * QL
    M_PAD = max(16, _p2(M))
    HALF = D // 2
    dtype = query.dtype
    if dtype not in _TL:
        raise TypeError(f"fused kernel: query dtype {dtype} (fp16, bf16 or fp32)")
    dot_dt = tl.float32 if (dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())) else _TL[dtype]
    fast = _libdevice is not None and not interpreting()  # hardware sin/cos (the interpreter has none)
    if query.stride(-1) != 1:
        query = query.contiguous()
    _check(buf_k, "buffer keys"), _check(buf_v, "buffer values")

    sink_k = key_stream.sink.data
    has_sink = sink_k is not None
    sink_v = value_stream.sink.data if has_sink else None
    if has_sink:
        _check(sink_k, "sink keys"), _check(sink_v, "sink values")

    pk = _StoreArgs(key_stream.prefill, query, D, "P_K", key=True)
    pv = _StoreArgs(value_stream.prefill, query, D, "P_V", key=False)
    dk = _StoreArgs(key_stream.decode, query, D, "D_K", key=True)
    dv = _StoreArgs(value_stream.decode, query, D, "D_V", key=False)
    if pk.present != pv.present or dk.present != dv.present:
        raise RuntimeError("keys and values of a GearCache layer disagree on which chunks exist")
    NB = buffer_size
    if block_n is None:  # 32-token tiles: no register spills at head_dim 128 with 8 warps (ptxas, sm_90)
        block_n = min(32, NB & -NB) if dk.present else 32
    if block_n < 16 or block_n & (block_n - 1) or (dk.present and NB % block_n):
        raise NotImplementedError(f"fused kernel: a block of {block_n} tokens must be a power of two >= 16 "
                                  f"dividing buffer_size={NB}")

    if row_lengths is None:
        row_lengths = rows.tolist()
    lengths = list(zip(*row_lengths)) if row_lengths else ([], [], [], [])
    sink_l, prompt_l, chunks_l, buf_l = (list(x) for x in lengths)
    max_blocks = max((-(-s // block_n) + -(-p // block_n) + c * (NB // block_n) + -(-f // block_n)
                      for s, p, c, f in zip(sink_l, prompt_l, chunks_l, buf_l)), default=0)

    # Key outliers -> exact score terms (fp32 [B, Hkv, M, compressed tokens]).
    key_sparse = (pk.present and pk.k2 > 0) or (dk.present and dk.k2 > 0)
    freq = inv_freq.to(device=query.device, dtype=torch.float32).contiguous()
    if freq.numel() != HALF:
        raise ValueError(f"inv_freq has {freq.numel()} entries, expected head_dim/2 = {HALF}")
    if key_sparse:
        width = max((p + c * NB for p, c in zip(prompt_l, chunks_l)), default=0)
        corr = torch.zeros(B, Hkv, M, max(width, 1), dtype=torch.float32, device=query.device)
        for args, is_prompt in ((pk, True), (dk, False)):
            if not (args.present and args.k2 > 0):
                continue
            spv, spi = args.sparse
            n_rows = spv.shape[2]
            if not is_prompt:
                n_rows = min(n_rows, max(chunks_l, default=0) * args.k2)
            if n_rows == 0:
                continue
            chunk_len = key_stream.prefill.chunk_len if is_prompt else NB
            sb = max(1, min(_p2(n_rows), 2048 // D))
            grid = (B * Hkv, triton.cdiv(n_rows, sb))
            _launch(_key_outlier_scores_kernel, grid, (
                query, query.stride(0), query.stride(1), query.stride(2), rows, positions, positions.stride(0),
                freq, float(attention_scaling), spv, spi, spv.stride(1), corr, corr.stride(1), corr.stride(2),
                n_rows, chunk_len, args.k2, Hkv),
                dict(G=G, QL=QL, D=D, HALF=HALF, SB=sb, IS_PROMPT=is_prompt, FAST=fast, num_warps=4), _plan)
    else:
        corr = torch.zeros(1, dtype=torch.float32, device=query.device)

    nsplit = num_splits or _num_splits(max_blocks, B * Hkv, query.device)
    nsplit = max(1, min(int(nsplit), 64))
    acc_ws = torch.empty(B * Hkv * nsplit * M_PAD * D, dtype=torch.float32, device=query.device)
    ml_ws = torch.empty(B * Hkv * nsplit * 2 * M_PAD, dtype=torch.float32, device=query.device)
    if out is None:
        out = torch.empty(B, QL, Hq, D, dtype=dtype, device=query.device)
    elif tuple(out.shape) != (B, QL, Hq, D) or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, q, Hq, d] = {(B, QL, Hq, D)} with a contiguous last dim")

    window = int(sliding_window or 0)
    corr_strides = (corr.stride(1), corr.stride(2)) if key_sparse else (0, 0)
    constexprs = {**pk.constexprs, **pv.constexprs, **dk.constexprs, **dv.constexprs}
    if num_warps is None:
        num_warps = 4 if D <= 64 else 8
    grid = (B * Hkv, nsplit)
    _launch(_decode_attention_kernel, grid, (
        query, query.stride(0), query.stride(1), query.stride(2), limits, rows, positions, positions.stride(0),
        freq, float(attention_scaling), float(scaling) * LOG2E, window,
        sink_k if has_sink else query, sink_v if has_sink else query, sink_k.stride(1) if has_sink else 0,
        buf_k, buf_v, buf_k.stride(1),
        *pk.ptrs, *pk.strides, *pv.ptrs, *pv.strides, *dk.ptrs, *dk.strides, *dv.ptrs, *dv.strides,
        corr, corr_strides[0], corr_strides[1],
        acc_ws, ml_ws, Hkv, nsplit),
        dict(G=G, QL=QL, M_PAD=M_PAD, D=D, HALF=HALF, BN=block_n, NB=NB, DT=dot_dt, FAST=fast, HAS_SINK=has_sink,
             **constexprs, num_warps=num_warps), _plan)
    _launch(_combine_kernel, (B * Hkv, M), (acc_ws, ml_ws, out, out.stride(0), out.stride(1), out.stride(2), Hkv,
                                            nsplit), dict(G=G, QL=QL, M_PAD=M_PAD, D=D, NS_P2=_p2(nsplit), num_warps=4),
            _plan)
    return out


def step_meta(cache, query_len: int, device) -> dict:
    """Per-step inputs shared by every layer (memoised on the cache for the current step)."""
    key = (cache.steps, query_len, str(device), id(cache.positions), cache.batch_size_)
    memo = getattr(cache, "_gear_kernels_memo", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    row_lengths = [list(x) for x in zip(cache.sink_len, cache.prefill_len, cache.decode_chunks, cache.buffer_len)]
    rows = torch.tensor(row_lengths, dtype=torch.int32).to(device, non_blocking=True)
    limits = cache.rect_to_local[:, cache.rect_length - query_len: cache.rect_length].to(torch.int32).contiguous()
    positions = cache.positions if cache.positions.dtype == torch.int32 else cache.positions.int()
    meta = {"rows": rows, "limits": limits, "positions": positions.contiguous(), "row_lengths": row_lengths}
    cache._gear_kernels_memo = (key, meta)
    return meta


def cache_decode_attention(cache, layer_idx: int, query: torch.Tensor, *, scaling: float,
                           inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           **launch) -> torch.Tensor:
    """Fused attention of this step's `query` [B,Hq,q,d] over layer `layer_idx` of a GearCache whose step has
    already been stored. Returns [B, q, Hq, d]."""
    layer = cache.layers[layer_idx]
    meta = step_meta(cache, query.shape[2], query.device)
    return decode_attention(query, layer.key_stream, layer.value_stream, rows=meta["rows"], limits=meta["limits"],
                            positions=meta["positions"], buffer_size=cache.gear_config.buffer_size, scaling=scaling,
                            inv_freq=inv_freq, attention_scaling=attention_scaling, sliding_window=sliding_window,
                            out=out, row_lengths=meta["row_lengths"], **launch)
