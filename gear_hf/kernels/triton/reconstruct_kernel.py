"""The reconstruction kernel of the memory-bound fallback: a run of compressed chunks back to dense tokens.

One program per (row, head, chunk, TILES x BN tokens) decodes, tile after tile, every term of the stored format in
registers, with the tiles of the fused decode kernel (`tiles`, `unpack`, `ops`), and writes each BN-token tile once
in the output's dtype; what depends only on the chunk (low-rank Bᵀ, the Hadamard table) is read once, before the loop:

    backbone     codes of 2/3/4/8 bits, per channel over token groups (keys: masked in place in 32-bit words,
                 `_word_channel_tile`) or per token over channel groups (values), or allocated per-channel key
                 widths stored as bit planes; scale/minimum
    outliers     per token (values): each token's k slots; per channel over tokens (keys): the chunk's outliers
                 sorted by token (`views.prepare_derived`, the store's derived state). Unrotated runs: added after
                 the program's tiles are written (per token: after each tile), a read-modify-write of the outlier's
                 entry (and, with RoPE, of its rotary partner), a cost per outlier, not per element and slot.
                 Rotated runs (an outlier spreads over every channel once un-rotated): added in registers before
                 the un-rotation
    low-rank     A·Bᵀ as one 16-wide tensor-core dot per tile (16-bit or int8 factors with per-column scales), or,
                 for keys of rank <= 2 in 2/4/8-bit words, R float32 multiply-adds per element (B's columns once)
    rotation     the Walsh–Hadamard basis undone ([x1 x2]·H_D from the half Sylvester table; 3-bit values: D^-1/2
                 folded into the statistics, codes read as 32-bit words)
    RoPE         keys stored before RoPE rotated with the model's own cos/sin at each token's column: in float32, or,
                 for a bf16 model with bf16 tables, in bf16 arithmetic as the reference path computes it

in the oracle's order (`gear_hf.compress.decompress`: dequantize, add the terms, untransform; then
`rope.apply_rotary`), in float32 up to the rounding of the store (scattered outliers: their entries rounded twice,
once by the tile's store, once by the outlier's; bf16 RoPE: the reference path's roundings).
Its cost is counted by `python scripts/dev/compile_check.py --reconstruct-report` (`sass_reconstruct`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import _dot, _lowrank_a, _lowrank_bt, _lowrank_dot, _sylvester_halves, _unrotate_halves
from .reconstruct_tiles import _factor_row, _lowrank_fma, _plane_tile, _word_channel_tile
from .tiles import _token_stats, _value_tile
from .unpack import _plane_masks, _plane_offsets, _unpack_3bit_words

OUTLIERS_PER_STEP = tl.constexpr(32)  # key outliers read per step of the one-hot dot (rotated runs)
SCATTER_STEP = tl.constexpr(32)  # key outliers scattered per step (after the tiles: a cost per outlier)

# Sizes that differ per call: never specialized on (no recompiles). Strides are (their divisibility by 16 lets
# the compiler issue 16-byte loads and stores of rows; GEAR's storage and the workspace keep it).
_DYNAMIC = ["s_ow", "s_ot", "s_ls", "H", "N", "N_TILES"]


@triton.jit
def _halves(x, BN: tl.constexpr, HALF: tl.constexpr):
    """[BN, 2*HALF] -> its two halves [BN, HALF] (channels [0, HALF) and [HALF, 2*HALF))."""
    return tl.split(tl.permute(tl.reshape(x, [BN, 2, HALF]), (0, 2, 1)))


@triton.jit
def _channel_outliers(x, ow_b, ov_b, lo, hi, tok0, ch0, D: tl.constexpr, BN: tl.constexpr, C: tl.constexpr,
                      OE: tl.constexpr, DT: tl.constexpr):
    """x [BN, C] (chunk-local tokens [tok0, tok0+BN), channels [ch0, ch0+C)) + the chunk's outliers [lo, hi) there
    (ow_b/ov_b: token*D + channel, value; sorted by token), through one-hot dots (rotated runs)."""
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


@triton.jit
def _table_pairs(p, C: tl.constexpr):
    """The 16-bit (bf16/fp16) or float32 table entries p [R] + arange(C) as float32 (even, odd) columns [R, C/2]:
    a 16-bit pair is one 32-bit word (rows 4-byte aligned), split in registers with one op per entry."""
    # if/elif/else, no code after a returning branch: the compiler still generates what follows a static `if` that
    # returns (the fp16 bitcasts, invalid on float32 tables)
    ty: tl.constexpr = p.dtype.element_ty
    if ty == tl.float32:
        pairs = p[:, None] + 2 * tl.arange(0, C // 2)[None, :]
        even, odd = tl.load(pairs), tl.load(pairs + 1)
    else:
        w = tl.load(p.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, C // 2)[None, :])
        if ty == tl.bfloat16:  # a bf16 is the top half of the float32 with the same value
            even, odd = (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
        else:
            even = (w & 65535).to(tl.int16).to(ty, bitcast=True).to(tl.float32)
            odd = (w >> 16).to(tl.int16).to(ty, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _bf16(x):
    """float32 x rounded to the nearest bf16 (ties to even), kept in float32: integer operations, as the
    interpreter's bf16 arithmetic is not bf16's (finite x; what the GPU's conversion does)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rope_bf16(x1, x2, cos_row, sin_row, HALF: tl.constexpr, EMULATE: tl.constexpr):
    """`_rope_halves` of a bf16 model: in bf16 arithmetic on bf16 tables, as the reference path (`rope.apply_rotary`
    on the history reconstructed in the model dtype) and HF's apply_rotary_pos_emb compute it: x rounded to bf16
    first, then x*cos and rotate_half(x)*sin in bf16 (two elements per instruction on the GPU, where the compiler
    may fuse a product into the sum: one rounding fewer). EMULATE (the interpreter): each bf16 operation as a
    float32 one rounded to bf16. bf16 [BN, HALF] (EMULATE: float32 holding bf16 values)."""
    rows = cos_row[:, None] + tl.arange(0, HALF)[None, :]
    srows = sin_row[:, None] + tl.arange(0, HALF)[None, :]
    if EMULATE:
        b1 = _bf16(x1)
        b2 = _bf16(x2)
        c1 = tl.load(rows).to(tl.float32)
        c2 = tl.load(rows + HALF).to(tl.float32)
        s1 = tl.load(srows).to(tl.float32)
        s2 = tl.load(srows + HALF).to(tl.float32)
        y1, y2 = _bf16(_bf16(b1 * c1) - _bf16(b2 * s1)), _bf16(_bf16(b2 * c2) + _bf16(b1 * s2))
    else:  # (an else, not code after a return: the compiler would generate both, with two return types)
        b1 = x1.to(tl.bfloat16)
        b2 = x2.to(tl.bfloat16)
        y1, y2 = b1 * tl.load(rows) - b2 * tl.load(srows), b2 * tl.load(rows + HALF) + b1 * tl.load(srows + HALF)
    return y1, y2


@triton.jit
def _rope_halves(x1, x2, cos_row, sin_row, HALF: tl.constexpr):
    """HF's x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1], of the halves x1, x2 [BN, HALF] with the
    model's tables at rows cos_row/sin_row [BN] (pointers). Computed on even and odd columns apart, so that a table
    word's two entries meet their two elements in whatever layout the tile has (no join of the table halves)."""
    BN: tl.constexpr = x1.shape[0]
    x1e, x1o = tl.split(tl.reshape(x1, [BN, HALF // 2, 2]))
    x2e, x2o = tl.split(tl.reshape(x2, [BN, HALF // 2, 2]))
    c1e, c1o = _table_pairs(cos_row, HALF)
    c2e, c2o = _table_pairs(cos_row + HALF, HALF)
    s1e, s1o = _table_pairs(sin_row, HALF)
    s2e, s2o = _table_pairs(sin_row + HALF, HALF)
    y1 = tl.reshape(tl.join(x1e * c1e - x2e * s1e, x1o * c1o - x2o * s1o), [BN, HALF])
    y2 = tl.reshape(tl.join(x2e * c2e + x1e * s2e, x2o * c2o + x1o * s2o), [BN, HALF])
    return y1, y2


@triton.jit
def _value_words_3bit(codes_b, scale_b, min_b, s_codes, s_scale, slot, tvalid, mult, D: tl.constexpr,
                      GROUP: tl.constexpr, STATS_W: tl.constexpr):
    """`tiles._value_tile` of 3-bit codes without outliers, times `mult`: rows of D*3/8 bytes (a multiple of 12)
    read as 32-bit words, three per 32 codes (`unpack._unpack_3bit_words`). float32 [BN, D]."""
    BN: tl.constexpr = slot.shape[0]
    m2 = tvalid[:, None]
    rows = (codes_b + slot[:, None] * s_codes).to(tl.pointer_type(tl.int32)) + 3 * tl.arange(0, D // 32)[None, :]
    w0 = tl.load(rows, mask=m2, other=0)
    w1 = tl.load(rows + 1, mask=m2, other=0)
    w2 = tl.load(rows + 2, mask=m2, other=0)
    code = tl.reshape(_unpack_3bit_words(w0, w1, w2), [BN, D])
    sc, mn = _token_stats(scale_b, min_b, s_scale, slot, tvalid, D, GROUP, STATS_W, mult, 7)
    return code.to(tl.float32) * sc + mn


@triton.jit
def _scatter_outliers(o_b, so_t, cos_b, sin_b, sr_t, slot, ch, val, live, HALF: tl.constexpr, ROPE: tl.constexpr):
    """out[slot, ch] += val where live (any shape, (slot, ch) distinct among live entries) into the written tiles
    (a barrier first: other threads wrote them). ROPE: the outlier enters before the rotation, so it adds
    val·(cos, sin) to its entry and its rotary partner: channels of the first half, then (a barrier between:
    a token's outliers at c and c + HALF share the pair) those of the second."""
    ty = o_b.dtype.element_ty
    if ROPE:
        p = ch & (HALF - 1)
        first = ch < HALF
        o1 = o_b + slot * so_t + p
        r1 = slot * sr_t + p
        for phase in tl.static_range(2):
            m = live & (first if phase == 0 else ch >= HALF)
            c = tl.load(cos_b + r1 + phase * HALF, mask=m, other=0.0).to(tl.float32)  # c1 or c2
            s = tl.load(sin_b + r1 + (1 - phase) * HALF, mask=m, other=0.0).to(tl.float32)  # s2 or s1
            tl.debug_barrier()
            y1 = tl.load(o1, mask=m, other=0.0).to(tl.float32)
            y2 = tl.load(o1 + HALF, mask=m, other=0.0).to(tl.float32)
            if phase == 0:  # x1 += v: y1 += v·c1, y2 += v·s2
                y1 += val * c
                y2 += val * s
            else:  # x2 += v: y1 -= v·s1, y2 += v·c2
                y1 -= val * s
                y2 += val * c
            tl.store(o1, y1.to(ty), mask=m)
            tl.store(o1 + HALF, y2.to(ty), mask=m)
    else:
        tl.debug_barrier()
        o = o_b + slot * so_t + ch
        tl.store(o, (tl.load(o, mask=live, other=0.0).to(tl.float32) + val).to(ty), mask=live)


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
    D: tl.constexpr, HALF: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr, DT: tl.constexpr,
    BY_CHANNEL: tl.constexpr, BITS: tl.constexpr, UNIT: tl.constexpr, GROUP: tl.constexpr, STATS_ROW: tl.constexpr,
    PLANES: tl.constexpr, ROW: tl.constexpr, STATS_W: tl.constexpr, K2: tl.constexpr, CH_SPARSE: tl.constexpr,
    SEG: tl.constexpr, R: tl.constexpr, ROT: tl.constexpr, ROPE: tl.constexpr, ROPE_BF16: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    chunk = tl.program_id(1)
    part = tl.program_id(2)
    b = pid_bh // H
    bh64 = pid_bh.to(tl.int64)
    h_offs = tl.arange(0, HALF)
    # per program: the chunk's bases and what does not change along its tokens
    o_b = out_ptr + b.to(tl.int64) * so_b + (pid_bh % H).to(tl.int64) * so_h
    cos_b = cos_ptr + b.to(tl.int64) * sr_b
    sin_b = sin_ptr + b.to(tl.int64) * sr_b
    codes_b = codes + bh64 * s_codes
    scale_b = scale + bh64 * s_stats
    min_b = minimum + bh64 * s_stats
    widths_b = widths + bh64 * s_w + chunk * D
    la_b = la + bh64 * s_la
    seg = bh64 * s_ow + chunk * SEG
    ot_b = ot + bh64 * s_ot + chunk * (N_TILES + 1)
    SCATTER: tl.constexpr = not ROT  # outliers after the tile is written (unrotated runs)
    # values of 3 bits without outliers in registers: codes from words, and a rotation's D^-1/2 in the statistics
    WORDS3: tl.constexpr = not BY_CHANNEL and BITS == 3 and (K2 == 0 or SCATTER)
    NORM = 1.0 / tl.sqrt_rn(tl.full([], D, tl.float32)) if ROT else 1.0
    # keys of 2/4/8 bits and rank <= 2 (decode chunks): the low-rank term as R float32 multiply-adds per element,
    # the tile staying in the layout its words were read in (no tensor-core layout to move it into and out of).
    # Measured (compile report): better at rank 2 (gear-2 keys decode 10.70 -> 10.27), worse at rank 4 (gear-2
    # keys prompt 11.48 -> 12.67) and for 3-bit words (gear-3 keys decode 10.55 with the dot, 12.00 without)
    LR_FMA: tl.constexpr = BY_CHANNEL and not PLANES and R > 0 and R <= 2 and BITS != 3  # (no chained <: Triton's
    # compiler rejects them)
    if LR_FMA:
        lb_b = lb + bh64 * s_lb
        rows1 = chunk * D + h_offs
        p0 = _factor_row(lb_b, R, rows1, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 0, R)
        p1 = _factor_row(lb_b, R, rows1, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 1, R)
        p2 = _factor_row(lb_b, R, rows1, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 2, R)
        p3 = _factor_row(lb_b, R, rows1, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 3, R)
        q0 = _factor_row(lb_b, R, rows1 + HALF, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 0, R)
        q1 = _factor_row(lb_b, R, rows1 + HALF, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 1, R)
        q2 = _factor_row(lb_b, R, rows1 + HALF, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 2, R)
        q3 = _factor_row(lb_b, R, rows1 + HALF, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk, 3, R)
    # words of 2/4/8-bit keys through the tensor-core dot: a thread holds 2 (2, 4 bits) or 4 (8 bits) rows of a word
    # column (measured: gear-2 keys prompt 11.48 -> 10.11, gear-4 12.39 -> 11.61; 4 sets of 2-bit rows: 28.6); one
    # set with the multiply-adds or without a low-rank term (gear-4 keys decode 10.92 -> 11.34, kivi-4 8.59 -> 8.86)
    SETS: tl.constexpr = (2 if UNIT == 4 else 4 // UNIT) if BY_CHANNEL and UNIT <= 4 and R > 0 and not LR_FMA else 1
    if R > 0 and not LR_FMA:
        if BY_CHANNEL:
            bt1 = _lowrank_bt(lb + bh64 * s_lb, R, chunk * D + h_offs, las + bh64 * s_ls, lbs + bh64 * s_ls, chunk,
                              R, DT)
            bt2 = _lowrank_bt(lb + bh64 * s_lb, R, chunk * D + HALF + h_offs, las + bh64 * s_ls, lbs + bh64 * s_ls,
                              chunk, R, DT)
        else:
            bt = _lowrank_bt(lb + bh64 * s_lb, R, chunk * D + tl.arange(0, D), las + bh64 * s_ls, lbs + bh64 * s_ls,
                             chunk, R, DT)
    if PLANES:  # the chunk's widths: where each channel's planes lie in a row
        w1_, off1 = _plane_offsets(widths_b, 0, HALF)
        w2_, off2 = _plane_offsets(widths_b, HALF, HALF)
        n11, n12, mlo1, mhi1 = _plane_masks(w1_, off1)
        n21, n22, mlo2, mhi2 = _plane_masks(w2_, off2)
    first = part * TILES
    if SCATTER and CH_SPARSE:  # [lo_p, hi_p): the program's key outliers in the chunk's list (sorted by token)
        lo_p = tl.load(ot_b + first * (BN // 16))
        hi_p = tl.load(ot_b + tl.minimum(tl.minimum(first + TILES, tl.cdiv(N, BN)) * (BN // 16), N_TILES))
    for blk in range(first, tl.minimum(first + TILES, tl.cdiv(N, BN))):
        tok0 = blk * BN  # chunk-local
        slot0 = chunk * N + tok0  # along the store's token axis (chunks one after the other)
        slot = slot0 + tl.arange(0, BN)
        tvalid = tok0 + tl.arange(0, BN) < N
        a16 = _lowrank_a(la_b, R, slot, tvalid, R, DT) if R > 0 and not LR_FMA else 0  # [BN, 16]
        if BY_CHANNEL:  # codes packed along tokens, a row of statistics per token group: a half of the head at a time
            if PLANES:
                x1 = _plane_tile(codes_b, scale_b, min_b, w1_, off1, n11, n12, mlo1, mhi1, slot, slot0, chunk * N + N,
                                 tvalid, h_offs, 0, a16, bt1 if R > 0 else 0, ROW, D, GROUP, R, STATS_ROW, DT)
                x2 = _plane_tile(codes_b, scale_b, min_b, w2_, off2, n21, n22, mlo2, mhi2, slot, slot0, chunk * N + N,
                                 tvalid, h_offs + HALF, HALF, a16, bt2 if R > 0 else 0, ROW, D, GROUP, R, STATS_ROW,
                                 DT)
            else:
                x1 = _word_channel_tile(codes_b, scale_b, min_b, ROW, D, slot, slot0, chunk * N + N, tvalid, h_offs,
                                        0, BITS, UNIT, GROUP, STATS_ROW, SETS)
                x2 = _word_channel_tile(codes_b, scale_b, min_b, ROW, D, slot, slot0, chunk * N + N, tvalid,
                                        h_offs + HALF, HALF, BITS, UNIT, GROUP, STATS_ROW, SETS)
                if LR_FMA:
                    x1, x2 = _lowrank_fma(x1, x2, la_b, R, slot, tvalid, p0, q0, p1, q1, p2, q2, p3, q3, R)
                elif R > 0:  # + A·Bᵀ on the tensor cores (rank padded to 16 with zeros)
                    x1 = _lowrank_dot(a16, bt1, x1, DT)
                    x2 = _lowrank_dot(a16, bt2, x2, DT)
            if CH_SPARSE and not SCATTER:
                u0 = tok0 // 16
                lo = tl.load(ot_b + u0)
                hi = tl.load(ot_b + tl.minimum(u0 + BN // 16, N_TILES))
                x1 = _channel_outliers(x1, ow + seg, ov + seg, lo, hi, tok0, 0, D, BN, HALF, OUTLIERS_PER_STEP, DT)
                x2 = _channel_outliers(x2, ow + seg, ov + seg, lo, hi, tok0, HALF, D, BN, HALF, OUTLIERS_PER_STEP, DT)
        else:  # codes packed along channels, statistics per channel group of each token, outliers per token
            if WORDS3:
                x = _value_words_3bit(codes_b, scale_b, min_b, ROW, STATS_W, slot, tvalid, NORM, D, GROUP, STATS_W)
            else:
                x = _value_tile(codes_b, scale_b, min_b, spv + bh64 * s_sp, spi + bh64 * s_sp, ROW, STATS_W, K2,
                                slot, tvalid, D, BITS, UNIT, GROUP, 0 if SCATTER else K2, STATS_W)
            if R > 0:
                x = _lowrank_dot(a16, bt, x, DT)
            x1, x2 = _halves(x, BN, HALF)
        if ROT and WORDS3:  # stored as x·H (Walsh–Hadamard): x·H·H = x, H's factor D^-1/2 already in x
            x1, x2 = _sylvester_halves(x1, x2, had_ptr, D, DT)
        elif ROT:
            x1, x2 = _unrotate_halves(x1, x2, had_ptr, D, DT)
        m2 = tvalid[:, None]
        if ROPE:  # HF's x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1], with the model's own tables
            trow = tl.minimum(slot, chunk * N + N - 1) * sr_t  # (rows past the chunk read its last: no masks)
            if ROPE_BF16:
                x1, x2 = _rope_bf16(x1, x2, cos_b + trow, sin_b + trow, HALF, ROPE_BF16 == 2)
            else:
                x1, x2 = _rope_halves(x1, x2, cos_b + trow, sin_b + trow, HALF)
        o = o_b + slot[:, None] * so_t + h_offs[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(o, x1.to(ty), mask=m2)
        tl.store(o + HALF, x2.to(ty), mask=m2)
        if SCATTER and K2 > 0:  # each token's K2 slots (distinct channels; empty slots hold 0)
            K2P: tl.constexpr = 1 << (K2 - 1).bit_length()
            s = tl.arange(0, K2P)[None, :]
            m = m2 & (s < K2)
            at = spv + bh64 * s_sp + slot[:, None] * K2 + s
            val = tl.load(at, mask=m, other=0.0).to(tl.float32)
            ch = tl.load(spi + bh64 * s_sp + slot[:, None] * K2 + s, mask=m, other=0).to(tl.int32)
            _scatter_outliers(o_b, so_t, cos_b, sin_b, sr_t, slot[:, None] + 0 * s, ch, val, m & (val != 0.0), HALF,
                              ROPE)
    if SCATTER and CH_SPARSE:  # the outliers of the program's tiles (`lo_p`, `hi_p`), after them
        LOG2D: tl.constexpr = D.bit_length() - 1
        for e0 in range(lo_p, hi_p, SCATTER_STEP):
            e = e0 + tl.arange(0, SCATTER_STEP)
            where = tl.load(ow + seg + e, mask=e < hi_p, other=0)
            val = tl.load(ov + seg + e, mask=e < hi_p, other=0.0).to(tl.float32)
            _scatter_outliers(o_b, so_t, cos_b, sin_b, sr_t, chunk * N + (where >> LOG2D), where & (D - 1), val,
                              (e < hi_p) & (val != 0.0), HALF, ROPE)
