"""The low-rank term L = A Bᵀ, fitted to what the backbone and the outliers leave: R = X - D̂ - S.

Fields (r = min(rank, n, d); "side" the 16-bit side dtype):
    lowrank_a        [n, r]  side, or int8 (factor_bits=8)
    lowrank_b        [d, r]  side, or int8
    lowrank_a_scale  [1, r]  side: per-column absmax / 127 of int8 factors; [0, rank] for 16-bit factors
    lowrank_b_scale  [1, r]
"""

from __future__ import annotations

import functools

import torch

from .. import lowrank
from .base import DecodeState, EncodeState, Field, Term


def _quantize_factor(f: torch.Tensor, store_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """f [B,H,m,r] float32 -> (int8 codes [B,H,m,r], scale [B,H,1,r] in store_dtype): per-column absmax."""
    scale = (f.abs().amax(dim=-2, keepdim=True) / 127).to(store_dtype)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale.float()))
    return torch.round(f / safe).clamp_(-127, 127).to(torch.int8), scale


def fit_factors(residual: torch.Tensor, spec, store: torch.dtype, valid: torch.Tensor | None = None):
    """The stored low-rank factors of a residual R [B,H,n,d] float32: (A [B,H,n,r], B [B,H,d,r], A's scales, B's
    scales). 16-bit factors: in the side dtype `store`, no scales ([B,H,0,rank]); 8-bit: int8 with a per-column
    scale [B,H,1,r], B refitted to the quantized A (least squares) before it is quantized itself."""
    B, H = residual.shape[:2]
    lowrank_a, lowrank_b = lowrank.lowrank_fit(residual, spec.rank, spec.power_iters, valid, out_dtype=torch.float32)
    if spec.factor_bits == 16:
        empty_scale = residual.new_zeros(B, H, 0, spec.rank, dtype=store)
        return (*(lowrank.to_finite(f, store) for f in (lowrank_a, lowrank_b)), empty_scale, empty_scale)
    lowrank_a, a_scale = _quantize_factor(lowrank_a, store)
    # refit B to the quantized A (least squares: B = Rᵀ A (AᵀA)⁻¹), then quantize it
    a = lowrank_a.float() * a_scale.float()
    # non-finite input is refused by the cache once per step (no sync here): keep pinv from raising first
    gram = torch.nan_to_num(a.transpose(-1, -2) @ a)  # [B,H,r,r]
    eye = torch.eye(gram.shape[-1], device=residual.device)
    refit = residual.transpose(-1, -2) @ a @ torch.linalg.pinv(gram + 1e-12 * eye)  # [B,H,d,r]
    lowrank_b, b_scale = _quantize_factor(refit, store)
    return lowrank_a, lowrank_b, a_scale, b_scale


def _factor(t: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """Stored factor [B,H,C*m,r] (int8 with per-chunk scales [B,H,C,r], or 16-bit) -> float32 [B*H,C,m,r]."""
    B, H, _, r = t.shape
    f = t.float().view(B * H, chunks, -1, r)
    if t.dtype == torch.int8:
        f = f * scale.float().view(B * H, chunks, 1, r)
    return f


def add_lowrank(x: torch.Tensor, chunk, n: int, d: int, chunks: int = 1) -> torch.Tensor:
    """x [B,H,C*n,d] float32 += each chunk's A Bᵀ, in place (nothing when the chunk has no low-rank term)."""
    if chunk.lowrank_a.shape[-1]:
        B, H = x.shape[0], x.shape[1]
        a = _factor(chunk.lowrank_a, chunk.lowrank_a_scale, chunks)  # [B*H,C,n,r]
        b = _factor(chunk.lowrank_b, chunk.lowrank_b_scale, chunks)  # [B*H,C,d,r]
        if chunks == 1:  # accumulate inside the matmul: no [n, d] temporary
            x.view(B * H, n, d).baddbmm_(a[:, 0], b[:, 0].transpose(-1, -2))
        else:  # each chunk's own A Bᵀ
            x.view(B * H, chunks, n, d).add_(a @ b.transpose(-1, -2))
    return x


class LowRank(Term):
    name = "lowrank"
    builtin = True

    def active(self, spec) -> bool:
        return spec.rank > 0

    def fields(self, spec, n, d, side):
        r = min(spec.rank, n, d)
        if not spec.rank:
            shapes = ((n, 0), (d, 0), (0, 0))
            factor = side
        else:
            factor = torch.int8 if spec.factor_bits == 8 else side
            shapes = ((n, r), (d, r), (1, r) if spec.factor_bits == 8 else (0, spec.rank))
        return (Field("lowrank_a", shapes[0], factor, "lowrank"), Field("lowrank_b", shapes[1], factor, "lowrank"),
                Field("lowrank_a_scale", shapes[2], side, "lowrank"),
                Field("lowrank_b_scale", shapes[2], side, "lowrank"))

    def fit(self, st: EncodeState) -> None:
        spec = st.spec
        B, H, n, d = st.x.shape
        if spec.rank:
            fit = st.factors if st.factors is not None and st.valid is None \
                else functools.partial(fit_factors, valid=st.valid)
            a, b, a_scale, b_scale = fit(st.residual(self), spec, st.side)
        else:
            a, b = st.x.new_zeros(B, H, n, 0, dtype=st.side), st.x.new_zeros(B, H, d, 0, dtype=st.side)
            a_scale = b_scale = st.x.new_zeros(B, H, 0, 0, dtype=st.side)
        st.out.update(lowrank_a=a, lowrank_b=b, lowrank_a_scale=a_scale, lowrank_b_scale=b_scale)

    def add(self, ds: DecodeState) -> None:
        add_lowrank(ds.x, ds.chunk, ds.n, ds.d, ds.chunks)
