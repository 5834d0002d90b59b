"""Small device operations of the fused decode kernel: dots in the kernel's dot dtype, sin/cos and RoPE, the
low-rank factors as 16-wide dot operands, the Walsh–Hadamard un-rotation and the online-softmax step."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # fast sin/cos approximations (MUFU) for the GPU; the interpreter has no libdevice
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - other triton layouts
    _libdevice = None


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
def _softmax_weights(s, t, tvalid, limit, mvalid, window, m_i, l_i):
    """The online-softmax step without the accumulator: s [M, BN] (log2 units), t [BN] row-local key indices ->
    (m_new, l_new, alpha [M], p [M, BN])."""
    vis = mvalid[:, None] & tvalid[None, :] & (t[None, :] <= limit[:, None])
    if window > 0:
        vis = vis & ((limit[:, None] - t[None, :]) < window)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _softmax_step(s, t, tvalid, limit, mvalid, window, m_i, l_i, acc, v, DT: tl.constexpr):
    """One online-softmax step, the accumulator included: acc [M, D] += p · v."""
    m_new, l_i, alpha, p = _softmax_weights(s, t, tvalid, limit, mvalid, window, m_i, l_i)
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
    norm = 1.0 / tl.sqrt_rn(tl.full([], D, tl.float32))
    y1, y2 = _sylvester_halves(x1, x2, had_ptr, D, DT)
    return y1 * norm, y2 * norm


@triton.jit
def _sylvester_halves(x1, x2, had_ptr, D: tl.constexpr, DT: tl.constexpr):
    """[(x1 + x2)·S, (x1 - x2)·S]: `_unrotate_halves` without its factor D^-1/2 (for a caller that folds it into
    the dequantization's statistics)."""
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, HALF)
    s_half = tl.load(had_ptr + r[:, None] * HALF + r[None, :])
    return _dot(x1 + x2, s_half, DT), _dot(x1 - x2, s_half, DT)
