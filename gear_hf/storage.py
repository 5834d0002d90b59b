"""Where a layer's keys or values live: preallocated, row-indexed tensors that grow geometrically.

Every tensor is [B, H, capacity, ...] with the token (or chunk) axis at dim 2, so appending never copies
the cache and a kernel can read a whole segment through one pointer. Per-row lengths are not kept here:
they are the same for every layer and live once in the cache (`gear_hf.cache`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .compress import ChunkSpec, CompressedChunk, compress, decompress

GROWTH = 1.5


def grown_capacity(current: int, needed: int) -> int:
    """Capacity after making room for `needed`: unchanged if it fits, else at least GROWTH times larger."""
    return current if needed <= current else max(needed, math.ceil(current * GROWTH))


def _grown(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """Copy of t [B,H,c,...] with dim 2 enlarged to `capacity` (zero-filled: unused slots stay finite)."""
    out = t.new_zeros(*t.shape[:2], capacity, *t.shape[3:])
    out[:, :, : t.shape[2]] = t
    return out


class TokenStore:
    """Full-precision tokens [B, H, capacity + 1, d]; the last column is a scratch slot for skipped tokens."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[2] - 1

    @property
    def scratch(self) -> int:
        return self.capacity

    def reserve(self, like: torch.Tensor, capacity: int) -> None:
        """Hold exactly `capacity` tokens per row from now on (like: a [B,H,*,d] tensor for shape/dtype)."""
        if self.data is None:
            B, H, _, d = like.shape
            self.data = like.new_zeros(B, H, capacity + 1, d)
        elif capacity > self.capacity:
            self.data = _grown(self.data[:, :, : self.capacity], capacity + 1)

    def write(self, x: torch.Tensor, columns: torch.Tensor) -> None:
        """data[b, :, columns[b, j]] = x[b, :, j]; x [B,H,q,d], columns [B,q] (scratch for skipped tokens)."""
        index = columns[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
        self.data.scatter_(2, index, x.to(self.data.dtype))

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def select_rows(self, index: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, index)


class _Backend:
    """The one field of a GearConfig that `kernels.resolve_backend` reads."""

    def __init__(self, backend: str) -> None:
        self.backend = backend


# Fields of a CompressedChunk, in storage order.
FIELDS = ("codes", "scale", "minimum", "sparse_values", "sparse_index", "lowrank_a", "lowrank_b",
          "lowrank_a_scale", "lowrank_b_scale")
COMPONENT_OF = {"codes": "codes", "scale": "scales", "minimum": "scales", "sparse_values": "sparse_values",
                "sparse_index": "sparse_indices", "lowrank_a": "lowrank", "lowrank_b": "lowrank",
                "lowrank_a_scale": "lowrank", "lowrank_b_scale": "lowrank"}


class ChunkStore:
    """Compressed chunks of `chunk_len` tokens, chunk c of row b at slots [c*e, (c+1)*e) of each field's dim 2,
    where e is that field's extent for one chunk (tokens/cpb for codes, groups for scales, d for lowrank_b...).

    A row may fill a chunk only partly (the prompt chunk of a shorter row): the rest of it stays zero and
    reconstructs to zeros, which the attention mask hides.
    """

    def __init__(self, spec: ChunkSpec, chunk_len: int, backend: str = "auto") -> None:
        self.spec = spec
        self.chunk_len = chunk_len
        self.backend = backend  # GearConfig.backend: "triton" (resolved) quantizes with the Triton kernel
        self.fields: dict[str, torch.Tensor] = {}
        self.extent: dict[str, int] = {}
        self.capacity = 0  # chunks
        self.head_dim = 0
        self.dtype: torch.dtype | None = None

    def _allocate(self, example: CompressedChunk, batch: int, chunks: int) -> None:
        # The extents of a full chunk come from compressing zeros of the full length once (one cheap iteration).
        H, d = example.lowrank_b.shape[1], example.lowrank_b.shape[2]
        # zeros in the side dtype: the same field dtypes as the model dtype they came from (compress.side_dtype)
        full = compress(example.scale.new_zeros(1, H, self.chunk_len, d), replace(self.spec, power_iters=1))
        for name in FIELDS:
            t = getattr(full, name)
            self.extent[name] = t.shape[2]
            self.fields[name] = t.new_zeros(batch, t.shape[1], chunks * t.shape[2], *t.shape[3:])
        self.capacity = chunks
        self.head_dim = d
        self.dtype = example.lowrank_b.dtype

    def reserve(self, example: CompressedChunk, batch: int, chunks: int) -> None:
        if not self.fields:
            self._allocate(example, batch, chunks)
        elif chunks > self.capacity:
            new_capacity = grown_capacity(self.capacity, chunks)
            for name, t in self.fields.items():
                self.fields[name] = _grown(t, new_capacity * self.extent[name])
            self.capacity = new_capacity

    def compress_into(self, x: torch.Tensor, row: int, chunk: int, batch: int, reserve_chunks: int) -> None:
        """Compress x [1,H,n,d] (n <= chunk_len) and store it as chunk `chunk` of row `row`."""
        if not torch.isfinite(x).all():  # one NaN would poison its whole group's min/max: fail loudly
            raise ValueError(f"non-finite keys/values (NaN or inf) in row {row} reached the GEAR cache; the "
                             "model produced them before the cache (check the dtype's range, e.g. fp16)")
        compressed = compress(x, self.spec, quantize_pack=self._quantize_pack(x))
        self.reserve(compressed, batch, max(chunk + 1, reserve_chunks))
        for name in FIELDS:
            src = getattr(compressed, name)[0]  # [H, e_row, ...]: a short row may fill less (extent, rank)
            start = chunk * self.extent[name]
            target = self.fields[name][row, :, start : start + src.shape[1]]
            target[tuple(slice(0, n) for n in src.shape)] = src

    def _quantize_pack(self, x: torch.Tensor):
        """The Triton quantize+pack kernel when the backend resolves to triton for x's device, else None."""
        from . import kernels  # light: triton itself is imported only when the kernel is fetched

        if kernels.resolve_backend(_Backend(self.backend), x.device) != "triton":
            return None
        if not kernels.quantize_pack_supports(self.spec, x.shape[2], x.shape[3]):
            return None  # e.g. a group the packing kernel cannot split into bytes: the torch engine handles it
        return kernels.quantize_pack

    def reconstruct(self, chunks: int, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The first `chunks` chunks of every row, decompressed: [B, H, chunks*chunk_len, d] (into `out` if given).
        Chunks lie one after the other along each field's dim 2, so they decompress in one call, in place."""
        if chunks == 0 or not self.fields:
            return torch.empty(0)
        run = CompressedChunk(**{name: t[:, :, : chunks * self.extent[name]] for name, t in self.fields.items()})
        return decompress(run, self.spec, self.chunk_len, self.head_dim, out_dtype, chunks=chunks, out=out)

    def nbytes_by_component(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, t in self.fields.items():
            out[COMPONENT_OF[name]] = out.get(COMPONENT_OF[name], 0) + t.numel() * t.element_size()
        return out

    def select_rows(self, index: torch.Tensor) -> None:
        for name, t in self.fields.items():
            self.fields[name] = t.index_select(0, index)
