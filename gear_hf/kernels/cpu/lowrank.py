"""CPU low-rank fit (numba): `compress.gear.fit_factors`, one (row, head) plane at a time.

The same subspace iteration from the same starting basis, the same factor quantization and least-squares refit of
B, with the plane's residual in cache throughout (torch runs ~40 small ops per chunk for this). What differs, so
that the factors equal torch's to float32 rounding and not bit for bit: sums in another order (vectorized), and
Gram-Schmidt (twice) in place of LAPACK's Householder QR, whose columns may come out with the other sign (A's and
B's columns flip together: A Bᵀ is the same; the int8 codes of a flipped column are its codes negated).
"""

from __future__ import annotations

import numpy as np
import torch

from ...compress import ChunkSpec
from ...compress.lowrank import _initial_basis
from .bf16 import bf16_value as _f32
from .bf16 import round_bf16 as _bf16
from .jit import kernel

_F32 = np.float32
_FAST = {"reassoc", "contract"}  # sums reordered and vectorized (this step is equal to float32 rounding anyway)
# singular values below this times the largest (times the rank) are dropped, as torch.linalg.pinv's default rtol
_PINV_RTOL = _F32(np.finfo(np.float32).eps)
_BF16_MAX = _F32(torch.finfo(torch.bfloat16).max)
# a row whose part orthogonal to the earlier rows is below this fraction of its norm is taken as dependent on them
# (float32 rounding, ~eps each, over a few hundred entries; a real direction this weak carries nothing of the fit)
_DEPENDENT = _F32(64 * np.finfo(np.float32).eps)


@kernel(fastmath=_FAST)
def _project(R, basis_t, left_t):
    """left_t [r, n] = (R [n, d] @ basis)ᵀ, basis given as basis_t [r, d]."""
    n, d = R.shape
    for t in range(n):
        for j in range(basis_t.shape[0]):
            acc = _F32(0.0)
            for c in range(d):
                acc += R[t, c] * basis_t[j, c]
            left_t[j, t] = acc


@kernel(fastmath=_FAST)
def _project_back(R, left_t, basis_t):
    """basis_t [r, d] = (Rᵀ @ left)ᵀ, left given as left_t [r, n]."""
    n, d = R.shape
    basis_t[:] = 0.0
    for t in range(n):
        for j in range(left_t.shape[0]):
            w = left_t[j, t]
            for c in range(d):
                basis_t[j, c] += w * R[t, c]


@kernel(fastmath=_FAST)
def _orthonormalize(rows):
    """The rows of rows [r, m] made orthonormal in order (Gram-Schmidt, each projection done twice); a row that
    vanishes becomes 0 (its column of the fit then carries nothing). Vanishes: what is left after the projections
    is float32 rounding of the row (<= _DEPENDENT of its norm). Normalized, that rounding is no new direction: on
    a residual of rank 1 (one token repeated) every entry of the row rounds alike and it came back as the previous
    row, so A held one column twice and A Bᵀ twice the fit (LAPACK's QR, torch's, gives an orthogonal column)."""
    r, m = rows.shape
    for j in range(r):
        before = _F32(0.0)
        for t in range(m):
            before += rows[j, t] * rows[j, t]
        for _ in range(2):
            for i in range(j):
                dot = _F32(0.0)
                for t in range(m):
                    dot += rows[i, t] * rows[j, t]
                for t in range(m):
                    rows[j, t] -= dot * rows[i, t]
        norm = _F32(0.0)
        for t in range(m):
            norm += rows[j, t] * rows[j, t]
        norm = np.sqrt(norm)
        inverse = _F32(1.0) / norm if norm > _DEPENDENT * np.sqrt(before) else _F32(0.0)
        for t in range(m):
            rows[j, t] *= inverse


@kernel()
def _quantize_rows(rows, codes, scale):
    """Each row of rows [r, m] (a factor's column) as int8 codes [m, r] (transposed back) with scale[j] = its absmax
    / 127 in bf16 bits, as `compress.gear._quantize_factor`; rows then hold the dequantized values."""
    r, m = rows.shape
    for j in range(r):
        top = _F32(0.0)
        for t in range(m):
            top = max(top, abs(rows[j, t]))
        scale[j] = _bf16(top / _F32(127.0))
        s = _f32(scale[j])
        safe = s if s > 0 else _F32(1.0)
        for t in range(m):
            code = min(max(np.rint(rows[j, t] / safe), _F32(-127.0)), _F32(127.0))
            codes[t, j] = np.int8(code)
            rows[j, t] = _F32(code) * s


@kernel()
def _to_bf16(rows, out):
    """rows [r, m] -> out [m, r] bf16 bits, clamped to bf16's finite range (`lowrank.to_finite`)."""
    for j in range(rows.shape[0]):
        for t in range(rows.shape[1]):
            out[t, j] = _bf16(min(max(rows[j, t], -_BF16_MAX), _BF16_MAX))


@kernel()
def _pseudo_inverse(gram, inverse):
    """inverse = pinv(gram + 1e-12 I) for gram = AᵀA [r, r] of nearly orthogonal columns (a fit's quantized A):
    columns whose squared norm is below pinv's cutoff (eps * r times the largest) are dropped (rows and columns of
    0), the rest inverted by Gauss-Jordan with partial pivoting."""
    r = gram.shape[0]
    work = np.zeros((r, 2 * r), np.float64)
    largest = 0.0
    for i in range(r):
        for j in range(r):
            g = gram[i, j]
            work[i, j] = g if np.isfinite(g) else 0.0  # (non-finite input is refused by the cache; no crash here)
        work[i, i] += 1e-12
        work[i, r + i] = 1.0
        largest = max(largest, work[i, i])
    kept = np.empty(r, np.bool_)
    for i in range(r):
        kept[i] = work[i, i] > _PINV_RTOL * r * largest
    for col in range(r):
        if not kept[col]:
            continue
        pivot = col
        for i in range(r):
            if kept[i] and i >= col and abs(work[i, col]) > abs(work[pivot, col]):
                pivot = i
        for j in range(2 * r):
            work[col, j], work[pivot, j] = work[pivot, j], work[col, j]
        p = work[col, col]
        for j in range(2 * r):
            work[col, j] /= p
        for i in range(r):
            if i != col and kept[i]:
                f = work[i, col]
                for j in range(2 * r):
                    work[i, j] -= f * work[col, j]
    for i in range(r):
        for j in range(r):
            inverse[i, j] = work[i, r + j] if kept[i] and kept[j] else 0.0


@kernel(fastmath=_FAST)
def _fit(residual, basis0_t, iters, eight_bit, a_out, b_out, a_scale, b_scale):
    """Every plane's factors (`fit_factors`): residual [B,H,n,d] float32, basis0_t [r, d] the starting basis.
    Out: a_out [B,H,n,r], b_out [B,H,d,r] (int8 codes with bf16-bit scales [B,H,1,r], or bf16 bits)."""
    B, H, n, d = residual.shape
    r = basis0_t.shape[0]
    left_t, basis_t = np.empty((r, n), _F32), np.empty((r, d), _F32)
    gram, inverse, refit_t = np.empty((r, r), _F32), np.empty((r, r), _F32), np.empty((r, d), _F32)
    for b in range(B):
        for h in range(H):
            R = residual[b, h]
            basis_t[:] = basis0_t
            for step in range(iters):
                _project(R, basis_t, left_t)
                _orthonormalize(left_t)
                _project_back(R, left_t, basis_t)
                if step + 1 < iters:
                    _orthonormalize(basis_t)
            if not eight_bit:
                _to_bf16(left_t, a_out[b, h])
                _to_bf16(basis_t, b_out[b, h])
                continue
            _quantize_rows(left_t, a_out[b, h], a_scale[b, h, 0])  # left_t now holds the dequantized A
            for i in range(r):  # refit B to the quantized A: B = Rᵀ A (AᵀA)⁻¹
                for j in range(r):
                    acc = _F32(0.0)
                    for t in range(n):
                        acc += left_t[i, t] * left_t[j, t]
                    gram[i, j] = acc
            _pseudo_inverse(gram, inverse)
            _project_back(R, left_t, basis_t)  # (Aᵀ R) [r, d]
            for i in range(r):
                for c in range(d):
                    acc = _F32(0.0)
                    for j in range(r):
                        acc += inverse[i, j] * basis_t[j, c]
                    refit_t[i, c] = acc
            _quantize_rows(refit_t, b_out[b, h], b_scale[b, h, 0])


def fit_factors(residual: torch.Tensor, spec: ChunkSpec, store: torch.dtype):
    """`compress.gear.fit_factors(residual, spec, store)` for a bf16 side dtype, to float32 rounding (see above)."""
    if store != torch.bfloat16:
        raise ValueError(f"the CPU low-rank fit stores bf16 factors; side dtype {store} takes the torch path")
    B, H, n, d = residual.shape
    rank = min(spec.rank, n, d)
    basis0_t = _initial_basis(d, rank, torch.device("cpu")).T.contiguous()  # [r, d]
    eight_bit = spec.factor_bits == 8
    factor = torch.int8 if eight_bit else torch.bfloat16
    a, b = torch.empty(B, H, n, rank, dtype=factor), torch.empty(B, H, d, rank, dtype=factor)
    scales = (B, H, 1, rank) if eight_bit else (B, H, 0, spec.rank)
    a_scale, b_scale = torch.empty(scales, dtype=store), torch.empty(scales, dtype=store)
    if rank:
        bits = (lambda t: t.view(torch.int16).numpy()) if not eight_bit else (lambda t: t.numpy())
        _fit(residual.contiguous().numpy(), basis0_t.numpy(), spec.power_iters, eight_bit, bits(a), bits(b),
             a_scale.view(torch.int16).numpy(), b_scale.view(torch.int16).numpy())
    return a, b, a_scale, b_scale
