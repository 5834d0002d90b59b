"""GEAR on one chunk of keys or values: X ≈ D̂ + S + A Bᵀ, as the stored format's terms compute it.

    S  = the extreme entries of each vector (terms/sparse.py), stored as X - D̂ at those entries,
         chosen so that D̂ + S rounds to X in the model dtype (reconstruction is additive)
    D̂  = quantize(X) with those entries excluded from the group statistics (terms/backbone.py)
    L  = A Bᵀ, low-rank fit of R = X - D̂ - S (terms/lowrank.py)
    optionally all of it in a rotated basis X H (H: orthonormal Walsh–Hadamard along head_dim), undone at
    decompress (terms/rotation.py)

`compress` and `decompress` run the terms' stages (`gear_hf.compress.terms`); this is the reference
implementation, the oracle for the kernels, and the torch backend.

Side information (scales, minimums, outlier values, low-rank factors) is stored in 16 bits whatever the model
dtype (`side_dtype`): a 32-bit model would otherwise pay twice for it. Low-rank factors may be stored in 8 bits
(int8 with one 16-bit absmax scale per column).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import FACTOR_BITS, ChunkSpec, CompressedChunk, check_channel_bits, side_dtype
from .terms import BUILTIN_FIELDS, DecodeState, EncodeState, terms_of
from .terms.lowrank import add_lowrank, fit_factors
from .terms.sparse import exact_outliers

__all__ = ["FACTOR_BITS", "ChunkSpec", "CompressedChunk", "Backbone", "add_lowrank", "check_channel_bits",
           "compress", "compute_backbone", "decompress", "exact_outliers", "fit_factors", "side_dtype"]

_BACKBONE_STAGES = ("transform", "select", "quantize", "correct", "pack")


@dataclass
class Backbone:
    """What a chunk stores before its low-rank term (D̂ and S), and the residual that term is fitted to."""

    codes: torch.Tensor  # packed as CompressedChunk.codes
    channel_bits: torch.Tensor
    scale: torch.Tensor  # as stored (CompressedChunk.scale): 8-bit statistics' uint8 codes
    minimum: torch.Tensor
    sparse_values: torch.Tensor  # side dtype, 0 at unused slots
    sparse_index: torch.Tensor  # int64, select_outliers' layout
    residual: torch.Tensor | None  # [B,H,n,d] float32: (rotated) X - D̂ - S, when the spec has a low-rank term


def _encode_state(x, spec, valid, quantize_pack, channel_bits, factors) -> EncodeState:
    st = EncodeState(spec=spec, x=x, valid=valid, side=side_dtype(x.dtype), channel_bits=channel_bits,
                     quantize_pack=quantize_pack, factors=factors, work=x)
    st.terms = terms_of(spec)
    return st


def _run(st: EncodeState, stages) -> None:
    for stage in stages:
        for term in st.terms:
            getattr(term, stage)(st)


def compress(x: torch.Tensor, spec: ChunkSpec, valid: torch.Tensor | None = None,
             quantize_pack=None, channel_bits: torch.Tensor | None = None, backbone=None,
             factors=None) -> CompressedChunk:
    """Compress x [B,H,n,d]. valid [B,n] bool marks real tokens; padding takes no part in any statistic.
    channel_bits: uint8 [B,H,d], each channel's width (1..8), for an allocated spec (allocation.py) and only then.

    Accelerated steps (used only without valid; the caller checks that they cover the spec):
    quantize_pack: (x, bits, axis, group, exclude, stats_dtype) -> (packed codes, scale, minimum), equal to
    quant.quantize + pack_codes bit for bit (the Triton kernel on CUDA; not for allocated widths).
    backbone: (x, spec, channel_bits) -> Backbone, equal to `compute_backbone` bit for bit (the numba kernel).
    factors: (residual, spec, store) -> what `fit_factors` returns, equal to float32 rounding.
    """
    st = _encode_state(x, spec, valid, quantize_pack, channel_bits, factors)
    if backbone is not None and valid is None:
        part = backbone(x, spec, channel_bits)
        index = part.sparse_index
        length = x.shape[2] if spec.axis == "channel" else x.shape[3]
        from .outliers import index_dtype

        st.out.update(codes=part.codes, channel_bits=part.channel_bits, scale=part.scale, minimum=part.minimum,
                      sparse_values=part.sparse_values, sparse_index=index.to(index_dtype(length)))
        st.given_residual = part.residual
        _run(st, ("fit",))
    else:
        _run(st, (*_BACKBONE_STAGES, "fit"))
    order = {name: i for i, name in enumerate(BUILTIN_FIELDS)}  # storage order; extra terms' fields after
    return CompressedChunk(dict(sorted(st.out.items(), key=lambda item: order.get(item[0], len(order)))))


def compute_backbone(x: torch.Tensor, spec: ChunkSpec, valid: torch.Tensor | None = None,
                     quantize_pack=None, channel_bits: torch.Tensor | None = None) -> Backbone:
    """D̂ and S of x [B,H,n,d] (outliers chosen, the rest quantized, outliers made exact), and, for a spec with a
    low-rank term, the residual (`compress` documents the arguments)."""
    st = _encode_state(x, spec, valid, quantize_pack, channel_bits, None)
    _run(st, _BACKBONE_STAGES)
    lowrank = next((t for t in st.terms if t.name == "lowrank"), None)
    residual = st.residual(lowrank) if spec.rank and lowrank is not None else None
    return Backbone(codes=st.out["codes"], channel_bits=st.out["channel_bits"], scale=st.out["scale"],
                    minimum=st.out["minimum"], sparse_values=st.out["sparse_values"], sparse_index=st.index,
                    residual=residual)


def decompress(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, out_dtype: torch.dtype,
               chunks: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct D̂ + S + A Bᵀ of `chunks` consecutive chunks of n tokens: [B,H,chunks*n,d], computed in float32
    (and rotated back when the spec rotates).

    `chunk` holds the chunks one after the other along dim 2 of every field (as `ChunkStore` keeps them), so
    one call covers a row's whole run of decode chunks: a quantization group never straddles two chunks, outlier
    token indices count from their chunk's start, and each chunk has its own low-rank factors.
    out: an optional [B,H,chunks*n,d] tensor (e.g. a slice of the attention's key buffer) written in place
    and returned; otherwise a new tensor in out_dtype.
    """
    terms = terms_of(spec)
    ds = DecodeState(spec, chunk, n, d, chunks, out, out_dtype)
    # float32 `out` is written directly, else accumulate in float32 and round once at the end
    ds.direct = out is not None and out.dtype == torch.float32 and not any(t.transforms(spec) for t in terms)
    for term in terms:
        term.dequantize(ds)
    for term in terms:
        term.add(ds)
    for term in reversed(terms):
        term.untransform(ds)
    if out is None:
        return ds.x.to(out_dtype)
    if not ds.direct:
        out.copy_(ds.x)
    return out
