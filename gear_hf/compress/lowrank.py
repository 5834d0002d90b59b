"""Low-rank residual L = A Bᵀ by subspace (power) iteration with QR, per batch row and per head."""

from __future__ import annotations

import torch

_INIT_SEED = 0x6EA2  # fixed: the same residual always gives the same factors


def _initial_basis(d: int, rank: int, device: torch.device) -> torch.Tensor:
    # Drawn as [r, d] rows: the first r columns are the same for every rank, so the subspaces of ranks r and
    # r+1 are nested from the start and stay nested, and the error can only fall as the rank grows.
    generator = torch.Generator(device="cpu").manual_seed(_INIT_SEED)
    # torch's CPU normal fill depends on the count drawn (blocks of 16, the last 16 values redrawn when the count
    # is not a multiple of 16): 16 spare rows keep the first `rank` rows the same for every rank
    return torch.randn(rank + 16, d, generator=generator, dtype=torch.float32)[:rank].T.to(device)  # [d, r]


def lowrank_fit(residual: torch.Tensor, rank: int, iters: int, valid: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None):
    """Fit residual R [B,H,n,d] ≈ A Bᵀ with A [B,H,n,r] orthonormal columns, B [B,H,d,r].

    valid: [B, n] bool; padding rows of R are zeroed so they take no part in the fit (their A rows are 0).
    Computed in float32; factors are returned in out_dtype (default R's dtype), clamped to its finite range.
    """
    B, H, n, d = residual.shape
    out_dtype = out_dtype or residual.dtype
    rank = min(rank, n, d)
    if rank == 0:
        return residual.new_zeros(B, H, n, 0, dtype=out_dtype), residual.new_zeros(B, H, d, 0, dtype=out_dtype)
    R = residual.float()
    if valid is not None:
        R = R * valid[:, None, :, None]
    basis = _initial_basis(d, rank, R.device).expand(B, H, d, rank)  # [B,H,d,r]
    for step in range(iters):
        # both products as (thin @ R or Rᵀ)ᵀ: several times faster on the CPU than R @ thin for r << d < n (same
        # products; the float32 sums run in another order)
        left, _ = torch.linalg.qr((basis.mT @ R.mT).mT)  # [B,H,n,r]
        basis = (left.mT @ R).mT.contiguous()  # [B,H,d,r]
        if step + 1 < iters:
            basis, _ = torch.linalg.qr(basis)
    # R ≈ left (leftᵀ R) = left basisᵀ
    return left.to(out_dtype), to_finite(basis, out_dtype)


def to_finite(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, clamped to its finite range (a large factor must not become inf in fp16)."""
    if dtype != torch.float32 and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        t = t.clamp(-limit, limit)
    return t.to(dtype)
