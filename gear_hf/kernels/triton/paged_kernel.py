"""Attention over paged GEAR storage (vLLM's KV pages) on the GPU: one program per (request, KV head, tile of 16
query rows) streams over the blocks the request sees, through its block table (see `paged` for the host side).

A block is either a page (one compressed chunk of BS tokens per KV head, its fields at fixed byte offsets), read in
place by the fused decode kernel's tiles (`tiles`, `ops`, `unpack`), or exact (the request's open block in its tail
slot, or a block closing this step in the staging), read as full-precision rows. Key outliers of a page are stored per
channel along tokens ([K, D] values and token indices) and added into the key tile before it is un-rotated and
rotated by RoPE (the oracle's order: D̂ + S + A·Bᵀ, then the Hadamard rotation undone). Online softmax in float32
(exp2), causal per query row; rotated values are attended in the rotated basis and the output un-rotated once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .buffer_tiles import _dense_values
from .ops import _dot, _lowrank_a, _lowrank_bt, _lowrank_values, _rope, _softmax_step, _unrotate_halves
from .tiles import _per_channel_tile, _value_tile
from .unpack import _load_rows

# Integer arguments whose values move from step to step (never specialized on: one compile per format and shape)
_DYNAMIC = ["s_qt", "s_qh", "s_table", "first_closing", "s_ot", "s_oh", "H_KV", "SINKS"]


@triton.jit
def _at(p, byte_offset):
    """The typed pointer p moved by byte_offset (a field of page i: the field of page 0 plus i pages' bytes)."""
    return (p.to(tl.pointer_type(tl.uint8)) + byte_offset).to(p.dtype)


@triton.jit
def _channel_outliers(k, values_b, index_b, slot, ch, D: tl.constexpr, K: tl.constexpr):
    """k [BN, C] plus a chunk's key outliers of channels ch [C] at chunk tokens slot [BN]: K per channel, stored
    [K, D] (value; token index inside the chunk), unused entries 0."""
    for s in tl.static_range(K):
        idx = tl.load(index_b + s * D + ch).to(tl.int32)
        val = tl.load(values_b + s * D + ch).to(tl.float32)
        k = tl.where(slot[:, None] == idx[None, :], k + val[None, :], k)
    return k


@triton.jit
def _exact_blocks(q1, q2, k_b, v_b, row_step, t0, L, limit, mvalid, m_i, l_i, acc, had_ptr, D: tl.constexpr,
                  HALF: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, ROT_V: tl.constexpr):
    """A full-precision block of BS tokens from request token t0 on: keys (after RoPE) and values in rows of D at
    k_b / v_b, row_step elements apart; in steps of BN tokens."""
    for sub in range(0, BS // BN):
        slot = sub * BN + tl.arange(0, BN)
        t = t0 + slot
        tvalid = t < L
        rows = slot * row_step
        m2 = tvalid[:, None]
        k1 = _load_rows(k_b + rows, m2, HALF)
        k2 = _load_rows(k_b + rows + HALF, m2, HALF)
        s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
        v = _dense_values(v_b, rows, m2, had_ptr, D, HALF, DT, ROT_V)
        m_i, l_i, acc, _ = _softmax_step(s, t, tvalid, limit, mvalid, 0, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


@triton.jit
def _page_scores(qp1, qp2, slot, slot0, tvalid, pos, freq, kc, kw, ks, km, ksv, ksi, ka, kbt1, kbt2, had_ptr,
                 D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr,
                 ROPE: tl.constexpr, ROT_K: tl.constexpr, K_BITS: tl.constexpr, K_UNIT: tl.constexpr,
                 K_GROUP: tl.constexpr, K_R: tl.constexpr, K_K: tl.constexpr, K_STATS_ROW: tl.constexpr,
                 K_PLANES: tl.constexpr, K_ROW: tl.constexpr):
    """Scores [16, BN] of the query halves against a page's keys at chunk slots `slot` (pointers: the page's key
    fields; kbt1/kbt2: the page's Bᵀ of each half)."""
    h_offs = tl.arange(0, HALF)
    ka16 = _lowrank_a(ka, K_R, slot, tvalid, K_R, DT) if K_R > 0 else 0
    k1 = _per_channel_tile(kc, ks, km, K_ROW, D, slot, slot0, BS, tvalid, h_offs, 0, ka16, kbt1, kw, K_BITS, K_UNIT,
                           K_GROUP, K_R, K_STATS_ROW, DT, K_PLANES)
    k2 = _per_channel_tile(kc, ks, km, K_ROW, D, slot, slot0, BS, tvalid, h_offs + HALF, HALF, ka16, kbt2, kw, K_BITS,
                           K_UNIT, K_GROUP, K_R, K_STATS_ROW, DT, K_PLANES)
    if K_K > 0:
        k1 = _channel_outliers(k1, ksv, ksi, slot, h_offs, D, K_K)
        k2 = _channel_outliers(k2, ksv, ksi, slot, h_offs + HALF, D, K_K)
    if ROT_K:  # stored keys are k·H: k·H·H = k
        k1, k2 = _unrotate_halves(k1, k2, had_ptr, D, DT)
    if ROPE:  # stored before RoPE: rotated at their positions
        k1, k2 = _rope(k1, k2, pos, freq, FAST)
    return _dot(qp1, tl.trans(k1), DT) + _dot(qp2, tl.trans(k2), DT)


@triton.jit
def _page_block(qp1, qp2, t0, t_lo, L, limit, mvalid, m_i, l_i, acc, freq, had_ptr,
                kc, kw, ks, km, ksv, ksi, ka, kb, kas, kbs, vc, vs, vm, vsv, vsi, va, vb, vas, vbs,
                D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
                FAST: tl.constexpr, ROPE: tl.constexpr, ROT_K: tl.constexpr,
                K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr,
                K_K: tl.constexpr, K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr, K_ROW: tl.constexpr,
                V_BITS: tl.constexpr, V_UNIT: tl.constexpr, V_GROUP: tl.constexpr, V_R: tl.constexpr,
                V_K2: tl.constexpr, V_CODES_W: tl.constexpr, V_STATS_W: tl.constexpr, V_BY_CHANNEL: tl.constexpr,
                V_STATS_ROW: tl.constexpr):
    """One page (its fields' pointers) of BS tokens from request token t0 on, in steps of BN tokens; the request's
    tokens below t_lo are not attended here (exact sinks: the page holds copies)."""
    h_offs = tl.arange(0, HALF)
    n_offs = tl.arange(0, BN)
    if K_R > 0:  # the chunk's Bᵀ, loaded once per page
        kbt1 = _lowrank_bt(kb, K_R, h_offs, kas, kbs, 0, K_R, DT)
        kbt2 = _lowrank_bt(kb, K_R, h_offs + HALF, kas, kbs, 0, K_R, DT)
    else:
        kbt1 = 0
        kbt2 = 0
    if V_R > 0:
        vbt = _lowrank_bt(vb, V_R, tl.arange(0, D), vas, vbs, 0, V_R, DT)
    else:
        vbt = 0
    for sub in range(0, BS // BN):
        slot0 = sub * BN
        slot = slot0 + n_offs
        t = t0 + slot
        tvalid = (t < L) & (t >= t_lo)
        s = _page_scores(qp1, qp2, slot, slot0, tvalid, t, freq, kc, kw, ks, km, ksv, ksi, ka, kbt1, kbt2, had_ptr,
                         D, HALF, BS, DT, FAST, ROPE, ROT_K, K_BITS, K_UNIT, K_GROUP, K_R, K_K, K_STATS_ROW,
                         K_PLANES, K_ROW)
        if V_BY_CHANNEL:
            v = _per_channel_tile(vc, vs, vm, V_CODES_W, V_STATS_W, slot, slot0, BS, tvalid, tl.arange(0, D), 0, 0,
                                  0, 0, V_BITS, V_UNIT, V_GROUP, 0, V_STATS_ROW, DT, False)
        else:
            v = _value_tile(vc, vs, vm, vsv, vsi, V_CODES_W, V_STATS_W, V_K2, slot, tvalid, D, V_BITS, V_UNIT,
                            V_GROUP, V_K2, V_STATS_W)
        m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, 0, m_i, l_i, acc, v, DT)
        if V_R > 0:
            acc = _lowrank_values(acc, p, _lowrank_a(va, V_R, slot, tvalid, V_R, DT), vbt, DT)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=_DYNAMIC)
def _paged_attention_kernel(
    q_ptr, s_qt, s_qh, starts_ptr, lens_ptr, table_ptr, s_table,
    tail_k, tail_v, close_k, close_v, first_closing,  # exact blocks [S or C, BS, H, D], contiguous
    sink_slot_ptr, sink_k, sink_v, SINKS,  # [R] sink slot of each request (-1: none); [slots, SINKS, H, D]
    freq_ptr, rope_scale, had_ptr, out_ptr, s_ot, s_oh, sm_scale, H_KV, PAGE_BYTES,
    # the fields of page (block 0, head 0), typed; RAW: kc is the page in the model dtype ([K BS*D | V BS*D])
    kc, kw, ks, km, ksv, ksi, ka, kb, kas, kbs,
    vc, vs, vm, vsv, vsi, va, vb, vas, vbs,
    G: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
    FAST: tl.constexpr, RAW: tl.constexpr, ROPE: tl.constexpr, ROT_K: tl.constexpr, ROT_V: tl.constexpr,
    K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_K: tl.constexpr,
    K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr, K_ROW: tl.constexpr,
    V_BITS: tl.constexpr, V_UNIT: tl.constexpr, V_GROUP: tl.constexpr, V_R: tl.constexpr, V_K2: tl.constexpr,
    V_CODES_W: tl.constexpr, V_STATS_W: tl.constexpr, V_BY_CHANNEL: tl.constexpr, V_STATS_ROW: tl.constexpr,
):
    """out rows of request r = program_id(0) // H_KV, KV head h, query rows m = program_id(1) * 16 + [0, 16) (row m:
    query token m // G of the request, head h * G + m % G). Request r's query tokens are rows starts[r] ..
    starts[r+1]-1 of q, the last of its lens[r] tokens; table[r, j]: block j of the request, a page id >= 0, else
    -1 - s: tail slot s, or for s >= first_closing closing block s - first_closing. A request with a sink slot
    (its block 0 a page) attends its first SINKS tokens from sink_k/sink_v, not from the page."""
    pid = tl.program_id(0)
    r = pid // H_KV
    h = pid % H_KV
    q0 = tl.load(starts_ptr + r)
    nq = tl.load(starts_ptr + r + 1) - q0
    L = tl.load(lens_ptr + r)
    m = tl.program_id(1) * 16 + tl.arange(0, 16)
    mvalid = (m < nq * G) & ((m * 0 + L) > 0)
    qi = m // G
    head = h * G + m % G
    if tl.max(mvalid.to(tl.int32), axis=0) > 0:
        h_offs = tl.arange(0, HALF)
        rows_q = q_ptr + (q0 + qi).to(tl.int64) * s_qt + head * s_qh
        q1 = tl.load(rows_q[:, None] + h_offs[None, :], mask=mvalid[:, None], other=0.0).to(tl.float32) * sm_scale
        q2 = tl.load(rows_q[:, None] + HALF + h_offs[None, :], mask=mvalid[:, None], other=0.0).to(tl.float32) \
            * sm_scale
        qp1 = q1 * rope_scale  # (pages' keys are rotated here: the rotary attention_scaling with them)
        qp2 = q2 * rope_scale
        freq = tl.load(freq_ptr + h_offs) if ROPE else 0
        limit = tl.where(mvalid, L - nq + qi, -1)  # the last key each row sees
        seen = tl.max(limit, axis=0) + 1
        m_i = tl.full([16], float("-inf"), tl.float32)
        l_i = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, D], tl.float32)
        exact_stride = BS * H_KV * D  # elements of one exact block
        sink = tl.load(sink_slot_ptr + r)
        if sink >= 0:
            m_i, l_i, acc = _exact_blocks(q1, q2, sink_k + sink.to(tl.int64) * SINKS * H_KV * D + h * D,
                                          sink_v + sink.to(tl.int64) * SINKS * H_KV * D + h * D, H_KV * D, 0, SINKS,
                                          limit, mvalid, m_i, l_i, acc, had_ptr, D, HALF, BN, BN, DT, ROT_V)
        skip = tl.where(sink >= 0, SINKS, 0)  # (block 0's first tokens: read above)
        for j in range(0, tl.cdiv(seen, BS)):
            entry = tl.load(table_ptr + r.to(tl.int64) * s_table + j)
            t0 = j * BS
            if entry >= 0:
                page = (entry.to(tl.int64) * H_KV + h) * PAGE_BYTES
                if RAW:  # [K BS*D | V BS*D] in the model dtype
                    m_i, l_i, acc = _exact_blocks(q1, q2, _at(kc, page), _at(kc, page) + BS * D, D, t0, L, limit,
                                                  mvalid, m_i, l_i, acc, had_ptr, D, HALF, BS, BN, DT, ROT_V)
                else:
                    m_i, l_i, acc = _page_block(
                        qp1, qp2, t0, tl.where(j == 0, skip, 0), L, limit, mvalid, m_i, l_i, acc, freq, had_ptr,
                        _at(kc, page), _at(kw, page), _at(ks, page), _at(km, page), _at(ksv, page), _at(ksi, page),
                        _at(ka, page), _at(kb, page), _at(kas, page), _at(kbs, page), _at(vc, page), _at(vs, page),
                        _at(vm, page), _at(vsv, page), _at(vsi, page), _at(va, page), _at(vb, page),
                        _at(vas, page), _at(vbs, page), D, HALF, BS, BN, DT, FAST, ROPE, ROT_K, K_BITS, K_UNIT,
                        K_GROUP, K_R, K_K, K_STATS_ROW, K_PLANES, K_ROW, V_BITS, V_UNIT, V_GROUP, V_R, V_K2,
                        V_CODES_W, V_STATS_W, V_BY_CHANNEL, V_STATS_ROW)
            else:  # rows of H_KV * D elements: the head's D at h * D
                source = (-1 - entry).to(tl.int64)
                if source < first_closing:
                    k_b = tail_k + source * exact_stride + h * D
                    v_b = tail_v + source * exact_stride + h * D
                else:
                    k_b = close_k + (source - first_closing) * exact_stride + h * D
                    v_b = close_v + (source - first_closing) * exact_stride + h * D
                m_i, l_i, acc = _exact_blocks(q1, q2, k_b, v_b, H_KV * D, t0, L, limit, mvalid, m_i, l_i, acc,
                                              had_ptr, D, HALF, BS, BN, DT, ROT_V)
        out = tl.where(l_i[:, None] > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)
        if ROT_V:  # attended in the rotated basis: P·(V·H)·H = P·V
            o1, o2 = tl.split(tl.permute(tl.reshape(out, [16, 2, HALF]), (0, 2, 1)))
            o1, o2 = _unrotate_halves(o1, o2, had_ptr, D, tl.float32)
            out = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), [16, D])
        rows_o = out_ptr + (q0 + qi).to(tl.int64) * s_ot + head * s_oh
        tl.store(rows_o[:, None] + tl.arange(0, D)[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mvalid[:, None])
