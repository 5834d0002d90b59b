"""Codes straight into 16-bit dot operands for the tensor-core decode kernel (`tc_tiles`), with the "magic number"
trick: a code c OR-ed into the mantissa of a 16-bit float whose unit in the last place is 1 is that float's value
plus c, exactly (fp16 0x6400 = 1024.0: c < 1024; bf16 0x4300 = 128.0: c < 128). Two codes are built in one 32-bit
word (one per half) by shifts and masks, and the word's halves are read as two 16-bit floats (no integer-to-float
conversion, no packing of converted floats). The caller subtracts the magic value where it is cheaper than per
element: with values folded into the probabilities, P·(magic + c) - magic·rowsum(P).

Plain integer ops: Triton's CPU interpreter runs them (so tests/test_kernels_tc.py checks them against the oracle),
and on the GPU the halves of a word cost nothing (the 16-bit registers of the word itself)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def magic_of(MT: tl.constexpr, BITS: tl.constexpr):
    """(bits of the magic 16-bit float for codes of BITS bits in dtype MT, or 0 where none is exact, its value), as
    run-time scalars: what a jit function returns is a tensor to the compiler, never a constexpr, so kernel code that
    needs them at compile time spells them out under a static `if` on MT (`value_codes_magic`, `tc_tiles`)."""
    if MT == tl.float16:
        return 0x6400, 1024.0
    else:
        tl.static_assert(MT == tl.bfloat16, "16-bit floats only")
        if BITS <= 7:
            return 0x4300, 128.0
        else:
            return 0, 0.0


@triton.jit
def _halves(w, MT: tl.constexpr):
    """The two 16-bit floats of dtype MT in the low and high halves of int32 words w [...]: [..., 2]."""
    lo = w.to(tl.int16).to(MT, bitcast=True)
    hi = (w >> 16).to(tl.int16).to(MT, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _pairs_3bit(lo, hb, MAGIC2: tl.constexpr):
    """The 4 pair words [R, C, 4] of 3-bit units (`unpack._unit_3bit`'s layout) given as their 2-bit plane lo [R, C]
    (bits 0-15, code j's low bits at 2j) and their 1-bit plane hb [R, C] (bits 0-7, code j's bit 2 at j): word i
    holds MAGIC2 | code 2i in bits 0-2 | code 2i + 1 in bits 16-18."""
    lo = lo | (lo << 14)  # code 2i's low bits at 4i, code 2i + 1's at 16 + 4i (bits 14, 15 are never read)
    hb = (hb << 2) | (hb << 17)  # code 2i's bit 2 at 2 + 2i, code 2i + 1's at 18 + 2i
    return _join4i(((lo & 0x00030003) | MAGIC2) | (hb & 0x00040004),
                   (((lo >> 4) & 0x00030003) | MAGIC2) | ((hb >> 2) & 0x00040004),
                   (((lo >> 8) & 0x00030003) | MAGIC2) | ((hb >> 4) & 0x00040004),
                   (((lo >> 12) & 0x00030003) | MAGIC2) | ((hb >> 6) & 0x00040004))


@triton.jit
def _join4i(c0, c1, c2, c3):
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [c0.shape[0], c0.shape[1], 4])


@triton.jit
def value_codes_magic(codes_b, s_codes, slot, tvalid, D: tl.constexpr, BITS: tl.constexpr, MT: tl.constexpr):
    """Value codes (axis="token", 3-bit units of `gear_hf.compress.quant`, rows of 3D/8 bytes at store slots `slot`
    [BN]) as magic 16-bit floats of dtype MT [BN, D]: magic + code (`magic_of(MT, 3)`); masked rows read code 0.
    Rows are read as 32-bit words: three words hold 4 units (32 codes), so D % 32 == 0."""
    tl.static_assert(BITS == 3, "3-bit units")
    tl.static_assert(D % 32 == 0, "rows of whole 3-word groups")
    BN: tl.constexpr = slot.shape[0]
    if MT == tl.float16:  # magic_of(MT, 3)[0], as a constexpr
        MBITS: tl.constexpr = 0x6400
    else:
        tl.static_assert(MT == tl.bfloat16, "16-bit floats only")
        MBITS: tl.constexpr = 0x4300
    MAGIC2: tl.constexpr = MBITS | (MBITS << 16)
    G3: tl.constexpr = D // 32
    rows = (codes_b + slot[:, None] * s_codes).to(tl.pointer_type(tl.int32)) + (tl.arange(0, G3) * 3)[None, :]
    m2 = tvalid[:, None]
    w0 = tl.load(rows, mask=m2, other=0)
    w1 = tl.load(rows + 1, mask=m2, other=0)
    w2 = tl.load(rows + 2, mask=m2, other=0)
    # the 4 units of the 3 words: bits 0-23 of w0, 24-31 of w0 + 0-15 of w1, 16-31 of w1 + 0-7 of w2, 8-31 of w2
    p0 = _pairs_3bit(w0 & 0xFFFF, (w0 >> 16) & 0xFF, MAGIC2)
    p1 = _pairs_3bit(((w0 >> 24) & 0xFF) | ((w1 & 0xFF) << 8), (w1 >> 8) & 0xFF, MAGIC2)
    p2 = _pairs_3bit((w1 >> 16) & 0xFFFF, w2 & 0xFF, MAGIC2)
    p3 = _pairs_3bit((w2 >> 8) & 0xFFFF, (w2 >> 24) & 0xFF, MAGIC2)
    x = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [BN, G3, 4, 2, 2]: [..., i, a, b] = unit 2a + b, pair i
    words = tl.reshape(tl.permute(x, (0, 1, 3, 4, 2)), [BN, G3 * 16])  # pair 4u + i of each group: codes 8u + 2i, +1
    return tl.reshape(_halves(words, MT), [BN, D])

