"""GEAR on one chunk of keys or values: X ≈ D̂ + S + A Bᵀ.

    S  = the k largest / k smallest entries of each vector (kept exactly)
    D̂  = quantize(X) with those entries excluded from the group statistics
    S  is stored as X - D̂ at the chosen entries, so reconstruction is additive
    L  = A Bᵀ, low-rank fit of R = X - D̂ - S

This is the reference implementation (the oracle for the kernels); the cache stores its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import lowrank, outliers, quant


@dataclass(frozen=True)
class ChunkSpec:
    """How one stream (keys or values) of one chunk is compressed."""

    bits: int
    axis: str  # "channel": groups run along tokens; "token": groups run along channels
    group: int  # group length; 0 = one group per whole vector (KCVT)
    outlier_ratio: float  # 0 = no sparse term
    rank: int  # 0 = no low-rank term
    power_iters: int = 3

    def group_for(self, n: int, d: int) -> int:
        if self.group:
            return self.group
        return n if self.axis == "channel" else d


@dataclass
class CompressedChunk:
    """One compressed chunk, shapes for x [B,H,n,d] (d_pad = d rounded up to the value group):

    codes         uint8 packed: [B,H,n/cpb,d] (axis="channel") or [B,H,n,d_pad/cpb] (axis="token")
    scale/minimum [B,H,n/g,d] or [B,H,n,d_pad/g]
    sparse_values [B,H,2k,d] or [B,H,n,2k]; sparse_index same shape (uint8/int16/int32: outliers.index_dtype)
    lowrank_a     [B,H,n,r];  lowrank_b [B,H,d,r]
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    sparse_values: torch.Tensor
    sparse_index: torch.Tensor
    lowrank_a: torch.Tensor
    lowrank_b: torch.Tensor


def compress(x: torch.Tensor, spec: ChunkSpec, valid: torch.Tensor | None = None,
             quantize_pack=None) -> CompressedChunk:
    """Compress x [B,H,n,d]. valid [B,n] bool marks real tokens; padding takes no part in any statistic.

    quantize_pack: optional accelerated (x, bits, axis, group, exclude) -> (packed codes, scale, minimum) that
    must equal quant.quantize + quant.pack_codes bit for bit (gear_hf.kernels.quantize_pack on CUDA).
    """
    B, H, n, d = x.shape
    group = spec.group_for(n, d)
    index, slot_used, mask = outliers.select_outliers(x, spec.axis, spec.outlier_ratio, valid)
    exclude = mask
    if valid is not None:
        exclude = mask | ~valid[:, None, :, None]
    pack_dim = -2 if spec.axis == "channel" else -1
    if quantize_pack is None:
        codes, scale, minimum = quant.quantize(x, spec.bits, spec.axis, group, exclude=exclude)
        packed = quant.pack_codes(codes, spec.bits, pack_dim)
    else:
        packed, scale, minimum = quantize_pack(x, spec.bits, spec.axis, group, exclude)
        codes = quant.unpack_codes(packed, spec.bits, pack_dim)
    dequantized = quant.dequantize(codes, scale, minimum, spec.axis, group, d, torch.float32)
    sparse_values = outliers.gather_entries(x.float() - dequantized, index, spec.axis)
    sparse_values = torch.where(slot_used, sparse_values, torch.zeros_like(sparse_values)).to(x.dtype)
    if spec.rank:
        approx = outliers.scatter_add_entries(dequantized.clone(), index, sparse_values, spec.axis)
        lowrank_a, lowrank_b = lowrank.lowrank_fit(x.float() - approx, spec.rank, spec.power_iters, valid,
                                                   out_dtype=x.dtype)
    else:
        lowrank_a, lowrank_b = x.new_zeros(B, H, n, 0), x.new_zeros(B, H, d, 0)
    return CompressedChunk(
        codes=packed,
        scale=scale,
        minimum=minimum,
        sparse_values=sparse_values,
        sparse_index=index.to(outliers.index_dtype(n if spec.axis == "channel" else d)),
        lowrank_a=lowrank_a,
        lowrank_b=lowrank_b,
    )


def decompress(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Reconstruct [B,H,n,d] = D̂ + S + A Bᵀ, computed in float32 and returned in out_dtype."""
    pack_dim = -2 if spec.axis == "channel" else -1
    codes = quant.unpack_codes(chunk.codes, spec.bits, pack_dim)
    x = quant.dequantize(codes, chunk.scale, chunk.minimum, spec.axis, spec.group_for(n, d), d, torch.float32)
    if chunk.sparse_index.numel():
        x = outliers.scatter_add_entries(x, chunk.sparse_index, chunk.sparse_values, spec.axis)
    if chunk.lowrank_a.shape[-1]:
        a, b = chunk.lowrank_a.float(), chunk.lowrank_b.float()  # [B,H,n,r], [B,H,d,r]
        flat = x.reshape(-1, n, d)  # a view unless padded value channels were cut off
        flat.baddbmm_(a.reshape(-1, n, a.shape[-1]), b.reshape(-1, d, b.shape[-1]).transpose(-1, -2))  # += A Bᵀ
        x = flat.view(x.shape)
    return x.to(out_dtype)
