"""CPU read kernels (numba), torch-facing: a chunk run decompressed (and keys rotated) in one pass.

The loops are in `dequant` (what they compute and cover: see there); here what decides whether they apply
(`decompress_supported`, `rotate_supported`), a run's arrays as they read them (`prepare`, and `prepared`: memoised
per state of the storage) and the calls (`decompress_run`, `decompress_into`, `rotate_into`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from ...compress import ChunkSpec, CompressedChunk
from ...compress.terms import BUILTIN_FIELDS
from . import arrays
from .dequant import _decompress, _decompress_bf16, _rotate


# -- torch-facing entry points --------------------------------------------------------------------------------
def decompress_supported(spec: ChunkSpec, head_dim: int, out: torch.Tensor | None, rotary=None) -> bool:
    """True when `decompress_into` covers this spec and output (else the torch `decompress` runs): float32 out, or
    bf16 out; rotary (the (cos, sin) it would rotate by, if any) over every channel, in out's dtype."""
    if not spec.allocated and spec.bits not in (2, 3, 4, 8):
        return False
    if out is None or out.dtype not in (torch.float32, torch.bfloat16) or out.device.type != "cpu":
        return False
    if rotary is not None and (rotary[0].dtype != out.dtype or rotary[0].shape[-1] != head_dim):
        return False  # (partial rotary, or cos/sin wider than the keys: the torch path)
    if spec.axis == "token":  # groups split the channels (or one covers them all), codes fill whole bytes of 8
        group = min(spec.group or head_dim, head_dim)
        return head_dim % group == 0 and head_dim % 8 == 0
    return True


@dataclass(frozen=True)
class Run:
    """A chunk run's arrays as `_decompress` reads them (`prepare`): valid while the fields it came from hold the
    same values (`ChunkStore` keeps one per run length until it writes), so a decode step only views its output."""

    codes: np.ndarray
    bits: int
    group: int
    channel_axis: bool
    scale: np.ndarray  # as its bytes (`_stats_bytes`)
    minimum: np.ndarray
    factors: tuple  # `_factors`, or _NO_FACTORS
    outliers: tuple  # (values and index as their bytes (`_side_bytes`, `_index_bytes`), rows used), or _NO_OUTLIERS
    n: int  # tokens per chunk
    tokens: int  # chunks * n
    hadamard: bool  # the spec rotates: undo the Walsh-Hadamard rotation
    widths: np.ndarray  # uint8 [B,H,C,d]: each chunk's width per channel (allocated specs), else [B,H,0,d]


def prepare(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, chunks: int) -> Run:
    """The arrays `decompress_run` reads for `chunks` consecutive chunks of n tokens (`decompress_supported`): views of
    the stored fields where numba can read them in place (bf16 side information as its bits), so a prepared run
    holds no second copy of the storage. Every field is handed from its first row to the end of the store, C-contiguous
    (the outliers with the count of rows in use): a view of fewer rows would be another array type, for which numba
    compiles every kernel that reads it again."""
    outliers = (_side_bytes(chunk.sparse_values), _index_bytes(chunk.sparse_index), chunk.sparse_index.shape[2]) \
        if chunk.sparse_index.numel() else _NO_OUTLIERS
    group = spec.group_for(n, d) if spec.axis == "channel" else min(spec.group_for(n, d), d)  # (> d: one group)
    scale, minimum = _stats_bytes(chunk.scale), _stats_bytes(chunk.minimum)
    return Run(codes=_stored(chunk.codes), bits=0 if spec.allocated else int(spec.bits), group=group,
               channel_axis=spec.axis == "channel", scale=scale, minimum=minimum,
               factors=_factors(chunk, chunks) if chunk.lowrank_a.shape[-1] else _NO_FACTORS, outliers=outliers,
               n=n, tokens=chunks * n, hadamard=spec.rotate, widths=chunk.channel_bits.contiguous().numpy())


def prepared(fields: dict, spec: ChunkSpec, n: int, d: int, chunks: int) -> Run:
    """`prepare` of the first `chunks` chunks of a store's fields (`ChunkStore.fields`: every `CompressedChunk`
    field, [B,H,capacity*extent,...]; channel_bits may be absent or None for a spec without widths per channel).
    Not memoised: the owner of the fields keeps the result while they are unwritten (the numba backend keeps it in
    the store's derived state)."""
    anchor = fields["codes"]
    capacity = fields["lowrank_a"].shape[2] // n
    B, H = anchor.shape[:2]
    widths = fields.get("channel_bits")
    parts = {name: fields[name][:, :, : chunks * (fields[name].shape[2] // capacity)]
             for name in BUILTIN_FIELDS if name != "channel_bits"}
    parts["channel_bits"] = widths[:, :, :chunks] if widths is not None and widths.shape[2] else \
        torch.zeros(B, H, 0, d, dtype=torch.uint8)
    return prepare(CompressedChunk(**parts), spec, n, d, chunks)


def _stored(t: torch.Tensor) -> np.ndarray:
    """t [B,H,m,...] (rows of a stored field) as an array without a copy where numba can read it in place, from t's
    first row to the end of the field (a run starts at the field's first row, so this is the field itself,
    C-contiguous)."""
    array, at = arrays.readable(t)
    return array[:, :, at:]


def _index_bytes(index: torch.Tensor) -> np.ndarray:
    """An outlier index (uint8; int16 past 256 positions, int32 past 32,768) as its bytes in place, uint8 [B,H,m,k*w],
    read little-endian by `dequant._add_outliers`: every width one array type, so one signature of each kernel that
    reads runs (a wide index would otherwise compile the whole attention kernel again)."""
    if sys.byteorder != "little":
        raise NotImplementedError("the CPU kernels read outlier indices as little-endian bytes")
    return _stored(index.view(torch.uint8))


def _stats_bytes(t: torch.Tensor) -> np.ndarray:
    """A statistics field (scale or minimum, [B,H,m,k]) as its bytes, uint8 [B,H,m,k*w], read by `bf16.stored_stats`
    (w = 1: 8-bit statistics' codes; 2: bf16; 4: float32, fp16 ones cast to it): one array type for every statistics
    format, so a recommended configuration (8-bit value statistics) and a paper preset (bf16) share each kernel's
    signature."""
    if t.dtype == torch.uint8:
        return _stored(t)
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"statistics of dtype {t.dtype} are not read by the CPU kernels; allowed: uint8 (8-bit "
                         "statistics), bfloat16, float16, float32")
    return _bytes(t)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A 16- or 32-bit field [B,H,m,k] as its bytes [B,H,m,k*w]: bf16 in place (w = 2); fp16 and float32 as float32
    (w = 4; fp16 models' side information, cast: a copy)."""
    if t.dtype == torch.bfloat16:
        return _stored(t.view(torch.int16)).view(np.uint8)
    return t.float().contiguous().numpy().view(np.uint8)


def _side_bytes(t: torch.Tensor) -> np.ndarray:
    """Side information [B,H,m,k] (outlier values, low-rank factors, a coded buffer's statistics) as its bytes, uint8
    [B,H,m,k,w], read by `bf16.side_entry`: w = 1, int8 factor codes, and 2, bf16, in place; 4, float32 (fp16 ones
    cast to it). One array type for every side dtype, so an fp16 model shares each kernel's signature with bf16 and
    float32 ones."""
    if t.dtype in (torch.int8, torch.bfloat16, torch.float32) and t.is_contiguous():  # (a whole field, in place)
        return t.view(torch.uint8).numpy().reshape(*t.shape, t.element_size())
    if t.dtype == torch.int8:
        array, width = _stored(t.view(torch.uint8)), 1
    elif t.dtype in (torch.bfloat16, torch.float16, torch.float32):
        array, width = _bytes(t), 2 if t.dtype == torch.bfloat16 else 4
    else:
        raise ValueError(f"side information of dtype {t.dtype} is not read by the CPU kernels; allowed: int8 "
                         "(low-rank factor codes), bfloat16, float16, float32")
    return array.reshape(*array.shape[:3], t.shape[3], width)


def decompress_run(run: Run, out: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The prepared run into out [B,H,tokens,d] float32 or bf16 (`decompress_into`); returns out."""
    bf16 = out.dtype == torch.bfloat16  # (numpy has no bf16: its bits, as int16)
    bits = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
    no_rotation = _NO_ROTATION_BF16 if bf16 else _NO_ROTATION
    (cos, cos_at), (sin, sin_at) = (arrays.readable(bits(t)) for t in rotary) if rotary else ((no_rotation, 0),) * 2
    assert cos_at == sin_at, "cos and sin tables of one layout"
    view = bits(out)
    written, whole, at = arrays.target(view)
    (_decompress_bf16 if bf16 else _decompress)(
        run.codes, run.bits, run.group, run.channel_axis, run.scale, run.minimum, *run.factors, *run.outliers, run.n,
        run.tokens, run.hadamard, run.widths, whole, at, cos, sin, cos_at)
    if written is not view:
        view.copy_(written)
    return out


def decompress_into(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, chunks: int, out: torch.Tensor,
                    rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`gear_hf.compress.decompress` of `chunks` consecutive chunks of n tokens into out [B,H,chunks*n,d] float32
    or bf16 (`decompress_supported` says when it applies): bit for bit without a low-rank term, else to float32 rounding
    (the rank terms summed in another order than the matmul's). rotary: (cos, sin) [B|1,1,chunks*n,d] to return
    the tokens rotated (`rotate_into`'s result: keys read by the attention), in the same pass."""
    return decompress_run(prepare(chunk, spec, n, d, chunks), out, rotary)


def _factors(chunk: CompressedChunk, chunks: int) -> tuple:
    """(a, a_scale, b, b_scale) as `_add_lowrank` reads them: the factors as their bytes (`_side_bytes`, in place but
    for fp16), int8 ones with their per-chunk column scales, 16-bit ones with scales of one."""
    a, b = chunk.lowrank_a, chunk.lowrank_b
    if a.dtype == torch.int8:  # (their scales, [B,H,C,r], cast)
        a_scale, b_scale = chunk.lowrank_a_scale.float().numpy(), chunk.lowrank_b_scale.float().numpy()
    else:
        a_scale = b_scale = np.ones((a.shape[0], a.shape[1], chunks, a.shape[3]), dtype=np.float32)
    return _side_bytes(a), a_scale, _side_bytes(b), b_scale


# no low-rank term / no outliers / no rotation: empty arrays of the kernel's types (rank 0, no entries, no rows; the
# types a run with them hands: one kernel signature for both)
_NO_SIDE = np.zeros((0, 0, 0, 0, 1), dtype=np.uint8)
_NO_FACTORS = (_NO_SIDE, np.zeros((0, 0, 0, 0), dtype=np.float32), _NO_SIDE, np.zeros((0, 0, 0, 0), dtype=np.float32))
_NO_OUTLIERS = (_NO_SIDE, np.zeros((0, 0, 0, 0), dtype=np.uint8), 0)


_NO_ROTATION = np.zeros((1, 1, 0, 1), dtype=np.float32)
_NO_ROTATION_BF16 = np.zeros((1, 1, 0, 1), dtype=np.int16)


def rotate_supported(x: torch.Tensor, cos: torch.Tensor, out: torch.Tensor) -> bool:
    """True when `rotate_into` covers these tensors (float32 on CPU, every channel rotated, cos [B|1,1,T,d])."""
    return (x.dtype == cos.dtype == out.dtype == torch.float32 and x.device.type == "cpu" and x.ndim == 4
            and cos.shape[-1] == x.shape[-1] and cos.ndim == 4 and cos.shape[1] == 1)


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`gear_hf.compress.rope.apply_rotary(x, cos, sin, out=out)`, bit for bit, in one pass (`rotate_supported`)."""
    source = arrays.readable(x)
    written, whole, at = arrays.target(out)
    (cos, cos_at), (sin, sin_at) = arrays.readable(cos), arrays.readable(sin)
    assert cos_at == sin_at, "cos and sin tables of one layout"
    _rotate(*source, cos, sin, cos_at, x.shape[2], whole, at)
    return out if written is out else out.copy_(written)
