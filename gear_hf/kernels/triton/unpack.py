"""Unpacking of GEAR's packed codes and 16-bit rows in registers (the layouts of gear_hf.compress.quant): 32-bit
words of 2/4/8-bit codes, 3-bit units of 3 bytes, bit planes of widths allocated per channel."""

from __future__ import annotations

import triton
import triton.language as tl


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
def _unit_3bit(u):
    """The 8 codes [R, C, 8] of the 3-bit units in bits 0-23 of u [R, C] (bytes b0, b1: the 2-bit plane, code j
    at bits 2j; byte 2: the 1-bit plane, code j's bit 2 at bit 16 + j; bits above 23 ignored)."""
    return _join8(u & 3 | (u >> 14) & 4, (u >> 2) & 3 | (u >> 15) & 4, (u >> 4) & 3 | (u >> 16) & 4,
                  (u >> 6) & 3 | (u >> 17) & 4, (u >> 8) & 3 | (u >> 18) & 4, (u >> 10) & 3 | (u >> 19) & 4,
                  (u >> 12) & 3 | (u >> 20) & 4, (u >> 14) & 3 | (u >> 21) & 4)


@triton.jit
def _unpack_3bit_words(w0, w1, w2):
    """3-bit codes of the 4 packing units (8 codes in 3 bytes, `_unpack_3bit_units`' layout) in three consecutive
    little-endian 32-bit words w0, w1, w2 [R, C]: int32 [R, C, 32] in code order (unit u's at 8u..8u+7)."""
    c0 = _unit_3bit(w0)
    c1 = _unit_3bit(((w0 >> 24) & 255) | (w1 << 8))
    c2 = _unit_3bit(((w1 >> 16) & 65535) | (w2 << 16))
    c3 = _unit_3bit(w2 >> 8)
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [R, C, 8, 2, 2]: [..., j, a, b] = unit 2a + b, code j
    return tl.reshape(tl.permute(x, (0, 1, 3, 4, 2)), [w0.shape[0], w0.shape[1], 32])


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
def _plane_offsets(widths_b, ch0, C: tl.constexpr):
    """(widths, byte offsets) int32 [C] of channels [ch0, ch0 + C) in a row of bit planes (quant.pack_planes: per 8
    tokens, channel c's planes at byte offset sum(widths[:c])); ch0: 0, or C for the second half of a head;
    widths_b: the chunk's widths [D]."""
    c = tl.arange(0, C)
    widths = tl.load(widths_b + ch0 + c).to(tl.int32)
    before = tl.sum(tl.load(widths_b + c, mask=c < ch0, other=0).to(tl.int32), axis=0)  # the first half's bits
    return widths, before + tl.cumsum(widths, axis=0) - widths


@triton.jit
def _plane_bytes(codes_b, s_codes, widths, offset, slot0, slot_end, BN: tl.constexpr, C: tl.constexpr):
    """The planes of channels at byte `offset` [C] (`_plane_offsets`) of the 8-token rows of store slots
    slot0 + arange(BN) as two 32-bit words [BN/8, C]: byte j of lo: plane j, of hi: plane 4 + j (absent: 0)."""
    units = slot0 // 8 + tl.arange(0, BN // 8)
    row = codes_b + units[:, None] * s_codes + offset[None, :]
    live = (units * 8 < slot_end)[:, None]
    lo = tl.zeros([BN // 8, C], tl.int32)
    hi = tl.zeros([BN // 8, C], tl.int32)
    for j in tl.static_range(4):
        lo |= tl.load(row + j, mask=live & (j < widths)[None, :], other=0).to(tl.int32) << (8 * j)
        hi |= tl.load(row + 4 + j, mask=live & (4 + j < widths)[None, :], other=0).to(tl.int32) << (8 * j)
    return lo, hi


@triton.jit
def _plane_masks(widths, offset):
    """Per channel (`_plane_offsets`): which of the three 32-bit words from byte offset & ~3 its planes reach, and
    the masks of its planes in the words lo (planes 0-3) and hi (4-7) of `_plane_words`: (need1, need2, mlo, mhi)."""
    end = (offset & 3) + widths  # bytes from the first word's start
    w = widths.to(tl.int64)
    mlo = tl.where(w >= 4, -1, (1 << (8 * w)) - 1).to(tl.int32)
    mhi = tl.where(w >= 8, -1, tl.where(w <= 4, 0, (1 << (8 * (w - 4))) - 1)).to(tl.int32)
    return end > 4, end > 8, mlo, mhi


@triton.jit
def _plane_words(codes_b, s_codes, offset, need1, need2, mlo, mhi, slot0, slot_end, BN: tl.constexpr,
                 C: tl.constexpr):
    """`_plane_bytes` from 32-bit words (rows of whole words: s_codes % 4 == 0): the (up to) three aligned words
    holding a channel's planes, shifted into place (masks and needs: `_plane_masks`): 3 loads for 8 planes."""
    units = slot0 // 8 + tl.arange(0, BN // 8)
    rows = (codes_b + units[:, None] * s_codes).to(tl.pointer_type(tl.int32)) + (offset >> 2)[None, :]
    live = (units * 8 < slot_end)[:, None]
    shift = ((offset & 3) * 8).to(tl.int64)[None, :]
    w0 = tl.load(rows, mask=live, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
    w1 = tl.load(rows + 1, mask=live & need1[None, :], other=0).to(tl.uint32, bitcast=True).to(tl.int64)
    w2 = tl.load(rows + 2, mask=live & need2[None, :], other=0).to(tl.int64)
    lo = ((w0 | (w1 << 32)) >> shift).to(tl.int32) & mlo[None, :]
    hi = ((w1 | (w2 << 32)) >> shift).to(tl.int32) & mhi[None, :]
    return lo, hi


@triton.jit
def _planes_to_codes(lo, hi, BN: tl.constexpr, C: tl.constexpr):
    """Codes int32 [BN, C] of the plane words (lo, hi) [BN/8, C] of `_plane_bytes`."""
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
def _plane_codes(codes_b, s_codes, widths_b, slot0, slot_end, ch0, BN: tl.constexpr, C: tl.constexpr):
    """Codes of per-channel widths (quant.pack_planes: per 8 tokens, channel c's bit planes at byte offset
    sum(widths[:c]), plane j holding bit j of the 8 tokens' codes) of channels [ch0, ch0 + C) (ch0: 0, or C for the
    second half of a head) at store slots slot0 + arange(BN): int32 [BN, C]. widths_b: this chunk's widths [D]."""
    widths, offset = _plane_offsets(widths_b, ch0, C)
    lo, hi = _plane_bytes(codes_b, s_codes, widths, offset, slot0, slot_end, BN, C)
    return _planes_to_codes(lo, hi, BN, C)
