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


def decompress(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, out_dtype: torch.dtype,
               chunks: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct D̂ + S + A Bᵀ of `chunks` consecutive chunks of n tokens: [B,H,chunks*n,d], computed in float32.

    `chunk` holds the chunks one after the other along dim 2 of every field (as `ChunkStore` keeps them), so
    one call covers a row's whole run of decode chunks: a quantization group never straddles two chunks, outlier
    token indices count from their chunk's start, and each chunk has its own low-rank factors.
    out: an optional [B,H,chunks*n,d] tensor (e.g. a slice of the attention's key buffer) written in place
    and returned; otherwise a new tensor in out_dtype.
    """
    pack_dim = -2 if spec.axis == "channel" else -1
    codes = quant.unpack_codes(chunk.codes, spec.bits, pack_dim)
    direct = out is not None and out.dtype == torch.float32  # else accumulate in float32 and round once at the end
    x = quant.dequantize(codes, chunk.scale, chunk.minimum, spec.axis, spec.group_for(n, d), d, torch.float32,
                         out=out if direct else None)  # [B,H,C*n,d]
    if chunk.sparse_index.numel():
        index = chunk.sparse_index.long()
        if spec.axis == "channel" and chunks > 1:  # [B,H,C*2k,d] token indices within each chunk
            per_chunk = index.shape[2] // chunks
            offsets = torch.arange(chunks, device=index.device).repeat_interleave(per_chunk) * n
            index = index + offsets.view(1, 1, -1, 1)
        x = outliers.scatter_add_entries(x, index, chunk.sparse_values, spec.axis)
    if chunk.lowrank_a.shape[-1]:
        B, H, r = x.shape[0], x.shape[1], chunk.lowrank_a.shape[-1]
        a = chunk.lowrank_a.float().view(B * H, chunks, n, r)
        b = chunk.lowrank_b.float().view(B * H, chunks, d, r)
        if chunks == 1:  # accumulate inside the matmul: no [n, d] temporary
            x.view(B * H, n, d).baddbmm_(a[:, 0], b[:, 0].transpose(-1, -2))
        else:  # each chunk's own A Bᵀ
            x.view(B * H, chunks, n, d).add_(a @ b.transpose(-1, -2))
    if out is None:
        return x.to(out_dtype)
    if not direct:
        out.copy_(x)
    return out
