"""CPU compression kernel, packing (numba): a plane's codes packed as `quant.pack_codes` packs them (2/3/4/8 bits
along tokens or channels) or, for widths per channel, as bit planes (`quant.pack_planes`, through an 8x8 bit
transpose that the read kernels also use). Used by `compress._compress` and `read`."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit
def _pack(codes, bits, channel_axis, out):
    """quant.pack_codes of codes [n, d] along tokens (channel_axis) or channels (out [n, P], zero past d)."""
    n, d = codes.shape
    if bits == 8:
        for t in range(n):
            for c in range(d):
                out[t, c] = codes[t, c]
    elif channel_axis and bits != 3:  # (channels innermost: the loops vectorize)
        per = 8 // bits
        for r in range(n // per):
            for c in range(d):
                out[r, c] = codes[r * per, c]
            for j in range(1, per):
                for c in range(d):
                    out[r, c] |= np.uint8(codes[r * per + j, c] << (bits * j))
    elif channel_axis:  # 3 bits: 8 tokens in 3 bytes (2-bit planes of tokens 0-3 and 4-7, then the high bits)
        for u in range(n // 8):
            for c in range(d):
                out[3 * u, c], out[3 * u + 1, c], out[3 * u + 2, c] = 0, 0, 0
            for j in range(8):
                for c in range(d):
                    code = codes[8 * u + j, c]
                    out[3 * u + j // 4, c] |= np.uint8((code & 3) << (2 * (j % 4)))
                    out[3 * u + 2, c] |= np.uint8((code >> 2) << j)
    elif bits != 3:  # along channels: byte p holds codes p*per .. p*per+per-1 (zeros past d)
        per = 8 // bits
        for t in range(n):
            for p in range(out.shape[1]):
                byte = np.uint8(0)
                for j in range(per):
                    c = p * per + j
                    byte |= np.uint8((codes[t, c] if c < d else 0) << (bits * j))
                out[t, p] = byte
    else:  # 3 bits along channels: units of 8 channels in 3 bytes
        for t in range(n):
            for u in range(out.shape[1] // 3):
                low0, low1, high = np.uint8(0), np.uint8(0), np.uint8(0)
                for j in range(8):
                    c = 8 * u + j
                    code = codes[t, c] if c < d else 0
                    if j < 4:
                        low0 |= np.uint8((code & 3) << (2 * j))
                    else:
                        low1 |= np.uint8((code & 3) << (2 * (j - 4)))
                    high |= np.uint8((code >> 2) << j)
                out[t, 3 * u], out[t, 3 * u + 1], out[t, 3 * u + 2] = low0, low1, high


@numba.njit
def transpose_bits8(word):
    """A uint64 as an 8x8 bit matrix (byte r = row r) transposed: bit c of byte r becomes bit r of byte c, as
    `quant._transpose_bits8` (three masked swaps). Codes of 8 tokens <-> their bit planes."""
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        swap = (word ^ (word >> np.uint64(shift))) & np.uint64(mask)
        word ^= swap ^ (swap << np.uint64(shift))
    return word


@numba.njit
def _pack_planes(codes, widths, out):
    """quant.pack_planes of codes [n, d] with widths [d]: per 8 tokens, channel c's planes (bit t of plane j = bit
    j of token t's code) at bytes [start_c, start_c + widths[c]) of out [n/8, S], start_c the widths before c. The
    8 codes of a channel, as the bytes of one word, become its planes by an 8x8 bit transpose."""
    n, d = codes.shape
    for u in range(n // 8):
        start = 0
        for c in range(d):
            word = np.uint64(0)
            for t in range(8):
                word |= np.uint64(codes[8 * u + t, c]) << np.uint64(8 * t)
            word = transpose_bits8(word)
            for j in range(widths[c]):
                out[u, start + j] = (word >> np.uint64(8 * j)) & np.uint64(0xFF)
            start += widths[c]
