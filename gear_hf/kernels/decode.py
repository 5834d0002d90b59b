"""Fused GEAR decode attention: attend straight from compressed storage, given as tensors (`views`).

For each (row, KV head, 16-row tile of the M = group * q_len query rows) one program (or `num_splits` programs,
flash-decoding style) streams over that row's tokens in row-local order

    [ sink (full precision) | prompt chunk | decode chunks of n_b | buffer (full precision) ]

and a second small kernel merges the splits: two launches per layer-step, no allocation (workspaces are cached
per device and size), no memset. Compressed blocks are decoded in registers, never written back:

* codes of 2, 4 or 8 bits loaded as 32-bit words (`_unpack_words`: shifts and masks in registers; a key word
  holds 4 channels' bytes, a value word 32/bits channels of one token); 3 bits (8 codes in 3 bytes, a 2-bit and
  a 1-bit plane, as gear_hf.compress.quant packs) byte by byte (`_unpack_3bit_units`), each byte loaded once;
* keys (per channel over token groups): unpack along tokens, dequantize with the group's scale/minimum (one row
  of statistics per block when a group spans whole blocks), add the low-rank term A·Bᵀ as a tensor-core dot
  accumulating into the dequantized tile (rank padded to 16 in registers: only A's R columns, loaded once per
  block for both halves, and Bᵀ's R rows, loaded once per chunk, are read; int8 factors: their per-column
  scales folded into Bᵀ), un-rotate Walsh–Hadamard-rotated keys (two [BN, d/2]x[d/2, d/2] dots),
  rotate the pre-RoPE key by its stored position (cos/sin from the rotary module's inv_freq, so
  llama3/linear/yarn scaling is covered) and take q·k (tl.dot); the softmax scale and the rotary
  attention_scaling are folded into the query once;
* key outliers (fixed 2k per channel over a chunk) come sorted by token within their chunk with per-16-token
  offsets (`views.prepare_derived`, once per chunk): each block reads only its own outliers and adds their
  exact score terms v·(q_j cos ± q_{j±d/2} sin) through a one-hot tl.dot — no score buffer, no atomics;
* values (per token over channel groups): unpack along channels (each word once), dequantize with statistics
  loaded once per group, add the token's outliers, accumulate P·V̂ with tl.dot and the low-rank term as
  (P·A)·Bᵀ, two small dots (never A·Bᵀ); rotated values are attended in the rotated basis (the sink and buffer
  values rotated on the fly) and the output is un-rotated once per row in the merge kernel (P·V·H·H = P·V);
* online softmax in float32 (exp2), causal inside the new tokens and the sliding window on row-local indices
  (padding is not stored, so a row's indices are exactly its real tokens); blocks wholly outside the window
  are skipped, not just masked;
* cos/sin: the float32 angle pos*inv_freq (as HF computes it), reduced to [-pi, pi] exactly enough (~1e-6 rad
  at 3e4 rad), then the hardware sin/cos approximations on the GPU (exact ones in the interpreter).

Launches run inside `torch.cuda.device(query.device)`, on that device's current stream (layers spread over
several GPUs by a `device_map`). Integer arguments that change during generation (lengths, split count,
strides that grow with the storage) are not specialized on, so the kernel compiles once per configuration.

Operands of tl.dot are cast to the model dtype (fp16/bf16: tensor cores) or stay float32 (`ieee`); under the
CPU interpreter bf16 is upcast to float32 (the interpreter computes bf16 dots wrong). Everything else is
float32. Supported: keys axis="channel", values axis="token" (the defaults) or "channel" (read like keys; without
value outliers), pre_rope=True, every bit width (and key widths allocated per channel, read from their bit planes),
rotation, int8 factors and group size, except key outliers of rotated keys; the other combinations use the torch
path (see gear_hf.kernels.fused_supported).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import triton
import triton.language as tl

from ..compress.quant import MAX_CHANNEL_BITS, codes_per_unit, pack_unit
from . import interpreting
from .views import (MAX_FUSED_RANK, OUTLIER_TILE, ChunkRunView, DecodeLayout, StreamView, key_outlier_count,
                    prepare_derived)

try:  # fast sin/cos approximations (MUFU) for the GPU; the interpreter has no libdevice
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - other triton layouts
    _libdevice = None

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
LOG2E = 1.4426950408889634
M_TILE = 16  # query rows per program (G*q rows are split into tiles of 16: no spills at G*q = 32..128)
OUTLIERS_PER_STEP = tl.constexpr(32)  # key outliers applied per one-hot dot


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
def _rope(k1, k2, pos, freq, FAST: tl.constexpr):
    """HF rotate_half RoPE of a key tile split in halves [BN, HALF] at positions pos [BN] (freq: inv_freq [HALF];
    the rotary attention_scaling is folded into the query)."""
    ang = pos.to(tl.float32)[:, None] * freq[None, :]
    c, s = _sincos(ang, FAST)
    return k1 * c - k2 * s, k2 * c + k1 * s


@triton.jit
def _join4(c0, c1, c2, c3):
    """Four [R, C] tiles -> [R, C, 4], tile j at index j of the last axis."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [c0.shape[0], c0.shape[1], 4])


@triton.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight [R, C] tiles -> [R, C, 8], tile j at index j of the last axis."""
    even = tl.reshape(tl.join(tl.join(c0, c4), tl.join(c2, c6)), [c0.shape[0], c0.shape[1], 4])
    odd = tl.reshape(tl.join(tl.join(c1, c5), tl.join(c3, c7)), [c0.shape[0], c0.shape[1], 4])
    return tl.reshape(tl.join(even, odd), [c0.shape[0], c0.shape[1], 8])


@triton.jit
def _join16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """Sixteen [R, C] tiles -> [R, C, 16], tile j at index j of the last axis."""
    even = _join8(c0, c2, c4, c6, c8, c10, c12, c14)
    odd = _join8(c1, c3, c5, c7, c9, c11, c13, c15)
    return tl.reshape(tl.join(even, odd), [c0.shape[0], c0.shape[1], 16])


@triton.jit
def _unpack_words(w, BITS: tl.constexpr):
    """Codes of 32-bit little-endian words w [R, C] of 2/4/8-bit codes (code j at bits BITS*j, the byte order
    of gear_hf.compress.quant's packing read four bytes at a time): int32 [R, C, 32 // BITS] in code order."""
    if BITS == 8:
        return _join4(w & 255, (w >> 8) & 255, (w >> 16) & 255, (w >> 24) & 255)
    elif BITS == 4:
        return _join8(w & 15, (w >> 4) & 15, (w >> 8) & 15, (w >> 12) & 15, (w >> 16) & 15, (w >> 20) & 15,
                      (w >> 24) & 15, (w >> 28) & 15)
    else:
        tl.static_assert(BITS == 2, "words of 2, 4 or 8-bit codes")
        return _join16(w & 3, (w >> 2) & 3, (w >> 4) & 3, (w >> 6) & 3, (w >> 8) & 3, (w >> 10) & 3,
                       (w >> 12) & 3, (w >> 14) & 3, (w >> 16) & 3, (w >> 18) & 3, (w >> 20) & 3, (w >> 22) & 3,
                       (w >> 24) & 3, (w >> 26) & 3, (w >> 28) & 3, (w >> 30) & 3)


@triton.jit
def _unpack_3bit_units(p, step, mask):
    """3-bit codes of the packing units whose first byte `p` [R, C] points at (a unit's bytes `step` apart):
    int32 [R, C, 8] in code order. A unit is 8 codes in 3 bytes, a 2-bit plane of two bytes then a 1-bit plane
    (the layout of gear_hf.compress.quant); units do not align with 32-bit words, so each byte is loaded once
    and unpacked with shifts and masks in registers."""
    b0 = tl.load(p, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(p + step, mask=mask, other=0).to(tl.int32)
    hi = tl.load(p + 2 * step, mask=mask, other=0).to(tl.int32) << 2  # bit j of the plane -> bit j + 2
    return _join8(b0 & 3 | hi & 4, (b0 >> 2) & 3 | (hi >> 1) & 4, (b0 >> 4) & 3 | (hi >> 2) & 4,
                  (b0 >> 6) | (hi >> 3) & 4, b1 & 3 | (hi >> 4) & 4, (b1 >> 2) & 3 | (hi >> 5) & 4,
                  (b1 >> 4) & 3 | (hi >> 6) & 4, (b1 >> 6) | (hi >> 7) & 4)


@triton.jit
def _load_rows(p, mask, C: tl.constexpr):
    """float32 [R, C] of the 16-bit (bf16/fp16) or float32 elements p [R] + arange(C) (rows 4-byte aligned). 16-bit
    rows are read as 32-bit words and split in registers: wide loads whatever layout the consumer wants (a plain
    16-bit load takes the consumer's layout, often one element per load)."""
    ty: tl.constexpr = p.dtype.element_ty
    if ty == tl.float32:
        x = tl.load(p[:, None] + tl.arange(0, C)[None, :], mask=mask, other=0.0)
    else:
        w = tl.load(p.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, C // 2)[None, :], mask=mask, other=0)
        if ty == tl.bfloat16:  # a bf16 is the top half of the float32 with the same value
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = (w & 65535).to(tl.int16).to(ty, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(ty, bitcast=True).to(tl.float32)
        x = tl.reshape(tl.join(lo, hi), [w.shape[0], C])
    return x


@triton.jit
def _swap_bits(x, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """x with its bits under MASK swapped with the bits SHIFT places above them (a step of a bit-matrix transpose)."""
    t = (x ^ (x >> SHIFT)) & MASK
    return x ^ t ^ (t << SHIFT)


@triton.jit
def _plane_codes(codes_b, s_codes, widths_b, slot0, slot_end, ch0, BN: tl.constexpr, C: tl.constexpr):
    """Codes of per-channel widths (quant.pack_planes: per 8 tokens, channel c's bit planes at byte offset
    sum(widths[:c]), plane j holding bit j of the 8 tokens' codes) of channels [ch0, ch0 + C) (ch0: 0, or C for the
    second half of a head) at store slots slot0 + arange(BN): int32 [BN, C]. widths_b: this chunk's widths [D]."""
    c = tl.arange(0, C)
    widths = tl.load(widths_b + ch0 + c).to(tl.int32)
    before = tl.sum(tl.load(widths_b + c, mask=c < ch0, other=0).to(tl.int32), axis=0)  # the first half's bits
    offset = before + tl.cumsum(widths, axis=0) - widths
    units = slot0 // 8 + tl.arange(0, BN // 8)
    row = codes_b + units[:, None] * s_codes + offset[None, :]
    live = (units * 8 < slot_end)[:, None]
    # the 8 planes as two 32-bit words (byte j of lo: plane j, of hi: plane 4 + j; absent planes: 0)
    lo = tl.zeros([BN // 8, C], tl.int32)
    hi = tl.zeros([BN // 8, C], tl.int32)
    for j in tl.static_range(4):
        lo |= tl.load(row + j, mask=live & (j < widths)[None, :], other=0).to(tl.int32) << (8 * j)
        hi |= tl.load(row + 4 + j, mask=live & (4 + j < widths)[None, :], other=0).to(tl.int32) << (8 * j)
    # the 8x8 bit matrix transposed (quant._transpose_bits8 on the 64-bit word lo | hi << 32, in 32-bit halves):
    # then byte t of lo | hi << 32 is token t's code. The masks drop what the arithmetic right shifts bring in.
    lo = _swap_bits(_swap_bits(lo, 7, 0x00AA00AA), 14, 0x0000CCCC)
    hi = _swap_bits(_swap_bits(hi, 7, 0x00AA00AA), 14, 0x0000CCCC)
    lo_nibbles = lo & 0x0F0F0F0F  # the 28-bit step of the 64-bit word: low nibbles of hi <-> high nibbles of lo
    hi_nibbles = hi & 0x0F0F0F0F
    lo, hi = lo_nibbles | (hi_nibbles << 4), (hi ^ hi_nibbles) | ((lo >> 4) & 0x0F0F0F0F)
    code = _join8(lo & 255, (lo >> 8) & 255, (lo >> 16) & 255, (lo >> 24) & 255, hi & 255, (hi >> 8) & 255,
                  (hi >> 16) & 255, (hi >> 24) & 255)  # [BN/8, C, 8]
    return tl.reshape(tl.permute(code, (0, 2, 1)), [BN, C])


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
    m2 = tvalid[:, None]
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
    if STATS_ROW:  # one row of the group's statistics, [1, C]
        srow = (slot0 // GROUP) * s_scale + ch0 + tl.zeros([1], tl.int32)
        sc = _load_rows(scale_b + srow, tl.full([1, 1], True, tl.int1), C)
        mn = _load_rows(min_b + srow, tl.full([1, 1], True, tl.int1), C)
    else:
        srow = (slot // GROUP)[:, None] * s_scale + ch[None, :]
        sc = tl.load(scale_b + srow, mask=m2, other=0.0).to(tl.float32)
        mn = tl.load(min_b + srow, mask=m2, other=0.0).to(tl.float32)
    k = code.to(tl.float32) * sc + mn
    if R > 0:  # + A·Bᵀ on the tensor cores (rank padded to 16 with zeros)
        k = _lowrank_dot(a, bt, k, DT)
    return k


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
    if STATS_W * GROUP == D:  # whole groups: one load per group, broadcast over its channels in registers
        g = tl.arange(0, STATS_W)
        srow = slot[:, None] * s_scale + g[None, :]
        sc = tl.load(scale_b + srow, mask=m2, other=0.0).to(tl.float32)
        mn = tl.load(min_b + srow, mask=m2, other=0.0).to(tl.float32)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, STATS_W, GROUP]), [BN, D])
        mn = tl.reshape(tl.broadcast_to(mn[:, :, None], [BN, STATS_W, GROUP]), [BN, D])
    else:
        srow = slot[:, None] * s_scale + (c // GROUP)[None, :]
        sc = tl.load(scale_b + srow, mask=m2, other=0.0).to(tl.float32)
        mn = tl.load(min_b + srow, mask=m2, other=0.0).to(tl.float32)
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
    M: tl.constexpr = s.shape[0]
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
def _lowrank_a(a_b, s_a, slot, tvalid, R: tl.constexpr, DT: tl.constexpr):
    """A [BN, 16] at store slots `slot`, the rank padded with zeros to 16 (the smallest tl.dot): only the R real
    columns are loaded (rounded up to a power of two RP), column j holds rank j // (16/RP) when j is a multiple
    of 16/RP, else zero (the rows of `_lowrank_bt` match). In the storage dtype; int8 factors in the dot dtype
    (exact in it; their per-column scales are carried by `_lowrank_bt`)."""
    RP: tl.constexpr = 1 << (R - 1).bit_length()
    rr = tl.arange(0, RP)
    a = tl.load(a_b + slot[:, None] * s_a + rr[None, :], mask=tvalid[:, None] & (rr < R)[None, :], other=0)
    if a.dtype == tl.int8:  # (through float32: the CPU interpreter has no direct int8 -> bf16 conversion)
        a = a.to(tl.float32).to(DT)
    a = tl.where((tl.arange(0, 16 // RP) == 0)[None, None, :], a[:, :, None], tl.zeros_like(a)[:, :, None])
    return tl.reshape(a, [a.shape[0], 16])


@triton.jit
def _lowrank_bt(bm_b, s_bm, b_rows, as_b, bs_b, chunk, R: tl.constexpr, DT: tl.constexpr):
    """Bᵀ [16, C] of B's rows `b_rows`, row j = rank j // (16/RP) (see `_lowrank_a`), in its storage dtype. int8 factors
    (gear_hf.compress.gear: A·diag(a_scale)·(B·diag(b_scale))ᵀ) carry both per-column scales of the chunk here:
    Bᵀ·diag(a_scale·b_scale) in the dot dtype (rounded once; A stays exact)."""
    RP: tl.constexpr = 1 << (R - 1).bit_length()  # the rank rounded up to a power of two
    rr = tl.arange(0, RP)
    bt = tl.load(bm_b + b_rows[None, :] * s_bm + rr[:, None], mask=(rr < R)[:, None], other=0)  # [RP, C]
    if bt.dtype == tl.int8:
        at = chunk * R + rr
        sc = tl.load(as_b + at, mask=rr < R, other=0.0).to(tl.float32) * \
            tl.load(bs_b + at, mask=rr < R, other=0.0).to(tl.float32)
        bt = (bt.to(tl.float32) * sc[:, None]).to(DT)
    # 16 rows (the smallest dot) from the R real ones: each repeated 16/RP times (A is zero in all but the first)
    return tl.reshape(tl.broadcast_to(bt[:, None, :], [RP, 16 // RP, bt.shape[1]]), [16, bt.shape[1]])


@triton.jit
def _lowrank_dot(x, y, acc, DT: tl.constexpr):
    """acc + x·y with y a low-rank factor. 16-bit factors: tensor-core dot in their dtype (x rounded to it; exact
    products, float32 accumulation); DT float32 (a float32 model, or bf16 under the interpreter): a float32 dot."""
    if DT == tl.float32:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc=acc, input_precision="ieee")
    else:
        return tl.dot(x.to(y.dtype), y, acc=acc)


@triton.jit
def _lowrank_values(acc, p, a, bt, DT: tl.constexpr):
    """acc += (P·A)·Bᵀ for the block (two small dots; A·Bᵀ never formed)."""
    pa = _lowrank_dot(p, a, tl.zeros([p.shape[0], 16], tl.float32), DT)  # [M, 16]
    return _lowrank_dot(pa, bt, acc, DT)


@triton.jit
def _unrotate_halves(x1, x2, had_ptr, D: tl.constexpr, DT: tl.constexpr):
    """[x1 x2]·H_D for the halves [R, D/2] of a tile. H_D = D^-1/2 [[S, S], [S, -S]] (S: the Sylvester matrix of
    D/2, exact ±1, read from the [D/2, D/2] table `had_ptr`, an L1 hit after the first block), so
    x·H_D = D^-1/2 [(x1 + x2)·S, (x1 - x2)·S]. H_D is symmetric and its own inverse: this rotates and un-rotates
    (gear_hf.compress.rotation)."""
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, HALF)
    s_half = tl.load(had_ptr + r[:, None] * HALF + r[None, :])
    norm = 1.0 / tl.sqrt_rn(tl.full([], D, tl.float32))
    return _dot(x1 + x2, s_half, DT) * norm, _dot(x1 - x2, s_half, DT) * norm


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
def _dense_block(q1, q2, k_b, v_b, s_tok, t, slot, tvalid, pos_b, freq, limit,
                 mvalid, window, m_i, l_i, acc, had_ptr, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                 FAST: tl.constexpr, ROT_V: tl.constexpr):
    """Full-precision tokens (sink or buffer) at store slots `slot`."""
    m2 = tvalid[:, None]
    rows = slot * s_tok  # [BN]
    k1 = _load_rows(k_b + rows, m2, HALF)
    k2 = _load_rows(k_b + rows + HALF, m2, HALF)
    pos = tl.load(pos_b + t, mask=tvalid, other=0)
    k1, k2 = _rope(k1, k2, pos, freq, FAST)
    s = _dot(q1, tl.trans(k1), DT) + _dot(q2, tl.trans(k2), DT)
    if ROT_V:  # the compressed values are attended in the rotated basis (v·H); the output is un-rotated once
        v1, v2 = _unrotate_halves(_load_rows(v_b + rows, m2, HALF), _load_rows(v_b + rows + HALF, m2, HALF),
                                  had_ptr, D, DT)
        v = tl.reshape(tl.permute(tl.join(v1, v2), (0, 2, 1)), [v1.shape[0], D])
    else:
        v = tl.load(v_b + rows[:, None] + tl.arange(0, D)[None, :], mask=m2, other=0.0)
    m_i, l_i, acc, p = _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT)
    return m_i, l_i, acc


@triton.jit
def _blocks_before(t_min, start, length, BN: tl.constexpr):
    """How many BN-token blocks of the segment [start, start+length) end at or before token t_min."""
    n = tl.cdiv(length, BN)
    return tl.where(t_min >= start + length, n, tl.minimum(tl.maximum(t_min - start, 0) // BN, n))


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------
# Integer arguments whose values move during generation (lengths, splits, strides of storage that grows):
# never specialized on (a value of 1 or a new divisibility by 16 would otherwise compile a new kernel).
_MAIN_DYNAMIC = ["sqb", "sqh", "sqq", "spos", "window", "s_sink_h", "s_buf_h",
                 "s_pkc", "s_pks", "s_pka", "s_pkb", "p_tiles", "p_seg",
                 "s_pvc", "s_pvs", "s_pvsp", "s_pva", "s_pvb",
                 "s_dkc", "s_dks", "s_dka", "s_dkb", "d_seg", "s_dow", "s_dot", "s_pow", "s_pot",
                 "s_dvc", "s_dvs", "s_dvsp", "s_dva", "s_dvb", "H_KV", "M_TILES", "NSPLIT",
                 "s_pkas", "s_pvas", "s_dkas", "s_dvas", "s_pkw", "s_dkw"]


@triton.jit(do_not_specialize=_MAIN_DYNAMIC)
def _decode_attention_kernel(
    q_ptr, sqb, sqh, sqq, lim_ptr, rows_ptr, pos_ptr, spos, freq_ptr, attn_scale, sm_scale, window,
    sink_k, sink_v, s_sink_h, buf_k, buf_v, s_buf_h,
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
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = pid // M_TILES
    mt = pid % M_TILES
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

    m_offs = mt * 16 + tl.arange(0, 16)
    mvalid = m_offs < G * QL
    g = m_offs // QL
    qi = m_offs % QL
    h_offs = tl.arange(0, HALF)
    q_rows = q_ptr + b64 * sqb + (kvh * G + g) * sqh + qi * sqq
    # the softmax scale (log2 units) and the rotary attention_scaling are folded into the query once: q·(a R k)·s
    # = (a s q)·(R k), so neither is applied per key element or per score
    q_scale = attn_scale * sm_scale
    q1 = tl.load(q_rows[:, None] + h_offs[None, :], mask=mvalid[:, None], other=0.0).to(tl.float32) * q_scale
    q2 = tl.load(q_rows[:, None] + HALF + h_offs[None, :], mask=mvalid[:, None], other=0.0).to(tl.float32) * q_scale
    freq = tl.load(freq_ptr + h_offs)
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

    for blk in range(tl.maximum(lo, e3), hi):
        slot = (blk - e3) * BN + n_offs
        tvalid = slot < f_len
        t = s_len + p_len + c_cnt * NB + slot
        m_i, l_i, acc = _dense_block(q1, q2, buf_k + bh64 * s_buf_h, buf_v + bh64 * s_buf_h, D, t, slot, tvalid,
                                     pos_b, freq, limit, mvalid, window,
                                     m_i, l_i, acc, had_ptr, D, HALF, DT, FAST, ROT_V)

    ws = pid.to(tl.int64) * NSPLIT + split
    r16 = tl.arange(0, 16)
    tl.store(acc_ptr + ws * (16 * D) + r16[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(ml_ptr + ws * 32 + r16, m_i)
    tl.store(ml_ptr + ws * 32 + 16 + r16, l_i)


@triton.jit(do_not_specialize=["sob", "soq", "soh", "H_KV", "M_TILES", "NSPLIT"])
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, sob, soq, soh, H_KV, M_TILES, NSPLIT, had_ptr,
                    G: tl.constexpr, QL: tl.constexpr, D: tl.constexpr, ROT_V: tl.constexpr):
    """out[b, qi, kvh*G + g] = merge of the splits' (m, l, acc) for query row m = g*QL + qi. ROT_V: the values
    were attended in the rotated basis, P·(V·H)·H = P·V: un-rotated here, once per output row."""
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
    g = m // QL
    qi = m % QL
    o = out_ptr + b.to(tl.int64) * sob + qi * soq + (kvh * G + g) * soh + d_offs
    tl.store(o, out.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
def _check(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (GEAR storage always is)")
    return t


def _check_words(t: torch.Tensor, name: str) -> torch.Tensor:
    """Tensors the kernel reads as 32-bit words (2/4/8-bit codes: rows of d*bits/8 or d bytes; 16-bit sink and
    buffer tokens and key statistics: rows of d elements) hold whole words per row, so they must start on a
    4-byte boundary (torch allocations always do)."""
    if t.data_ptr() % 4:
        raise ValueError(f"{name} must start on a 4-byte boundary (read as 32-bit words), got address "
                         f"{t.data_ptr():#x}")
    return t


def _rank(run: ChunkRunView, prefix: str) -> int:
    r = run.lowrank_a.shape[-1]
    if r > MAX_FUSED_RANK:
        raise NotImplementedError(f"fused kernel: {prefix} low-rank rank {r} > {MAX_FUSED_RANK} (the torch path "
                                  "reads it)")
    return r


_NO_KEYS = {"BITS": 0, "UNIT": 1, "GROUP": 1, "R": 0, "SPARSE": False, "STATS_ROW": False, "PLANES": False, "ROW": 1}
_NO_VALUES = {"BITS": 0, "UNIT": 1, "GROUP": 1, "R": 0, "K2": 0, "CODES_W": 1, "STATS_W": 1, "BY_CHANNEL": False,
              "STATS_ROW": False}


def _key_run_args(run: ChunkRunView | None, chunks_used: int, dummy: torch.Tensor, head_dim: int, prefix: str,
                  block_n: int):
    """(pointers, strides, constexprs) of a key run for the kernel; outliers sorted by `prepare_derived`
    (taken from run.derived when the cache provides it, else derived here: a per-step cost)."""
    if run is None or chunks_used == 0:
        return [dummy] * 8, [0] * 6 + [1, 0], {f"{prefix}_{k}": v for k, v in _NO_KEYS.items()}
    f = {name: _check(getattr(run, name), f"{prefix}.{name}") for name in
         ("codes", "scale", "minimum", "lowrank_a", "lowrank_b")}
    spec = run.spec
    if spec.axis != "channel":
        raise NotImplementedError("fused kernel: keys must be stored per channel (key_axis='channel')")
    grouped = _token_grouped_constexprs(run, head_dim, prefix, block_n)
    k2 = key_outlier_count(run)
    if k2 and spec.rotate:
        raise NotImplementedError("fused kernel: key outliers of rotated keys (rotation='keys'/'both' with a sparse "
                                  "term) are only applied by the torch path")
    derived = {}
    if k2:
        derived = run.derived or _derived_for(run, chunks_used)
        for name in ("key_outlier_where", "key_outlier_value", "key_outlier_tile"):
            if name not in derived:
                raise ValueError(f"{prefix}: run.derived lacks {name!r} (use gear_hf.kernels.views.prepare_derived)")
            _check(derived[name], f"{prefix}.derived.{name}")
        where, value, tile = derived["key_outlier_where"], derived["key_outlier_value"], derived["key_outlier_tile"]
        if where.shape[2] < chunks_used * k2 * head_dim or tile.shape[2] < chunks_used:
            raise ValueError(f"{prefix}: run.derived covers fewer than the {chunks_used} chunks in use")
    else:
        where = value = tile = dummy
    tiles = -(-run.chunk_len // OUTLIER_TILE)
    ptrs = [f["codes"], f["scale"], f["minimum"], f["lowrank_a"], f["lowrank_b"], where, value, tile]
    strides = [f["codes"].stride(1), f["scale"].stride(1), f["lowrank_a"].stride(1), f["lowrank_b"].stride(1),
               where.stride(1) if k2 else 0, tile.stride(1) if k2 else 0, tiles, k2 * head_dim]
    # PLANES: widths per channel, codes in bit planes of ROW bytes per 8 tokens (else ROW = head_dim bytes per row)
    constexprs = {**grouped, "R": _rank(run, prefix), "SPARSE": k2 > 0, "PLANES": spec.allocated,
                  "ROW": run.codes.shape[-1] if spec.allocated else head_dim}
    return ptrs, strides, {f"{prefix}_{k}": v for k, v in constexprs.items()}


def _token_grouped_constexprs(run: ChunkRunView, head_dim: int, prefix: str, block_n: int) -> dict:
    """Checks and constexprs of a run stored per channel over token groups (keys; values with
    value_axis="channel"): codes packed along tokens, read as 32-bit words of 4 channels' bytes (2/4/8 bits), one
    row of statistics per group (STATS_ROW: once per block when a group spans whole blocks)."""
    spec = run.spec
    group = spec.group_for(run.chunk_len, head_dim)
    unit = codes_per_unit(spec.bits, spec.allocated)
    if run.chunk_len % unit or group % unit:
        raise NotImplementedError(f"fused kernel: chunk of {run.chunk_len} tokens / group {group} does not align "
                                  f"with packing units of {unit} codes")
    if spec.bits != 3 and not spec.allocated:
        _check_words(run.codes, f"{prefix}.codes")
    _check_words(run.scale, f"{prefix}.scale"), _check_words(run.minimum, f"{prefix}.minimum")
    # widths per channel (keys only): BITS only marks the run present (the widths are read per chunk)
    return {"BITS": MAX_CHANNEL_BITS if spec.allocated else spec.bits, "UNIT": unit, "GROUP": group,
            "STATS_ROW": group % block_n == 0}


def _value_run_args(run: ChunkRunView | None, chunks_used: int, dummy: torch.Tensor, head_dim: int, prefix: str,
                    block_n: int):
    if run is None or chunks_used == 0:
        return [dummy] * 7, [0] * 5, {f"{prefix}_{k}": v for k, v in _NO_VALUES.items()}
    names = ("codes", "scale", "minimum", "sparse_values", "sparse_index", "lowrank_a", "lowrank_b")
    f = {name: _check(getattr(run, name), f"{prefix}.{name}") for name in names}
    spec = run.spec
    # row strides of codes and statistics within a head: the fields' last dims (CODES_W, STATS_W)
    widths = {"CODES_W": f["codes"].shape[-1], "STATS_W": f["scale"].shape[-1], "R": _rank(run, prefix)}
    if spec.axis == "channel":  # the keys' layout ([B,H,P(n),d] codes, [B,H,n/g,d] statistics)
        if f["sparse_values"].shape[2]:
            raise NotImplementedError("fused kernel: outliers of values stored per channel (value_axis='channel' "
                                      "with a sparse term) are only applied by the torch path")
        constexprs = {**_token_grouped_constexprs(run, head_dim, prefix, block_n), **widths, "K2": 0,
                      "BY_CHANNEL": True}
    else:
        if spec.bits != 3:
            _check_words(run.codes, f"{prefix}.codes")
        constexprs = {"BITS": spec.bits, "UNIT": pack_unit(spec.bits)[0],
                      "GROUP": spec.group_for(run.chunk_len, head_dim), **widths, "K2": f["sparse_values"].shape[-1],
                      "BY_CHANNEL": False, "STATS_ROW": False}
    strides = [f[n].stride(1) for n in ("codes", "scale", "sparse_values", "lowrank_a", "lowrank_b")]
    return [f[n] for n in names], strides, {f"{prefix}_{k}": v for k, v in constexprs.items()}


def _key_widths_args(run: ChunkRunView | None, dummy: torch.Tensor, prefix: str) -> list:
    """[widths per channel (uint8 [B,H,chunks,D]), their head stride] of an allocated key run, else placeholders."""
    if run is None or not run.spec.allocated:
        return [dummy, 0]
    widths = _check(run.channel_bits, f"{prefix}.channel_bits")
    return [widths, widths.stride(1)]


def _factor_scale_args(run: ChunkRunView | None, dummy: torch.Tensor, prefix: str) -> list:
    """[A's scales, B's scales, their head stride] of a run with int8 low-rank factors, else placeholders."""
    if run is None or run.lowrank_a.dtype != torch.int8:
        return [dummy, dummy, 0]
    a_scale = _check(run.lowrank_a_scale, f"{prefix}.lowrank_a_scale")
    b_scale = _check(run.lowrank_b_scale, f"{prefix}.lowrank_b_scale")
    if a_scale.shape != b_scale.shape or a_scale.shape[2] != run.capacity:
        raise ValueError(f"{prefix}: int8 factor scales must be [B, H, capacity={run.capacity}, r], got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    return [a_scale, b_scale, a_scale.stride(1)]


def _rotated(runs: list, what: str) -> bool:
    """Whether the compressed runs in use store `what` Walsh–Hadamard-rotated (all of them or none)."""
    flags = {bool(run.spec.rotate) for run in runs if run is not None}
    if len(flags) > 1:
        raise ValueError(f"fused kernel: the prompt and decode chunks disagree on whether {what} are rotated")
    return flags == {True}


# Key-outlier orderings derived by decode_attention itself (when the cache passes no run.derived), kept per
# sparse_values tensor (by identity; dropped with it) while it is unchanged: its in-place version counter and
# the chunks in use.
_DERIVED_MEMO: dict[int, tuple] = {}


def _derived_for(run: ChunkRunView, chunks_used: int) -> dict:
    tensor = run.sparse_values
    key = (tensor._version, run.sparse_index._version, chunks_used, tuple(tensor.shape))
    hit = _DERIVED_MEMO.get(id(tensor))
    if hit is not None and hit[0]() is tensor and hit[1] == key:
        return hit[2]
    derived = prepare_derived(run, chunks_used)
    ident = id(tensor)
    _DERIVED_MEMO[ident] = (weakref.ref(tensor, lambda _: _DERIVED_MEMO.pop(ident, None)), key, derived)
    return derived


def _launch(kernel, grid, args, kwargs, plan: list | None):
    """Run kernel[grid](*args, **kwargs) and return the compiled kernel, or only record the launch in `plan`
    (gear_hf.kernels.compile_check) and return None."""
    if plan is None:
        return kernel[grid](*args, **kwargs)
    plan.append((kernel, grid, args, kwargs))
    return None


_SM_COUNT: dict[int, int] = {}
# Programs of the main kernel resident per SM, learned from its register count after the first launch of a
# configuration (key: device, warps, block, dtype, key/value bits); 1 until then.
_RESIDENT: dict[tuple, int] = {}


def _num_splits(max_blocks: int, programs: int, device: torch.device, resident: int) -> int:
    """Splits of each program's token range so the grid fills whole waves of the GPU (`resident` programs per
    SM), at least about two blocks per split."""
    if max_blocks <= 1:
        return 1
    if device.type != "cuda":
        return min(2, max_blocks)
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    slots = resident * _SM_COUNT[device.index]
    best, best_cost = 1, None
    for ns in range(1, min(64, max(1, max_blocks // 2)) + 1):
        waves = -(-programs * ns // slots)
        cost = waves / ns + 0.01 * ns  # time ~ waves x per-split work, plus merging more splits
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = ns, cost
    return best


def _resident_programs(compiled, num_warps: int) -> int:
    """Programs per SM that the register file allows (65536 registers, allocated per warp in units of 8 per
    thread), at most 8."""
    regs = getattr(compiled, "n_regs", 0) or 0
    if regs <= 0:
        return 1
    per_program = -(-regs // 8) * 8 * 32 * num_warps
    return max(1, min(8, 65536 // per_program))


_HADAMARD: dict[tuple, torch.Tensor] = {}


def _hadamard_table(n: int, dot_dtype, device: torch.device) -> torch.Tensor:
    """The Sylvester matrix of n (±1, exact) in the kernel's dot dtype, built once per size, dtype and device."""
    dtype = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}.get(dot_dtype, torch.float32)
    key = (n, dtype, str(device))
    if key not in _HADAMARD:
        from ..compress.rotation import hadamard

        _HADAMARD[key] = (hadamard(n) * n ** 0.5).round().to(device=device, dtype=dtype).contiguous()
    return _HADAMARD[key]


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """float32 scratch of at least `numel` elements, cached per device and stream (grown, never shrunk)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(max(numel, 2 * ws.numel() if ws is not None else 0), dtype=torch.float32, device=device)
        _WORKSPACES[key] = ws
    return ws


def decode_attention(query: torch.Tensor, keys: StreamView, values: StreamView, layout: DecodeLayout, *,
                     scaling: float, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                     sliding_window: int | None = None, out: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, _plan: list | None = None) -> torch.Tensor:
    """Attention of `query` [B,Hq,q,d] (already rotated) over one layer's compressed keys/values.

    keys/values: where the layer's tokens live (`views.StreamView`); layout: per-row lengths and positions
    (`views.DecodeLayout`). Returns out [B, q, Hq, d] in query's dtype (HF's attention-function layout).
    Tuning: num_splits (flash-decoding splits; default sized to whole waves), block_n (tokens per block),
    num_warps, num_stages. _plan: record the launches in this list instead of running them (compile_check).
    """
    if _plan is None and query.device.type != "cuda" and not interpreting():
        raise RuntimeError("gear_hf fused attention needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "gear_hf.kernels modules are imported (CPU interpreter)")
    B, Hq, QL, D = query.shape
    if D < 32 or D & (D - 1):
        raise NotImplementedError(f"fused kernel: head_dim {D} must be a power of two >= 32")
    buf_k = _check_words(_check(keys.buffer, "buffer keys"), "buffer keys")
    buf_v = _check_words(_check(values.buffer, "buffer values"), "buffer values")
    Hkv = buf_k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split into {Hkv} KV heads")
    G = Hq // Hkv
    M = G * QL
    m_tiles = -(-M // M_TILE)
    HALF = D // 2
    dtype = query.dtype
    if dtype not in _TL:
        raise TypeError(f"fused kernel: query dtype {dtype} (fp16, bf16 or fp32)")
    if tuple(layout.rows.shape) != (B, 4) or tuple(layout.limits.shape) != (B, QL):
        raise ValueError(f"layout.rows must be [B, 4] = {(B, 4)} and layout.limits [B, q] = {(B, QL)}, got "
                         f"{tuple(layout.rows.shape)} and {tuple(layout.limits.shape)}")
    for name in ("rows", "limits", "positions"):
        t = getattr(layout, name)
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"layout.{name} must be int32 on {query.device}, got {t.dtype} on {t.device}")
    dot_dt = tl.float32 if (dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())) else _TL[dtype]
    fast = _libdevice is not None and not interpreting()  # hardware sin/cos (the interpreter has none)
    if query.stride(-1) != 1:
        query = query.contiguous()

    has_sink = keys.sink is not None and layout.max_sink > 0
    if has_sink:
        _check_words(_check(keys.sink, "sink keys"), "sink keys")
        _check_words(_check(values.sink, "sink values"), "sink values")
    if (keys.prompt is None) != (values.prompt is None) or (keys.decode is None) != (values.decode is None):
        raise ValueError("keys and values disagree on which chunk runs exist")
    NB = layout.buffer_size
    if block_n is None:  # 32-token tiles: no register spills at head_dim 128 with the default launch (see below)
        block_n = min(32, NB & -NB)
    decode_chunks = layout.max_decode_chunks if keys.decode is not None else 0
    if block_n < 16 or block_n & (block_n - 1) or (decode_chunks and NB % block_n):
        raise NotImplementedError(f"fused kernel: a block of {block_n} tokens must be a power of two >= 16 "
                                  f"dividing buffer_size={NB}")
    prompt_chunks = 1 if (keys.prompt is not None and layout.max_prompt > 0) else 0
    pk_ptrs, pk_strides, pk_c = _key_run_args(keys.prompt, prompt_chunks, query, D, "P_K", block_n)
    pv_ptrs, pv_strides, pv_c = _value_run_args(values.prompt, prompt_chunks, query, D, "P_V", block_n)
    dk_ptrs, dk_strides, dk_c = _key_run_args(keys.decode, decode_chunks, query, D, "D_K", block_n)
    dv_ptrs, dv_strides, dv_c = _value_run_args(values.decode, decode_chunks, query, D, "D_V", block_n)
    used = [(keys.prompt, values.prompt)] if prompt_chunks else []
    used += [(keys.decode, values.decode)] if decode_chunks else []
    rot_k = _rotated([k for k, _ in used], "keys")
    rot_v = _rotated([v for _, v in used], "values")
    pk_fs = _factor_scale_args(keys.prompt if prompt_chunks else None, query, "P_K")
    pv_fs = _factor_scale_args(values.prompt if prompt_chunks else None, query, "P_V")
    dk_fs = _factor_scale_args(keys.decode if decode_chunks else None, query, "D_K")
    dv_fs = _factor_scale_args(values.decode if decode_chunks else None, query, "D_V")
    if decode_chunks and keys.decode.chunk_len != NB:
        raise ValueError(f"decode chunks hold {keys.decode.chunk_len} tokens but layout.buffer_size is {NB}")

    max_blocks = (-(-layout.max_sink // block_n) + -(-layout.max_prompt // block_n)
                  + layout.max_decode_chunks * (NB // block_n) + -(-layout.max_buffer // block_n))
    freq = inv_freq if inv_freq.dtype == torch.float32 and inv_freq.device == query.device else \
        inv_freq.to(device=query.device, dtype=torch.float32)
    freq = freq.contiguous()
    if freq.numel() != HALF:
        raise ValueError(f"inv_freq has {freq.numel()} entries, expected head_dim/2 = {HALF}")

    with torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext():
        programs = B * Hkv * m_tiles
        if num_warps is None:
            # Default launch: 4 warps, no software pipelining. Why: on the H200 (results/gpu, the earlier kernel)
            # 4 warps / 1 stage was 2.8x faster than 8 warps / 3 stages; and the compile report (sm_90, head_dim
            # 128, 32-token blocks) counts fewer main-loop instructions per token at 4 warps (the 16-row query tile
            # splits badly over 8 warps) with 0 spills for gear 2/4, kivi, gear-l and GearConfig() (gear-3: 40 B of
            # stack). 64-token blocks count fewer still but spill with outliers or rotation. Not yet timed on a GPU
            # for this kernel.
            # float32 dots (a float32 model) are FMA loops that need 8 warps' registers to stay unspilled.
            num_warps = 8 if dot_dt == tl.float32 else 4
        if num_stages is None:
            num_stages = 1
        resident_key = (query.device.index, num_warps, block_n, dtype, pk_c["P_K_BITS"], pv_c["P_V_BITS"],
                        dk_c["D_K_BITS"], dv_c["D_V_BITS"])
        nsplit = num_splits or _num_splits(max_blocks, programs, query.device, _RESIDENT.get(resident_key, 1))
        nsplit = max(1, min(int(nsplit), 64))
        n_acc = programs * nsplit * M_TILE * D
        ws = _workspace(query.device, n_acc + programs * nsplit * 2 * M_TILE)
        acc_ws, ml_ws = ws[:n_acc], ws[n_acc:]
        if out is None:
            out = torch.empty(B, QL, Hq, D, dtype=dtype, device=query.device)
        elif tuple(out.shape) != (B, QL, Hq, D) or out.stride(-1) != 1:
            raise ValueError(f"out must be [B, q, Hq, d] = {(B, QL, Hq, D)} with a contiguous last dim")
        window = int(sliding_window or 0)
        had = _hadamard_table(HALF, dot_dt, query.device) if rot_k or rot_v else query
        options = {"num_warps": num_warps, "num_stages": num_stages}
        compiled = _launch(_decode_attention_kernel, (programs, nsplit), (
            query, query.stride(0), query.stride(1), query.stride(2), layout.limits, layout.rows, layout.positions,
            layout.positions.stride(0), freq, float(attention_scaling), float(scaling) * LOG2E, window,
            keys.sink if has_sink else query, values.sink if has_sink else query,
            keys.sink.stride(1) if has_sink else 0, buf_k, buf_v, buf_k.stride(1),
            *pk_ptrs[:5], *pk_strides[:4], *pk_ptrs[5:], *pk_strides[4:], *pk_fs,
            *_key_widths_args(keys.prompt if prompt_chunks else None, query, "P_K"),
            *pv_ptrs, *pv_strides, *pv_fs,
            *dk_ptrs[:5], *dk_strides[:4], *dk_ptrs[5:], dk_strides[4], dk_strides[5], dk_strides[7], *dk_fs,
            *_key_widths_args(keys.decode if decode_chunks else None, query, "D_K"),
            *dv_ptrs, *dv_strides, *dv_fs,
            had, acc_ws, ml_ws, Hkv, m_tiles, nsplit),
            dict(G=G, QL=QL, D=D, HALF=HALF, BN=block_n, NB=NB, DT=dot_dt, FAST=fast, HAS_SINK=has_sink,
                 ROT_K=rot_k, ROT_V=rot_v,
                 **pk_c, **pv_c, **dk_c, **dv_c, **options), _plan)
        if compiled is not None and resident_key not in _RESIDENT and query.device.type == "cuda":
            _RESIDENT[resident_key] = _resident_programs(compiled, num_warps)
        _launch(_combine_kernel, (B * Hkv, M), (acc_ws, ml_ws, out, out.stride(0), out.stride(1), out.stride(2),
                                                Hkv, m_tiles, nsplit, had), dict(G=G, QL=QL, D=D, ROT_V=rot_v,
                                                                                num_warps=4), _plan)
    return out


def cache_decode_attention(cache, layer_idx: int, query: torch.Tensor, *, scaling: float,
                           inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           **tuning) -> torch.Tensor:
    """Fused attention of `query` [B,Hq,q,d] over layer `layer_idx` of a GearCache (`GearCache.kernel_views`:
    during a step what it attends to, between steps what the layer holds). Returns [B, q, Hq, d]."""
    keys, values, layout = cache.kernel_views(layer_idx, query.shape[2], query.device)
    return decode_attention(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                            attention_scaling=attention_scaling, sliding_window=sliding_window, out=out, **tuning)
