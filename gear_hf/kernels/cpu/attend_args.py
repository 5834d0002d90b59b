"""The storage views (`gear_hf.kernels.views`) as the fused CPU attention (`attend._attend`) reads them: chunk runs
prepared once per write, absent runs typed like present ones, the coded buffer's fields in place, RoPE tables."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...compress import ChunkSpec, CompressedChunk
from ...compress.rope import rope_angles
from ...compress.terms import BUILTIN_FIELDS, chunk_fields
from ..views import affine_in_basis
from .read import _NO_SIDE, _side_bytes, prepare, prepared


def _as_args(run) -> tuple:
    """(run, factors, rotated) of a prepared run (`read.Run`) as `_attend` reads them, run = (codes, bits, group,
    channel_axis, scale, minimum, outlier values, outlier index, outlier rows, n, tokens, widths)."""
    return ((run.codes, run.bits, run.group, run.channel_axis, run.scale, run.minimum, *run.outliers, run.n,
             run.tokens, run.widths), run.factors, run.hadamard)


def _run_args(view, chunks: int, head_dim: int):
    """`_as_args` of a ChunkRunView's first `chunks` chunks, None when there is no run. Prepared once per state of
    the storage (`read.prepared`): a decode step only reads."""
    if view is None or chunks == 0:
        return None
    prepared_run = view.derived.get("numba_run")  # prepared once per write by the store's owner (numba backend)
    if prepared_run is None:  # a view built by hand (tests, benchmarks): prepared for this call
        fields = {name: getattr(view, name) for name in view.FIELDS}
        prepared_run = prepared({**fields, "channel_bits": view.channel_bits}, view.spec, view.chunk_len, head_dim,
                                chunks)
    return _as_args(prepared_run)


# An absent run (no prompt chunk, no decode chunk yet) is handed as a run of no chunks of the same spec, so of the
# same types: numba compiles `_attend` once per set of argument types, and a cache that fills up would otherwise call
# it with a new set at each stage. (A view built by hand, without specs: a plain 4-bit run.)
_PLAIN_SPEC = ChunkSpec(bits=4, axis="channel", group=0, outlier_ratio=0.0, rank=0)


@functools.lru_cache(maxsize=256)
def _absent_run(spec: ChunkSpec, n: int, d: int, side: torch.dtype) -> tuple:
    """`_as_args` of a run of no chunks of `spec` (n tokens per chunk, head_dim d, side-information dtype side)."""
    fields = {f.name: torch.zeros(0, 0, 0, *f.shape[1:], dtype=f.dtype) for f in chunk_fields(spec, n, d, side)}
    return _as_args(prepare(CompressedChunk(**{name: fields[name] for name in BUILTIN_FIELDS}), spec, n, d, 0))


def _stream_runs(view, prompt_chunks: int, decode_chunks: int, n: int, d: int, side: torch.dtype):
    """(prompt run, its factors, decode run, its factors, rotated) of a StreamView as `_attend` reads them."""
    specs = view.specs or (_PLAIN_SPEC, _PLAIN_SPEC)
    present = (_run_args(view.prompt, prompt_chunks, d), _run_args(view.decode, decode_chunks, d))
    rotated = {run[2] for run in present if run is not None}
    if len(rotated) > 1:
        raise ValueError("the prompt and decode chunks disagree on whether they are rotated")
    (prompt, prompt_factors, _), (decode, decode_factors, _) = (
        run or _absent_run(spec, n, d, side) for run, spec in zip(present, specs))
    return prompt, prompt_factors, decode, decode_factors, rotated == {True}


_NO_STAGED = np.zeros((0, 0), dtype=np.bool_)
_NO_AFFINE = np.zeros((0, 0, 2, 0), dtype=np.float32)
# `_tail_args` of a full-precision buffer: no codes, statistics of the type a coded one's are read as
_NO_TAIL = (np.zeros((0, 0, 0, 0), dtype=np.uint8), _NO_SIDE, _NO_SIDE, _NO_STAGED, 8, False, _NO_AFFINE)


def _tail_args(view, unrotated: bool = True):
    """(codes, scale, minimum, staged, bits, rotated, affine) of a StreamView's coded buffer (`views.CodedTailView`)
    as `_buffer_rows` reads them: the store's fields in place (scale/minimum as their bytes, `read._side_bytes`; fp16
    ones cast to float32), staged [B,cap] or [0,0] when nothing is staged, affine [B,H,2,d] or empty (in the basis the
    rows are read in: unrotated False, a rotated buffer's rows stay rotated); `_NO_TAIL` for a full-precision
    buffer."""
    tail = view.tail
    if tail is None:
        return _NO_TAIL
    staged = tail.staged.numpy() if tail.staged is not None else _NO_STAGED
    scale, minimum = _side_bytes(tail.scale), _side_bytes(tail.minimum)
    affine = _NO_AFFINE if tail.affine is None else \
        affine_in_basis(tail, bool(tail.rotated) and not unrotated).numpy()
    return tail.codes.contiguous().numpy(), scale, minimum, staged, int(tail.bits), bool(tail.rotated), affine


_NO_CENTER = np.zeros((0, 0, 0), dtype=np.float32)


def _value_center(view, B: int, H: int, d: int) -> np.ndarray:
    """`StreamView.center` (float32 [B,H,d]: the values were handed centered) as `_attend` reads it, or an empty
    [0,0,0]."""
    center = view.center
    if center is None:
        return _NO_CENTER
    if tuple(center.shape) != (B, H, d) or center.dtype != torch.float32:
        raise ValueError(f"values.center must be float32 [B, H, d] = {(B, H, d)}, got {center.dtype} "
                         f"{tuple(center.shape)}")
    return center.contiguous().numpy()


def _rope_halves(positions: torch.Tensor, inv_freq: torch.Tensor):
    """cos/sin [B, T, d/2] float32 at the row-local positions, as the rotary module computes them (one half of
    `rope_tables`' equal halves)."""
    angles = rope_angles(positions, inv_freq)
    return angles.cos().numpy(), angles.sin().numpy()


def _float32(t: torch.Tensor | None, like: torch.Tensor) -> np.ndarray:
    if t is None:
        return np.zeros((like.shape[0], like.shape[1], 0, like.shape[3]), dtype=np.float32)
    return (t if t.dtype == torch.float32 else t.float()).contiguous().numpy()
