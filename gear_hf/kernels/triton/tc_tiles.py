"""Tiles of the tensor-core decode kernel (`tc_kernel`): one block of compressed tokens, with the work that does not
depend on the element done once per block, per chunk or per query row instead of per element.

What differs from the register kernel's `tiles._compressed_block` (same storage, same oracle):

* values per token with one group per token (STATS_W == 1, no value outliers: `GearConfig()`): the scale and
  minimum are folded into the probabilities, P·(code·s + m) = (P·diag(s))·code + (P·m)·1ᵀ, so the value tile is
  the codes converted once to the dot dtype (exact: codes <= 255) — no per-element dequantization; 3-bit codes are
  built two per 32-bit word straight as magic 16-bit floats (`tc_codes`), the magic taken out once per row of P;
* key widths allocated per channel (bit planes): each channel's plane offset (a cumulative sum over the widths) is
  computed once per chunk (`tc_plane_layout`), not per block;
* outliers (keys: the sorted lists of `views.prepare_derived`; values: K2 per token) are scattered, one store
  each, into the program's zeroed scratch tile and read back dense: the key outliers join the key tile before RoPE
  (no sin/cos per outlier, no one-hot dot), the value outliers the value tile (no compare per element and slot);
* everything else (keys dequantized, un-rotated and RoPE-rotated in registers, then q·kᵀ on the tensor cores;
  low-rank terms in the rank basis) as in `tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import _dot, _lowrank_a, _lowrank_dot, _lowrank_values, _rope, _sincos, _softmax_weights, _unrotate_halves
from .tc_codes import value_codes_magic
from .tiles import _load_token_stats, _per_channel_tile, _value_tile
from .unpack import _plane_bytes, _planes_to_codes, _unpack_3bit_units, _unpack_words


@triton.jit
def tc_plane_layout(widths_b, D: tl.constexpr):
    """(offset, width) of both halves of a head's channels: the byte offset of each channel's planes within a unit
    of 8 tokens and its width, int32 [D/2] each (first half, second half), from the chunk's widths widths_b [D]:
    one scan per chunk."""
    c = tl.arange(0, D)
    widths = tl.load(widths_b + c).to(tl.int32)
    offset = tl.cumsum(widths, axis=0) - widths
    o1, o2 = tl.split(tl.permute(tl.reshape(offset, [2, D // 2]), (1, 0)))
    w1, w2 = tl.split(tl.permute(tl.reshape(widths, [2, D // 2]), (1, 0)))
    return o1, w1, o2, w2


@triton.jit
def _tc_plane_words(codes_b, s_codes, offset, widths, slot0, slot_end, BN: tl.constexpr, C: tl.constexpr,
                    ROW: tl.constexpr):
    """(lo, hi) int32 [BN/8, C]: byte j of lo holds plane j, of hi plane 4 + j (absent planes 0) of each channel's
    planes at byte `offset` of the units' rows. Rows of ROW bytes, a multiple of 4: three aligned 32-bit words per
    channel and unit, funnel-shifted and masked to the width (never read past the row); else byte by byte."""
    units = slot0 // 8 + tl.arange(0, BN // 8)
    live = (units * 8 < slot_end)[:, None]
    if ROW % 4 == 0:
        word = offset >> 2  # [C]
        sh = (offset & 3) * 8
        rows = (codes_b + units[:, None] * s_codes).to(tl.pointer_type(tl.int32)) + word[None, :]
        w0 = tl.load(rows, mask=live, other=0).to(tl.uint32, bitcast=True)
        w1 = tl.load(rows + 1, mask=live & ((word + 1) * 4 < ROW)[None, :], other=0).to(tl.uint32, bitcast=True)
        w2 = tl.load(rows + 2, mask=live & ((word + 2) * 4 < ROW)[None, :], other=0).to(tl.uint32, bitcast=True)
        up = (31 - sh)[None, :]  # (w << 1) << (31 - sh): a shift by 32 - sh that is defined at sh = 0
        lo = (w0 >> sh[None, :]) | ((w1 << 1) << up)
        hi = (w1 >> sh[None, :]) | ((w2 << 1) << up)
        # keep the channel's own planes: min(width, 4) bytes of lo, max(width - 4, 0) of hi
        lo_keep = tl.where(widths >= 4, -1, (1 << (8 * widths)) - 1).to(tl.uint32, bitcast=True)
        hi_keep = tl.where(widths >= 8, -1, (1 << (8 * tl.maximum(widths - 4, 0))) - 1).to(tl.uint32, bitcast=True)
        lo = (lo & lo_keep[None, :]).to(tl.int32, bitcast=True)
        hi = (hi & hi_keep[None, :]).to(tl.int32, bitcast=True)
    else:
        lo, hi = _plane_bytes(codes_b, s_codes, widths, offset, slot0, slot_end, BN, C)
    return lo, hi


@triton.jit
def _tc_plane_codes(codes_b, s_codes, offset, widths, slot0, slot_end, BN: tl.constexpr, C: tl.constexpr,
                    ROW: tl.constexpr):
    """`unpack._plane_codes` with the chunk's plane offsets and widths given (`tc_plane_layout`): int32 [BN, C]."""
    lo, hi = _tc_plane_words(codes_b, s_codes, offset, widths, slot0, slot_end, BN, C, ROW)
    return _planes_to_codes(lo, hi, BN, C)


@triton.jit
def _tc_plane_key_half(codes_b, scale_b, min_b, s_codes, s_scale, slot, slot0, slot_end, tvalid, ch, ch0, offset,
                       widths, a, bt, GROUP: tl.constexpr, R: tl.constexpr, STATS_ROW: tl.constexpr,
                       DT: tl.constexpr, ROW: tl.constexpr):
    """Half a key tile of allocated widths: D̂ (+ A·Bᵀ) float32 [BN, C] (see `tiles._per_channel_tile`)."""
    BN: tl.constexpr = slot.shape[0]
    C: tl.constexpr = ch.shape[0]
    code = _tc_plane_codes(codes_b, s_codes, offset, widths, slot0, slot_end, BN, C, ROW)
    if STATS_ROW:
        srow = (slot0 // GROUP) * s_scale + ch
        sc = tl.load(scale_b + srow).to(tl.float32)[None, :]
        mn = tl.load(min_b + srow).to(tl.float32)[None, :]
    else:
        srow = (slot // GROUP)[:, None] * s_scale + ch[None, :]
        sc = tl.load(scale_b + srow, mask=tvalid[:, None], other=0.0).to(tl.float32)
        mn = tl.load(min_b + srow, mask=tvalid[:, None], other=0.0).to(tl.float32)
    k = code.to(tl.float32) * sc + mn
    if R > 0:
        k = _lowrank_dot(a, bt, k, DT)
    return k


@triton.jit
def _tc_lowrank_a(a_b, s_a, slot, tvalid, R: tl.constexpr, DT: tl.constexpr):
    """`ops._lowrank_a` loaded straight as [BN, 16]: column j reads rank j // (16/RP) where j is a multiple of 16/RP and
    the rank is real, else a masked 0 (no zero tile joined and reshaped after the load)."""
    RP: tl.constexpr = 1 << (R - 1).bit_length()
    cols = tl.arange(0, 16)
    rank = cols // (16 // RP)
    keep = ((cols % (16 // RP)) == 0) & (rank < R)
    a = tl.load(a_b + slot[:, None] * s_a + rank[None, :], mask=tvalid[:, None] & keep[None, :], other=0)
    if a.dtype == tl.int8:  # (through float32: the CPU interpreter has no direct int8 -> bf16 conversion)
        a = a.to(tl.float32).to(DT)
    return a


@triton.jit
def _tc_scatter_key_outliers(scr, ow_b, ov_b, ot_b, n_tiles, seg, tok0, D: tl.constexpr, BN: tl.constexpr,
                             FAST: tl.constexpr):
    """Store the key outliers of chunk-local tokens [tok0, tok0 + BN) (the sorted lists of `views.prepare_derived`:
    entry token * D + channel, per-16-token offsets ot_b) into the block's scratch tile scr [BN, D] float32: one store
    per outlier, whatever the tile's size."""
    OE: tl.constexpr = 128
    u0 = tok0 // 16
    lo = tl.load(ot_b + u0)
    hi = tl.load(ot_b + tl.minimum(u0 + BN // 16, n_tiles))
    for e0 in tl.range(lo, hi, OE, loop_unroll_factor=1):
        e = e0 + tl.arange(0, OE)
        if FAST:  # ptxas: do not unroll this loop (about one trip per block; unrolled 4x: ~130 static instructions)
            e = tl.inline_asm_elementwise('.pragma "nounroll";\n\tmov.b32 $0, $1;', "=r,r", [e], dtype=tl.int32,
                                          is_pure=True, pack=1)
        ev = e < hi
        where = tl.load(ow_b + seg + e, mask=ev, other=0)
        val = tl.load(ov_b + seg + e, mask=ev, other=0.0).to(tl.float32)
        tl.store(scr + where - tok0 * D, val, mask=ev)


@triton.jit
def _tc_scatter_value_outliers(scr, spv_b, spi_b, s_sp, slot, tvalid, D: tl.constexpr, K2: tl.constexpr):
    """Store the value outliers of the block's tokens (K2 per token: channel spi_b, value spv_b) into its scratch tile
    scr [BN, D] float32 at (token, channel): K2 stores per token."""
    BN: tl.constexpr = slot.shape[0]
    n = tl.arange(0, BN)
    for s in tl.static_range(K2):
        idx = tl.load(spi_b + slot * s_sp + s, mask=tvalid, other=0).to(tl.int32)
        ok = tvalid & (idx >= 0) & (idx < D)
        val = tl.load(spv_b + slot * s_sp + s, mask=tvalid, other=0.0).to(tl.float32)
        tl.store(scr + n * D + idx, val, mask=ok)


@triton.jit
def _tc_value_codes(codes_b, s_codes, slot, tvalid, D: tl.constexpr, BITS: tl.constexpr, UNIT: tl.constexpr):
    """Value codes (axis="token") at store slots `slot` [BN], all channels: int32 [BN, D]."""
    m2 = tvalid[:, None]
    BN: tl.constexpr = slot.shape[0]
    if BITS == 3:
        units = tl.arange(0, D // UNIT)
        return tl.reshape(_unpack_3bit_units(codes_b + slot[:, None] * s_codes + (units * 3)[None, :], 1, m2), [BN, D])
    else:
        WORDS: tl.constexpr = D * BITS // 32
        rows = (codes_b + slot[:, None] * s_codes).to(tl.pointer_type(tl.int32))
        w = tl.load(rows + tl.arange(0, WORDS)[None, :], mask=m2, other=0)
        return tl.reshape(_unpack_words(w, BITS), [BN, D])


@triton.jit
def tc_compressed_block(
    q1, q2, q_rows, t, slot, slot0, slot_end, tvalid, tok0, pos_b, freq_ptr, freq, q_scale, limit, mvalid,
    window, m_i, l_i, acc,
    kc, ks, km, ka, s_kc, s_ks, s_ka, ow, ov, ot, n_tiles, seg, t_base, kw, koff1, kw1, koff2, kw2,
    vc, vs, vm, vsv, vsi, va, s_vc, s_vs, s_vsp, s_va, kbt1, kbt2, vbt, had_ptr,
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, ROT_K: tl.constexpr,
    K_BITS: tl.constexpr, K_UNIT: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr, K_SPARSE: tl.constexpr,
    K_STATS_ROW: tl.constexpr, K_PLANES: tl.constexpr,
    V_BITS: tl.constexpr, V_UNIT: tl.constexpr, V_GROUP: tl.constexpr, V_R: tl.constexpr, V_K2: tl.constexpr,
    V_BY_CHANNEL: tl.constexpr, V_STATS_ROW: tl.constexpr, V_FOLD: tl.constexpr, scr, ROPE_Q: tl.constexpr,
):
    """One block of compressed tokens (the arguments of `tiles._compressed_block`, plus koff/kw of both key halves:
    the chunk's `tc_plane_layout`, with K_PLANES). V_FOLD: values per token in one group per token without
    outliers: scale and minimum folded into the probabilities. scr: the program's zeroed scratch [2, BN, D] float32
    (keys, values) the block's outliers are scattered into, read back as dense tiles and zeroed again (three
    barriers: scatter | read | zero | the next block's scatter)."""
    h_offs = tl.arange(0, HALF)
    n_offs = tl.arange(0, BN)
    SCATTER: tl.constexpr = K_SPARSE or (V_K2 > 0)
    if K_SPARSE:
        _tc_scatter_key_outliers(scr, ow, ov, ot, n_tiles, seg, tok0, D, BN, FAST)
    if V_K2 > 0:
        _tc_scatter_value_outliers(scr + BN * D, vsv, vsi, s_vsp, slot, tvalid, D, V_K2)
    if SCATTER:
        tl.debug_barrier()
    # A as the [BN, 16] operand straight from a masked load where the format has outliers (gear-2: 1539 -> 1524 SASS,
    # 6 fewer registers); else `ops._lowrank_a` (gear-l-2 spills 8 ops with the masked load against 4 without)
    ka16 = 0  # shared by both halves
    if K_R > 0:
        if SCATTER:
            ka16 = _tc_lowrank_a(ka, s_ka, slot, tvalid, K_R, DT)
        else:
            ka16 = _lowrank_a(ka, s_ka, slot, tvalid, K_R, DT)
    if K_PLANES:
        k1 = _tc_plane_key_half(kc, ks, km, s_kc, s_ks, slot, slot0, slot_end, tvalid, h_offs, 0, koff1, kw1, ka16,
                                kbt1, K_GROUP, K_R, K_STATS_ROW, DT, s_kc)
        k2 = _tc_plane_key_half(kc, ks, km, s_kc, s_ks, slot, slot0, slot_end, tvalid, h_offs + HALF, HALF, koff2,
                                kw2, ka16, kbt2, K_GROUP, K_R, K_STATS_ROW, DT, s_kc)
    else:
        k1 = _per_channel_tile(kc, ks, km, s_kc, s_ks, slot, slot0, slot_end, tvalid, h_offs, 0, ka16, kbt1, kw,
                               K_BITS, K_UNIT, K_GROUP, K_R, K_STATS_ROW, DT, False)
        k2 = _per_channel_tile(kc, ks, km, s_kc, s_ks, slot, slot0, slot_end, tvalid, h_offs + HALF, HALF, ka16,
                               kbt2, kw, K_BITS, K_UNIT, K_GROUP, K_R, K_STATS_ROW, DT, False)
    if K_SPARSE:  # + S: the outliers of the key tile, dense from the scratch
        k1 += tl.load(scr + n_offs[:, None] * D + h_offs[None, :])
        k2 += tl.load(scr + n_offs[:, None] * D + HALF + h_offs[None, :])
    if ROT_K:
        k1, k2 = _unrotate_halves(k1, k2, had_ptr, D, DT)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    if ROPE_Q:  # (compile_check's comparison only) the query rotated back per token, q·R_t k = (R_tᵀ q)·k: [M,BN,D/2]
        c, sn = _sincos(pos.to(tl.float32)[:, None] * freq[None, :], FAST)
        qa, qb = q1.to(tl.float32)[:, None, :], q2.to(tl.float32)[:, None, :]
        s = tl.sum((qa * c[None] + qb * sn[None]) * k1[None] + (qb * c[None] - qa * sn[None]) * k2[None], axis=2)
    else:
        k1, k2 = _rope(k1, k2, pos, freq, FAST)
        s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
    m_i, l_i, alpha, p = _softmax_weights(s, t, tvalid, limit, mvalid, window, m_i, l_i)
    acc = acc * alpha[:, None]
    if V_FOLD:  # P·(code·s + m) = (P·diag(s))·code + (P·m)·1ᵀ, s and m one per token
        if vs.dtype.element_ty == tl.uint8:  # 8-bit statistics, decoded here
            sc, mn = _load_token_stats(vs, vm, slot * s_vs, tvalid, (1 << V_BITS) - 1)
        else:  # (loaded here, not through _load_token_stats: GearConfig()'s main loop stays 2056 SASS, not 2065)
            sc = tl.load(vs + slot * s_vs, mask=tvalid, other=0.0).to(tl.float32)
            mn = tl.load(vm + slot * s_vs, mask=tvalid, other=0.0).to(tl.float32)
        MT: tl.constexpr = q_rows.dtype.element_ty  # the model's 16-bit dtype
        if (V_BITS == 3) and (D % 32 == 0):  # codes as magic floats (magic + code): P·code = P·v - magic·rowsum(P)
            if MT == tl.float16:  # magic_of(MT, 3)[1], as a constexpr
                MAGIC: tl.constexpr = 1024.0
            else:
                MAGIC: tl.constexpr = 128.0
            ps = (p * sc[None, :]).to(DT)
            v = value_codes_magic(vc, s_vc, slot, tvalid, D, V_BITS, MT)
            acc = _dot(ps, v.to(DT), DT) + acc + tl.sum(p * mn[None, :] - MAGIC * ps.to(tl.float32), axis=1)[:, None]
        else:
            code = _tc_value_codes(vc, s_vc, slot, tvalid, D, V_BITS, V_UNIT)
            acc = _dot(p * sc[None, :], code.to(DT), DT) + acc + tl.sum(p * mn[None, :], axis=1)[:, None]
    else:
        if V_BY_CHANNEL:
            v = _per_channel_tile(vc, vs, vm, s_vc, s_vs, slot, slot0, slot_end, tvalid, tl.arange(0, D), 0, 0, 0,
                                  0, V_BITS, V_UNIT, V_GROUP, 0, V_STATS_ROW, DT, False)
        else:
            v = _value_tile(vc, vs, vm, vsv, vsi, s_vc, s_vs, s_vsp, slot, tvalid, D, V_BITS, V_UNIT, V_GROUP, 0,
                            s_vs)
        acc += _dot(p, v, DT)
        if V_K2 > 0:  # + P·S: the value outliers, dense from the scratch (a second dot: fewer live registers)
            acc += _dot(p, tl.load(scr + BN * D + n_offs[:, None] * D + tl.arange(0, D)[None, :]), DT)
    if SCATTER:  # the scratch back to zeros, before the next block scatters into it
        tl.debug_barrier()
        if K_SPARSE:  # whole tiles, one dense store each (cheaper than the scatter's addresses again)
            tl.store(scr + n_offs[:, None] * D + tl.arange(0, D)[None, :], tl.zeros([BN, D], tl.float32))
        if V_K2 > 0:
            tl.store(scr + BN * D + n_offs[:, None] * D + tl.arange(0, D)[None, :], tl.zeros([BN, D], tl.float32))
        tl.debug_barrier()
    if V_R > 0:
        acc = _lowrank_values(acc, p, _tc_lowrank_a(va, s_va, slot, tvalid, V_R, DT) if SCATTER else
                              _lowrank_a(va, s_va, slot, tvalid, V_R, DT), vbt, DT)
    return m_i, l_i, acc
