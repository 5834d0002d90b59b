"""Where a layer's keys or values live: preallocated, row-indexed tensors that grow geometrically.

Every tensor is [B, H, capacity, ...] with the token (or chunk) axis at dim 2, so appending never copies
the cache and a kernel can read a whole segment through one pointer. Per-row lengths are not kept here:
they are the same for every layer and live once in the cache (`gear_hf.cache`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from . import kernels  # light: triton and numba are imported only when a kernel is fetched
from .compress import ChunkSpec, CompressedChunk, compress, decompress
from .compress.allocation import even_channel_bits
from .rope import apply_rotary

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

    def shrink(self, capacity: int) -> None:
        """Hold `capacity` tokens per row (keeping the first ones): frees what a prompt step needed."""
        if self.data is not None and capacity < self.capacity:
            self.data = torch.cat([self.data[:, :, :capacity], self.data[:, :, -1:]], dim=2)

    def keep_tail(self, row: int, start: int, length: int) -> None:
        """Row `row` keeps its tokens [start, start+length) at the front (the rest left the buffer)."""
        if start and length:
            self.data[row, :, :length] = self.data[row, :, start : start + length].clone()

    def write(self, x: torch.Tensor, columns: torch.Tensor) -> None:
        """data[b, :, columns[b, j]] = x[b, :, j]; x [B,H,q,d], columns [B,q] (scratch for skipped tokens)."""
        index = columns[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
        self.data.scatter_(2, index, x.to(self.data.dtype))

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def select_rows(self, index: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, index)


# Fields of a CompressedChunk, in storage order.
FIELDS = ("codes", "channel_bits", "scale", "minimum", "sparse_values", "sparse_index", "lowrank_a", "lowrank_b",
          "lowrank_a_scale", "lowrank_b_scale")
COMPONENT_OF = {"codes": "codes", "channel_bits": "scales", "scale": "scales", "minimum": "scales",
                "sparse_values": "sparse_values", "sparse_index": "sparse_indices", "lowrank_a": "lowrank",
                "lowrank_b": "lowrank", "lowrank_a_scale": "lowrank", "lowrank_b_scale": "lowrank"}


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
        self._chunk_nbytes: dict = {}  # (n, itemsize cap) -> bytes by component (accounting memo)
        self._runs: dict[int, CompressedChunk] = {}  # chunks -> views of the first `chunks` of every field

    def _allocate(self, example: CompressedChunk, batch: int, chunks: int, example_is_full: bool) -> None:
        # The extents of a full chunk: the example's when it is one (a prompt step compresses its longest rows
        # first), else from compressing zeros of the full length once (one cheap iteration).
        H, d = example.lowrank_b.shape[1], example.lowrank_b.shape[2]
        full = example
        if not example_is_full:
            # zeros in the side dtype: the same field dtypes as the model dtype they came from (compress.side_dtype)
            full = self._probe(example.scale.new_zeros(1, H, self.chunk_len, d))
        for name in FIELDS:
            t = getattr(full, name)
            self.extent[name] = t.shape[2]
            self.fields[name] = t.new_zeros(batch, t.shape[1], chunks * t.shape[2], *t.shape[3:])
        self._fields_changed()
        self.capacity = chunks
        self.head_dim = d
        self.dtype = example.scale.dtype  # the side dtype (compress.side_dtype): probes compress like it

    def _fields_changed(self) -> None:
        """Forget the run views: the fields were replaced. (The CPU kernels' prepared runs follow the tensors
        themselves: `cpu.prepared`.)"""
        self._runs.clear()

    def reserve(self, example: CompressedChunk, batch: int, chunks: int, example_is_full: bool = False) -> None:
        """Room for `chunks` chunks per row; example: a compressed chunk (example_is_full: of chunk_len tokens)."""
        if not self.fields:
            self._allocate(example, batch, chunks, example_is_full)
        elif chunks > self.capacity:
            new_capacity = grown_capacity(self.capacity, chunks)
            for name, t in self.fields.items():
                self.fields[name] = _grown(t, new_capacity * self.extent[name])
            self.capacity = new_capacity
            self._fields_changed()

    def compress_rows(self, x: torch.Tensor, rows: list[int], chunks: list[int], batch: int,
                      reserve_chunks: int, channel_bits: torch.Tensor | None = None) -> None:
        """Compress x [J,H,n,d] (J chunks of n <= chunk_len tokens, in one call) and store job j as chunk
        `chunks[j]` of row `rows[j]`. Chunks of one length compress exactly as each would alone (every statistic
        is per batch row), so batching changes no bit; callers group jobs by length. channel_bits [J,H,d]: the
        jobs' key widths (an allocated spec)."""
        backbone, factors = self._cpu_steps(x)
        compressed = compress(x, self.spec, quantize_pack=self._quantize_pack(x), channel_bits=channel_bits,
                              backbone=backbone, factors=factors)
        full = x.shape[2] == self.chunk_len
        capacity = max(max(chunks) + 1, reserve_chunks)
        if not self.fields and full and capacity == 1 and rows == list(range(batch)):
            self._adopt(compressed)  # the whole store, as compressed (a prompt chunk of every row at once)
            return
        self.reserve(compressed, batch, capacity, example_is_full=full)
        row_index = torch.tensor(rows, device=x.device)
        for name in FIELDS:
            src = getattr(compressed, name)  # [J, H, e, ...]: a short chunk may fill less (extent, rank)
            e = self.extent[name]
            if full and src.shape[2] == e:  # one indexed copy for every job: field as [B, H, chunks, e, ...]
                target = self.fields[name].unflatten(2, (self.capacity, e))
                target[row_index, :, torch.tensor(chunks, device=x.device)] = src
                continue
            for j, (row, chunk) in enumerate(zip(rows, chunks)):
                target = self.fields[name][row, :, chunk * e : chunk * e + src.shape[2]]
                target[tuple(slice(0, n) for n in src.shape[1:])] = src[j]

    def _adopt(self, chunk: CompressedChunk) -> None:
        """Take a compressed chunk of every row as the store's one chunk: its tensors become the fields (those
        that own their memory exactly; others are copied), with no zero-filled allocation and no copy."""
        for name in FIELDS:
            t = getattr(chunk, name)
            owns = t.is_contiguous() and t.storage_offset() == 0 \
                and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            self.fields[name] = t if owns else t.clone(memory_format=torch.contiguous_format)
            self.extent[name] = t.shape[2]
        self._fields_changed()
        self.capacity = 1
        self.head_dim = chunk.lowrank_b.shape[2]
        self.dtype = chunk.scale.dtype

    def discard_leading(self, count: int, live: int) -> None:
        """Drop the first `count` chunks of every row, moving the next `live` ones to the front (a sliding
        layer's chunks that left every row's window): capacity, and so memory, stays bounded by the window."""
        if count <= 0 or not self.fields:
            return
        for name, t in self.fields.items():
            e = self.extent[name]
            t[:, :, : live * e] = t[:, :, count * e : (count + live) * e].clone()

    def chunk_nbytes(self, n: int, itemsize_cap: int | None = None) -> dict[str, int]:
        """Bytes, by component, that one row's chunk of n tokens occupies (for accounting; memoised per n).
        itemsize_cap: count floating fields at most this many bytes per element (the 16-bit view)."""
        key = (n, itemsize_cap)
        memo = self._chunk_nbytes
        if key not in memo:
            H, d = self.fields["lowrank_b"].shape[1], self.head_dim
            probe = self._probe(torch.zeros(1, H, n, d, dtype=self.dtype, device=self.fields["codes"].device))
            out: dict[str, int] = {}
            for name in FIELDS:
                t = getattr(probe, name)
                size = t.element_size()
                if itemsize_cap and t.is_floating_point():
                    size = min(size, itemsize_cap)
                out[COMPONENT_OF[name]] = out.get(COMPONENT_OF[name], 0) + t.numel() * size
            memo[key] = out
        return memo[key]

    def _probe(self, zeros: torch.Tensor) -> CompressedChunk:
        """Zeros [1,H,n,d] compressed (one cheap iteration): the shapes and dtypes a chunk of n tokens stores."""
        _, H, _, d = zeros.shape
        bits = even_channel_bits(1, H, d, self.spec.bits, zeros.device) if self.spec.allocated else None
        return compress(zeros, replace(self.spec, power_iters=1), channel_bits=bits)

    def _quantize_pack(self, x: torch.Tensor):
        """The Triton quantize+pack kernel when the backend resolves to triton for x's device, else None."""
        if kernels.resolve_backend(kernels.Backend(self.backend), x.device) != "triton":
            return None
        if not kernels.quantize_pack_supports(self.spec, x.shape[2], x.shape[3]):
            return None  # e.g. a group the packing kernel cannot split into bytes: the torch engine handles it
        return kernels.quantize_pack

    def _cpu_steps(self, x: torch.Tensor):
        """(backbone, factors) for `compress`: the numba kernels when the backend resolves to numba for x's device
        and they cover the spec, else (None, None)."""
        cpu = kernels.cpu_kernels(kernels.Backend(self.backend), x.device)
        if cpu is None or not cpu.compress_supported(self.spec, x):
            return None, None
        return cpu.compress_backbone, cpu.fit_factors

    def reconstruct(self, chunks: int, out_dtype: torch.dtype, out: torch.Tensor | None = None,
                    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The first `chunks` chunks of every row, decompressed: [B, H, chunks*chunk_len, d] (into `out` if given).
        Chunks lie one after the other along each field's dim 2, so they decompress in one call, in place.
        rotary: (cos, sin) [B|1,1,chunks*chunk_len,d] to return them rotated (keys before RoPE: `apply_rotary`'s
        result; the CPU kernels rotate as they write); scratch: a tensor like out that the torch path decompresses
        into before rotating (else a temporary)."""
        if chunks == 0 or not self.fields:
            return torch.empty(0)
        run = self._runs.get(chunks)
        if run is None:  # views, kept while the fields are the same tensors (every decode step reads them)
            run = self._runs[chunks] = CompressedChunk(**{name: t[:, :, : chunks * self.extent[name]]
                                                          for name, t in self.fields.items()})
        cpu = kernels.cpu_kernels(kernels.Backend(self.backend), run.codes.device)
        if cpu is not None:
            if out is None and out_dtype in (torch.float32, torch.bfloat16):
                B, H = run.codes.shape[:2]
                out = torch.empty(B, H, chunks * self.chunk_len, self.head_dim, dtype=out_dtype)
            if cpu.decompress_supported(self.spec, self.head_dim, out, rotary):
                prepared = cpu.prepared(self.fields, self.spec, self.chunk_len, self.head_dim, chunks)
                return cpu.decompress_run(prepared, out, rotary)
        if rotary is None:
            return decompress(run, self.spec, self.chunk_len, self.head_dim, out_dtype, chunks=chunks, out=out)
        x = decompress(run, self.spec, self.chunk_len, self.head_dim, out_dtype, chunks=chunks, out=scratch)
        return apply_rotary(x, *rotary, out=out)

    def nbytes_by_component(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, t in self.fields.items():
            out[COMPONENT_OF[name]] = out.get(COMPONENT_OF[name], 0) + t.numel() * t.element_size()
        return out

    def select_rows(self, index: torch.Tensor) -> None:
        for name, t in self.fields.items():
            self.fields[name] = t.index_select(0, index)
        self._fields_changed()
