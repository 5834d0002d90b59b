"""The reconstruction kernel of the memory-bound fallback: a run of compressed chunks back to dense tokens.

One program per (row, head, chunk, BN-token block) decodes every term of the stored format in registers, with the
tiles of the fused decode kernel (`tiles`, `unpack`, `ops`), and writes the block once, in the output's dtype:

    backbone     codes of 2/3/4/8 bits, per channel over token groups (keys) or per token over channel groups
                 (values), or allocated per-channel key widths stored as bit planes; scale/minimum
    outliers     per token (values): each token's k slots, added where their channel is; per channel over tokens
                 (keys): the chunk's outliers sorted by token (`views.prepare_derived`, the store's derived state),
                 added through a one-hot dot (exact: one outlier per entry, 16-bit values, one-hots)
    low-rank     A·Bᵀ as one 16-wide tensor-core dot per block (16-bit or int8 factors with per-column scales)
    rotation     the Walsh–Hadamard basis undone ([x1 x2]·H_D from the half Sylvester table)
    RoPE         keys stored before RoPE rotated with the model's own cos/sin at each token's column

in the oracle's order (`gear_hf.compress.decompress`: dequantize, add the terms, untransform; then
`rope.apply_rotary`), all in float32 up to the one rounding of the store. Nothing is written but the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import _dot, _lowrank_a, _lowrank_bt, _lowrank_dot, _unrotate_halves
from .tiles import _per_channel_tile, _value_tile

OUTLIERS_PER_DOT = tl.constexpr(32)  # key outliers added per one-hot dot

# Strides and sizes that grow with the storage or differ per call: never specialized on (no recompiles).
_DYNAMIC = ["so_b", "so_h", "so_t", "sr_b", "sr_t", "s_codes", "s_stats", "s_sp", "s_ow", "s_ot", "s_la", "s_lb",
            "s_ls", "s_w", "H", "N", "N_TILES"]


@triton.jit
def _halves(x, BN: tl.constexpr, HALF: tl.constexpr):
    """[BN, 2*HALF] -> its two halves [BN, HALF] (channels [0, HALF) and [HALF, 2*HALF))."""
    return tl.split(tl.permute(tl.reshape(x, [BN, 2, HALF]), (0, 2, 1)))


@triton.jit
def _channel_outliers(x, ow_b, ov_b, ot_b, n_tiles, tok0, ch0, D: tl.constexpr, BN: tl.constexpr,
                      C: tl.constexpr, OE: tl.constexpr, DT: tl.constexpr):
    """x [BN, C] (chunk-local tokens [tok0, tok0+BN), channels [ch0, ch0+C)) + the chunk's outliers there.
    ow_b/ov_b: the chunk's outliers (token*D + channel, value) sorted by token; ot_b: its per-16-token offsets."""
    u0 = tok0 // 16
    lo = tl.load(ot_b + u0)
    hi = tl.load(ot_b + tl.minimum(u0 + BN // 16, n_tiles))
    LOG2D: tl.constexpr = D.bit_length() - 1
    n_offs = tl.arange(0, BN)
    c_offs = ch0 + tl.arange(0, C)
    for e0 in range(lo, hi, OE):
        e = e0 + tl.arange(0, OE)
        ev = e < hi
        where = tl.load(ow_b + e, mask=ev, other=0)
        val = tl.load(ov_b + e, mask=ev, other=0.0).to(tl.float32)
        onehot = tl.where((n_offs[:, None] == (where >> LOG2D)[None, :] - tok0) & ev[None, :], 1.0, 0.0)  # [BN, OE]
        w = tl.where((where & (D - 1))[:, None] == c_offs[None, :], val[:, None], 0.0)  # [OE, C]
        x += _dot(onehot, w, DT)
    return x


@triton.jit(do_not_specialize=_DYNAMIC)
def _reconstruct_kernel(
    out_ptr, so_b, so_h, so_t,  # [B,H,chunks*N,D] (strides; a slice of the step's workspace)
    cos_ptr, sin_ptr, sr_b, sr_t,  # [B|1,1,chunks*N,D] the model's cos/sin at the run's columns (ROPE)
    codes, scale, minimum, s_codes, s_stats,  # the backbone's fields (head strides; stats share one)
    spv, spi, s_sp,  # outliers per token [B,H,chunks*N,K2] (values), else placeholders
    ow, ov, ot, s_ow, s_ot, N_TILES,  # outliers per channel sorted by token (the store's derived), else placeholders
    la, lb, s_la, s_lb, las, lbs, s_ls,  # low-rank A [B,H,chunks*N,R], B [B,H,chunks*D,R], int8 scales
    widths, s_w,  # allocated key widths [B,H,chunks,D] (PLANES)
    had_ptr,  # [D/2, D/2] Sylvester matrix in the dot dtype (ROT)
    H, N,  # heads; tokens per chunk
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, BY_CHANNEL: tl.constexpr,
    BITS: tl.constexpr, UNIT: tl.constexpr, GROUP: tl.constexpr, STATS_ROW: tl.constexpr, PLANES: tl.constexpr,
    ROW: tl.constexpr, STATS_W: tl.constexpr, K2: tl.constexpr, CH_SPARSE: tl.constexpr, SEG: tl.constexpr,
    R: tl.constexpr, ROT: tl.constexpr, ROPE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    chunk = tl.program_id(1)
    blk = tl.program_id(2)
    b = pid_bh // H
    bh64 = pid_bh.to(tl.int64)
    tok0 = blk * BN  # chunk-local
    slot0 = chunk * N + tok0  # along the store's token axis (chunks one after the other)
    slot = slot0 + tl.arange(0, BN)
    tvalid = tok0 + tl.arange(0, BN) < N
    h_offs = tl.arange(0, HALF)
    a16 = _lowrank_a(la + bh64 * s_la, R, slot, tvalid, R, DT) if R > 0 else 0  # [BN, 16]
    if BY_CHANNEL:  # codes packed along tokens, a row of statistics per token group: one half of the head at a time
        if R > 0:
            bt1 = _lowrank_bt(lb + bh64 * s_lb, R, chunk * D + h_offs, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk,
                              R, DT)
            bt2 = _lowrank_bt(lb + bh64 * s_lb, R, chunk * D + HALF + h_offs, las + bh64 * s_ls, lbs + bh64 * s_ls,
                              chunk, R, DT)
        else:
            bt1 = 0
            bt2 = 0
        widths_b = widths + bh64 * s_w + chunk * D
        x1 = _per_channel_tile(codes + bh64 * s_codes, scale + bh64 * s_stats, minimum + bh64 * s_stats, ROW, D, slot,
                               slot0, chunk * N + N, tvalid, h_offs, 0, a16, bt1, widths_b, BITS, UNIT, GROUP, R,
                               STATS_ROW, DT, PLANES)
        x2 = _per_channel_tile(codes + bh64 * s_codes, scale + bh64 * s_stats, minimum + bh64 * s_stats, ROW, D, slot,
                               slot0, chunk * N + N, tvalid, h_offs + HALF, HALF, a16, bt2, widths_b, BITS, UNIT,
                               GROUP, R, STATS_ROW, DT, PLANES)
        if CH_SPARSE:
            seg = bh64 * s_ow + chunk * SEG
            tiles = ot + bh64 * s_ot + chunk * (N_TILES + 1)
            x1 = _channel_outliers(x1, ow + seg, ov + seg, tiles, N_TILES, tok0, 0, D, BN, HALF, OUTLIERS_PER_DOT, DT)
            x2 = _channel_outliers(x2, ow + seg, ov + seg, tiles, N_TILES, tok0, HALF, D, BN, HALF, OUTLIERS_PER_DOT,
                                   DT)
    else:  # codes packed along channels, statistics per channel group of each token, outliers per token
        x = _value_tile(codes + bh64 * s_codes, scale + bh64 * s_stats, minimum + bh64 * s_stats, spv + bh64 * s_sp,
                        spi + bh64 * s_sp, ROW, STATS_W, K2, slot, tvalid, D, BITS, UNIT, GROUP, K2, STATS_W)
        if R > 0:
            bt = _lowrank_bt(lb + bh64 * s_lb, R, chunk * D + tl.arange(0, D), las + bh64 * s_ls, lbs + bh64 * s_ls,
                             chunk, R, DT)
            x = _lowrank_dot(a16, bt, x, DT)
        x1, x2 = _halves(x, BN, HALF)
    if ROT:  # stored as x·H (Walsh–Hadamard): x·H·H = x
        x1, x2 = _unrotate_halves(x1, x2, had_ptr, D, DT)
    m2 = tvalid[:, None]
    if ROPE:  # HF's x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1], with the model's own tables
        rows = b.to(tl.int64) * sr_b + slot[:, None] * sr_t + h_offs[None, :]
        c1 = tl.load(cos_ptr + rows, mask=m2, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + rows + HALF, mask=m2, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rows, mask=m2, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + rows + HALF, mask=m2, other=0.0).to(tl.float32)
        x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    o = out_ptr + b.to(tl.int64) * so_b + (pid_bh % H).to(tl.int64) * so_h + slot[:, None] * so_t + h_offs[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(o, x1.to(ty), mask=m2)
    tl.store(o + HALF, x2.to(ty), mask=m2)
