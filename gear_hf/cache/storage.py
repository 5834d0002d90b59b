"""Where a layer's keys or values live: row-indexed tensors that grow in bounded steps.

Every tensor is [B, H, capacity, ...] with the token (or chunk) axis at dim 2, so a kernel can read a whole segment
through one pointer. Capacity grows by at most max(granule, 1/16 of itself) past what is needed, so what a store owns
beyond what it holds stays small (spare capacity is memory the user pays for). Per-row lengths are not
kept here: they are the same for every layer and live once in the cache (`gear_hf.cache`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..compress import ChunkSpec, CompressedChunk
from ..compress.terms import chunk_fields

SPARE_FRACTION = 16  # a store grows by at most 1/16 of its capacity (or its granule) beyond what is needed


def grown_capacity(current: int, needed: int, granule: int = 1, limit: int | None = None,
                   geometric: bool = True) -> int:
    """Capacity after making room for `needed`: unchanged if it fits, else needed rounded up to a whole number of
    `granule`s and, when `geometric`, at least current + current/16 (a store that grows a token at a time then
    copies itself O(log) times, not every step); never past `limit` (a sliding layer's most). Not geometric: what a
    dense cache does (exactly what is needed)."""
    if needed <= current:
        return current
    grown = math.ceil(needed / granule) * granule
    if geometric:
        grown = max(grown, current + current // SPARE_FRACTION)
    return grown if limit is None else max(needed, min(grown, limit))


def _grown(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """Copy of t [B,H,c,...] with dim 2 made `capacity` long: enlarged (zero-filled: unused slots stay finite) or
    cut. (One op, a copy: `constant_pad_nd` is what `F.pad` runs, without its Python checks, ~3 us a call.)"""
    return torch.constant_pad_nd(t, (0, 0) * (t.dim() - 3) + (0, capacity - t.shape[2]))


# `ChunkStore.derived` key of the store's last `kernels.views.ChunkRunView` ((version, chunks, reader), view): a decode
# step between writes hands the kernel the same view (built by `Stream.kernel_view`; references, no bytes of its own)
KERNEL_VIEW = "kernel view"


class TokenStore:
    """Full-precision tokens [B, H, capacity, d]; rows write only their real tokens (padding is skipped)."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    def reserve(self, like: torch.Tensor, capacity: int) -> None:
        """Hold `capacity` tokens per row from now on (like: a [B,H,*,d] tensor for shape/dtype): the tokens held
        are kept, the rest is zero (finite)."""
        if self.data is None:
            B, H, _, d = like.shape
            self.data = like.new_zeros(B, H, capacity, d)
        elif capacity != self.capacity:
            self.data = _grown(self.data, capacity)

    def keep_tail(self, row: int, start: int, length: int) -> None:
        """Row `row` keeps its tokens [start, start+length) at the front (the rest left the buffer)."""
        if start and length:
            self.data[row, :, :length] = self.data[row, :, start : start + length].clone()

    def write(self, x: torch.Tensor, where: TokenWrites, shared: dict | None = None) -> None:
        """data[rows[i], :, columns[i]] = x[rows[i], :, tokens[i]] for every real token i; x [B,H,q,d] (shared: unused
        here; `CodedTokenStore.write`)."""
        self.data[where.rows, :, where.columns] = x[where.rows, :, where.tokens].to(self.data.dtype)

    shape = property(lambda self: self.data.shape)
    device = property(lambda self: self.data.device)

    def write_run(self, x: torch.Tensor, at: int, shared: dict | None = None) -> None:
        """Every row's tokens x [B,H,q,d] to columns [at, at+q) (shared: unused here; `CodedTokenStore.write_run`)."""
        self.data[:, :, at : at + x.shape[2]].copy_(x)

    def tokens(self, dtype: torch.dtype | None = None, n: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The first n tokens of every row [B,H,n,d] (all of them when n is None), as stored: a view (dtype: ignored
        here; a coded store decodes into it), or copied into out."""
        view = self.data if n is None else self.data[:, :, :n]
        return view if out is None else out.copy_(view)

    def gather(self, rows: list[int], starts: list[int], length: int, dtype: torch.dtype | None) -> torch.Tensor:
        """Tokens [starts[j], starts[j]+length) of row rows[j], for every j: [J,H,length,d]."""
        if len(rows) == 1 or len(set(starts)) == 1:
            at = starts[0]
            if len(rows) == 1:
                return self.data[rows[0] : rows[0] + 1, :, at : at + length]
            return self.data[rows, :, at : at + length]
        return torch.stack([self.data[row, :, at : at + length] for row, at in zip(rows, starts)])

    def end_step(self, kept: list[tuple[int, int, int]] | None = None) -> None:
        """(A full-precision store holds every token as written: nothing to do; `CodedTokenStore.end_step`.)"""

    def token_nbytes(self, cap: int | None = None) -> int:
        """Bytes one token of one row holds (floating entries counted at most `cap` bytes each, if given)."""
        size = self.data.element_size() if cap is None else min(self.data.element_size(), cap)
        return self.data.shape[1] * self.data.shape[3] * size

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def row_state_nbytes(self) -> int:
        """Bytes kept per row beside the tokens: none (`CodedTokenStore.row_state_nbytes`)."""
        return 0

    def select_rows(self, index: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, index)


@dataclass(frozen=True)
class TokenWrites:
    """Where a step's real tokens go in a TokenStore: token tokens[i] of row rows[i] to column columns[i] (long
    [N] tensors, built once per step on the host's plan and shared by every layer)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    columns: torch.Tensor

    @classmethod
    def of(cls, columns: list[list[int]], device) -> TokenWrites | None:
        """From per-row destination columns ([B][q], -1 = not written); None when no token is written."""
        entries = [(b, j, c) for b, row in enumerate(columns) for j, c in enumerate(row) if c >= 0]
        if not entries:
            return None
        rows, tokens, cols = torch.tensor(entries, dtype=torch.long).T.to(device)
        return cls(rows, tokens, cols)


class ChunkStore:
    """Compressed chunks of `chunk_len` tokens, chunk c of row b at slots [c*e, (c+1)*e) of each field's dim 2,
    where e is that field's extent for one chunk (tokens/cpb for codes, groups for scales, d for lowrank_b...).
    The fields and their extents are what the spec's terms declare (`gear_hf.compress.terms`).

    A row may fill a chunk only partly (the prompt chunk of a shorter row): the rest of it stays zero and
    reconstructs to zeros, which the attention mask hides.

    Derived state the backends read every step (prepared runs, sorted outliers) lives in `derived`, is brought up
    to date after each write (`Backend.prepare`), counted by `derived_nbytes`, and dies with the store. `version`
    counts writes; `first_changed` is the first chunk slot written since the backends last prepared.
    """

    def __init__(self, spec: ChunkSpec, chunk_len: int, plan=None) -> None:
        self._spec = spec
        self.chunk_len = chunk_len
        self.plan = plan  # gear_hf.backends.BackendPlan: who compresses and reconstructs (set before a write)
        self.fields: dict[str, torch.Tensor] = {}
        self.extent: dict[str, int] = {}
        self.component: dict[str, str] = {}
        self.capacity = 0  # chunks
        self.head_dim = 0
        self.dtype: torch.dtype | None = None  # the side dtype
        self.version = 0
        self.first_changed = 0
        self.derived: dict = {}
        # values coded centered by these `ChannelCenters` (the value buffer's: GearConfig.value_chunks_centered):
        # `reconstruct` adds them back; the fused kernels read the chunks as stored (`Stream.kernel_view`)
        self.centers = None

    @property
    def spec(self) -> ChunkSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: ChunkSpec) -> None:
        """A new spec reads the same fields differently: derived state made under the old one is stale."""
        self._spec = spec
        if self.fields:
            self._changed(0)

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy, pickle) starts without derived state: it would view the original's fields."""
        state = dict(self.__dict__)
        state["derived"] = {}
        state["version"] = self.version + 1
        return state

    def declared(self, n: int, d: int | None = None, side: torch.dtype | None = None):
        """The fields one chunk of n tokens stores (the spec's terms' declarations)."""
        return chunk_fields(self.spec, n, d or self.head_dim, side or self.dtype)

    def _allocate(self, example: CompressedChunk, batch: int, chunks: int) -> None:
        H, d = example.codes.shape[1], example.lowrank_b.shape[2]
        side = example.sparse_values.dtype  # the side dtype (a scale may hold 8-bit codes)
        for f in chunk_fields(self.spec, self.chunk_len, d, side):
            self.extent[f.name] = f.shape[0]
            self.component[f.name] = f.component
            self.fields[f.name] = torch.zeros(batch, H, chunks * f.shape[0], *f.shape[1:], dtype=f.dtype,
                                              device=example.codes.device)
        self.capacity = chunks
        self.head_dim = d
        self.dtype = side
        self._changed(0)

    def _changed(self, first_chunk: int) -> None:
        """The fields changed from chunk slot `first_chunk` on (or were replaced): the backends' derived state
        follows (`Backend.prepare`), the kernel view goes (it may reference replaced fields)."""
        self.version += 1
        self.derived.pop(KERNEL_VIEW, None)
        self.first_changed = min(self.first_changed, first_chunk)
        for backend in self.plan.accelerators if self.plan is not None else ():
            backend.prepare(self)
        self.first_changed = self.capacity  # (nothing pending)

    def reserve(self, example: CompressedChunk, batch: int, chunks: int, limit: int | None = None) -> None:
        """Room for `chunks` chunks per row (bounded growth, never past `limit` chunks); example: a compressed
        chunk (for shapes and dtypes)."""
        if not self.fields:
            self._allocate(example, batch, chunks)
        elif chunks > self.capacity:
            new_capacity = grown_capacity(self.capacity, chunks, limit=limit)
            for name, t in self.fields.items():
                self.fields[name] = _grown(t, new_capacity * self.extent[name])
            old, self.capacity = self.capacity, new_capacity
            self._changed(old)  # (the chunks held moved, unchanged: derived state of them stays valid)

    def compress_rows(self, x: torch.Tensor, rows: list[int], chunks: list[int], batch: int,
                      reserve_chunks: int, channel_bits: torch.Tensor | None = None,
                      limit: int | None = None) -> None:
        """Compress x [J,H,n,d] (J chunks of n <= chunk_len tokens, in one call) and store job j as chunk
        `chunks[j]` of row `rows[j]`. Chunks of one length compress exactly as each would alone (every statistic
        is per batch row), so batching changes no bit; callers group jobs by length. channel_bits [J,H,d]: the
        jobs' key widths (an allocated spec)."""
        compressed = self.plan.compress.compress(self.spec, x, channel_bits)
        self.store_rows(compressed, x.shape[2], rows, chunks, batch, reserve_chunks, limit)

    def store_rows(self, compressed: CompressedChunk, n: int, rows: list[int], chunks: list[int], batch: int,
                   reserve_chunks: int, limit: int | None = None) -> None:
        """Store J chunks of n tokens already in this store's format (`compress_rows`, or a buffer that encoded
        them on arrival: `CodedTokenStore`) as chunk `chunks[j]` of row `rows[j]`."""
        device = compressed.codes.device
        full = n == self.chunk_len
        capacity = max(max(chunks) + 1, reserve_chunks)  # (reserve_chunks: slots the rows are known to reach)
        if not self.fields and full and capacity == 1 and rows == list(range(batch)):
            self._adopt(compressed)  # the whole store, as compressed (a prompt chunk of every row at once)
            return
        self.reserve(compressed, batch, capacity, limit)
        row_index = torch.tensor(rows, device=device)
        for name in self.fields:
            src = getattr(compressed, name)  # [J, H, e, ...]: a short chunk may fill less (extent, rank)
            e = self.extent[name]
            if full and src.shape[2] == e:  # one indexed copy for every job: field as [B, H, chunks, e, ...]
                target = self.fields[name].unflatten(2, (self.capacity, e))
                target[row_index, :, torch.tensor(chunks, device=device)] = src
                continue
            for j, (row, chunk) in enumerate(zip(rows, chunks)):
                target = self.fields[name][row, :, chunk * e : chunk * e + src.shape[2]]
                target[tuple(slice(0, n) for n in src.shape[1:])] = src[j]
        self._changed(min(chunks))

    def _adopt(self, chunk: CompressedChunk) -> None:
        """Take a compressed chunk of every row as the store's one chunk: its tensors become the fields (those
        that own their memory exactly; others are copied), with no zero-filled allocation and no copy."""
        d, side = chunk.lowrank_b.shape[2], chunk.sparse_values.dtype
        for f in chunk_fields(self.spec, self.chunk_len, d, side):
            t = getattr(chunk, f.name)
            owns = t.is_contiguous() and t.storage_offset() == 0 \
                and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            self.fields[f.name] = t if owns else t.clone(memory_format=torch.contiguous_format)
            self.extent[f.name] = t.shape[2]
            self.component[f.name] = f.component
        self.capacity = 1
        self.head_dim = d
        self.dtype = side
        self._changed(0)

    def discard_leading(self, count: int, live: int) -> None:
        """Drop the first `count` chunks of every row, moving the next `live` ones to the front (a sliding
        layer's chunks that left every row's window): capacity, and so memory, stays bounded by the window."""
        if count <= 0 or not self.fields:
            return
        for name, t in self.fields.items():
            e = self.extent[name]
            t[:, :, : live * e] = t[:, :, count * e : (count + live) * e].clone()
        self._changed(0)

    def chunk_nbytes(self, n: int, itemsize_cap: int | None = None) -> dict[str, int]:
        """Bytes, by component, that one row's chunk of n tokens occupies (for accounting, from the declarations).
        itemsize_cap: count floating fields at most this many bytes per element (the 16-bit view)."""
        H = self.fields["codes"].shape[1]
        out: dict[str, int] = {}
        for f in self.declared(n):
            out[f.component] = out.get(f.component, 0) + H * f.nbytes(itemsize_cap)
        return out

    def run(self, chunks: int) -> CompressedChunk:
        """Views of the first `chunks` chunks of every field (what a read decompresses)."""
        return CompressedChunk({name: t[:, :, : chunks * self.extent[name]] for name, t in self.fields.items()})

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
        result = self.plan.reconstruct.reconstruct(self, chunks, out_dtype, out, rotary, scratch)
        if self.centers is not None and self.centers.fitted:
            if rotary is not None:
                raise ValueError("centered chunks (values) are never read rotated")
            self.centers.restore_(result)
        return result

    def nbytes_by_component(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, t in self.fields.items():
            out[self.component[name]] = out.get(self.component[name], 0) + t.numel() * t.element_size()
        return out

    def derived_nbytes(self) -> int:
        """Bytes the backends' derived state of this store owns (beyond views of the fields)."""
        backends = self.plan.accelerators if self.plan is not None else ()
        return sum(getattr(b, "derived_nbytes", lambda store: 0)(self) for b in backends)

    def select_rows(self, index: torch.Tensor) -> None:
        for name, t in self.fields.items():
            self.fields[name] = t.index_select(0, index)
        self.derived.clear()  # (rows moved: derived again from the start)
        self._changed(0)
