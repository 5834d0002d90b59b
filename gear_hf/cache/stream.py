"""`Stream`: the keys (before RoPE) or the values of one layer, in the four row-local segments of `RowLayout`.

    sink    TokenStore  [B, H, sink+1, d]      full precision
    prefill ChunkStore  one chunk of prompt_capacity tokens per row (rank_prefill)
    decode  ChunkStore  chunks of n_b tokens (rank_decode); a sliding layer drops the leading ones
    buffer  TokenStore  [B, H, capacity+1, d]  full precision, this step's own tokens included; or a
            CodedTokenStore holding each token in a per-token format (`StreamFormat.tail`)

A stream with a held chunk (`StreamFormat.held_chunk`: `GearConfig.value_buffer_size` / `key_buffer_size`,
`held_for`) keeps each row's newest decode chunk at its buffer's front for a while: `gear_hf.cache.held`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..compress import ChunkSpec
from ..compress.allocation import allocate_channel_bits
from ..kernels.views import ChunkRunView, StreamView
from .coded_store import CodedTokenStore
from .held import HeldChunkPlans
from .layout import RowCounts, RowLayout, SlotPlan, StepPlan
from .storage import KERNEL_VIEW, ChunkStore, TokenStore


@dataclass(frozen=True)
class Released:
    """What a sliding layer has dropped: the prompt chunk (when outside every row's window) and the leading
    decode chunks (the same number for every row)."""

    prompt: bool = False
    chunks: int = 0


@dataclass(frozen=True)
class _Segment:
    """One segment of every row: row b's tokens are at [0, length[b]) of what `take` gives ([B, H, n, d])."""

    take: Callable[..., torch.Tensor]  # (dtype, out=None, rotary=None, scratch=None) -> [B,H,n,d]; a store
    # reconstructs into `out`; rotary (cos, sin) [B|1,1,n,d]: rotated (keys before RoPE), through scratch (like out)
    local_start: tuple[int, ...]  # per row: row-local index of the segment's first token
    length: tuple[int, ...]


class Stream(HeldChunkPlans):
    """One layer's keys or values (module docstring); the held chunk's bookkeeping: `HeldChunkPlans`."""

    def __init__(self, prefill_spec: ChunkSpec, decode_spec: ChunkSpec, chunk_len: int, kind: str,
                 tail: ChunkSpec | None = None, held_chunk: bool = False, release_after: int | None = None,
                 centered: bool = False, chunks_centered: bool = False) -> None:
        self.kind = kind  # "key" or "value"
        self.held_chunk = held_chunk  # the newest decode chunk stays at the buffer's front (module docstring)
        self.release_after = release_after or chunk_len  # (buffered tokens after a held chunk that release it)
        self.holding: list[bool] = []  # per row: its buffer starts with a held chunk (between flushes)
        self.prefill_spec, self.decode_spec = prefill_spec, decode_spec
        self.sink = TokenStore()
        # (keys centered and scaled, values centered only: `channel_centers`)
        self.buffer = TokenStore() if tail is None else CodedTokenStore(tail, centered, scaled=kind == "key")
        # values coded centered in the chunks too, by the buffer's centers (GearConfig.value_chunks_centered)
        self.chunk_centers = self.buffer.centers if chunks_centered and tail is not None else None
        self.prefill: ChunkStore | None = None
        self.decode = ChunkStore(decode_spec, chunk_len)
        self.decode.centers = self.chunk_centers
        self.chunk_len = chunk_len
        self.plan = None  # gear_hf.backends.BackendPlan, set by `bind` when the cache first sees its tensors
        # keys with bits allocated per channel: each row's widths [B,H,d], fixed at its first compression
        self.channel_bits: torch.Tensor | None = None
        self.allocated_rows: list[bool] = []

    def bind(self, plan) -> None:
        """Use these backends from now on (the cache's plan, resolved once for its format and device)."""
        self.plan = plan
        for store in (self.prefill, self.decode):
            if store is not None:
                store.plan = plan
        if isinstance(self.buffer, CodedTokenStore):
            self.buffer.plan = plan

    @property
    def allocates(self) -> bool:
        return self.decode_spec.allocated

    def compresses(self, plan: StepPlan) -> bool:
        """Whether this step's flush compresses anything of this stream: the layout flushes, or a row releases its
        held chunk (release_after tokens buffered after it)."""
        if plan.flush:
            return True
        if not (self.held_chunk and any(self.holding)):
            return False
        return any(now and not after for now, after in zip(self._front(rows=len(plan.after.chunks)),
                                                            self._holding_after(plan)))

    def needs_query_energy(self) -> bool:
        """Some row's channel widths are still to be chosen (from the query energy seen until then)."""
        return self.allocates and not all(self.allocated_rows or [False])

    # -- writing ---------------------------------------------------------------------------------------------
    def append(self, plan: StepPlan, x: torch.Tensor, sink_tokens: int) -> None:
        """This step's tokens x [B,H,q,d] into the sink and the buffer, as planned."""
        if sink_tokens and plan.sink_capacity:
            self.sink.reserve(x, plan.sink_capacity)
            if plan.sink_writes is not None:
                self.sink.write(x, plan.sink_writes)
        self.buffer.reserve(x, self._capacities(plan, self._holding_after(plan) if self.held_chunk else [])[0])
        front = self._front(rows=x.shape[0])  # (a held chunk before each row's buffered tokens)
        if plan.buffer_run is not None and len(set(front)) == 1:  # every row's tokens to the same columns: a copy
            self.buffer.write_run(x, plan.buffer_run + front[0], plan.shared)
        elif plan.buffer_run is not None or plan.buffer_writes is not None:
            self.buffer.write(x, self._shifted_writes(plan, front, x), plan.shared)

    def flush(self, plan: StepPlan, prompt_capacity: int, batch: int, released_chunks: int = 0,
              reserve_chunks: int = 0, query_energy: torch.Tensor | None = None,
              chunk_limit: int | None = None) -> torch.Tensor | None:
        """Compress what leaves the buffer (one call per chunk length), keep the rest at the buffer's front.
        A decode chunk goes to slot (chunk - released_chunks); reserve_chunks: decode slots to allocate at once;
        chunk_limit: the most decode slots the store will ever need (a sliding layer's);
        query_energy [B,H,d]: what allocated key widths are chosen from (`allocation.query_pair_energy`).
        Returns a device bool, True when every compressed entry was finite (None: nothing compressed)."""
        flush, holding = self._own_flush(plan)
        if self.chunk_centers is not None:  # (a row's first step fits its centers before any of its chunks leave)
            self.buffer.fit_centers()
        if self.held_chunk:  # (the rows' newest chunk stays in the buffer: one slot fewer is ever used)
            reserve_chunks -= 1
        finite = []
        for rows, length in flush.prompt_groups:
            if self.prefill is None:
                self.prefill = ChunkStore(self.prefill_spec, prompt_capacity, self.plan)
                self.prefill.centers = self.chunk_centers
            finite.append(self._leave(self.prefill, rows, [0] * len(rows), length, [0] * len(rows), batch, 1,
                                      query_energy))
        if flush.decode_jobs:
            rows = [row for row, _, _ in flush.decode_jobs]
            starts = [start for _, start, _ in flush.decode_jobs]
            slots = [chunk - released_chunks for _, _, chunk in flush.decode_jobs]
            finite.append(self._leave(self.decode, rows, starts, self.chunk_len, slots, batch, reserve_chunks,
                                      query_energy, chunk_limit))
        capacity = self._capacities(plan, holding)[1]  # (before `holding` changes: the step's own columns)
        self.buffer.end_step(flush.keep)  # (a coded buffer encodes the step's tokens that stay)
        for row, start, length in flush.keep:
            self.buffer.keep_tail(row, start, length)
        self.holding = holding
        self.buffer.reserve(None, capacity)  # (gives back what was compressed)
        return torch.stack(finite).all() if finite else None

    def _leave(self, store: ChunkStore, rows: list[int], starts: list[int], length: int, slots: list[int],
               batch: int, reserve: int, query_energy: torch.Tensor | None, limit: int | None = None):
        """Tokens [starts[j], +length) of row rows[j] leave the buffer as chunk slots[j] of `store`: moved as they
        are when the buffer already holds them in the store's format, else compressed. Returns a device bool:
        every entry finite."""
        buffer = self.buffer
        if isinstance(buffer, CodedTokenStore) and buffer.spec == store.spec and buffer.centers is None:
            coded = buffer.coded(rows, starts, length)
            store.store_rows(coded, length, rows, slots, batch, reserve, limit)
            side = [t for t in coded.fields.values() if t.is_floating_point() and t.numel()]
            return torch.stack([torch.isfinite(t).all() for t in side]).all()
        if self.chunk_centers is not None:  # (centered chunks: from the values minus their centers, as buffered)
            x = buffer.gather(rows, starts, length, None, centered=True)
        else:
            x = buffer.gather(rows, starts, length, None)
        finite = self.plan.compress.all_finite(x)
        bits = self._channel_bits(rows, x, store.spec, batch, query_energy)
        store.compress_rows(x, rows, slots, batch, reserve, bits, limit)
        return finite

    def _channel_bits(self, rows: list[int], x: torch.Tensor, spec: ChunkSpec, batch: int,
                      query_energy: torch.Tensor | None) -> torch.Tensor | None:
        """The widths [J,H,d] of these jobs' rows (allocated keys, else None): a row's are chosen when it first
        compresses, from the query energy seen until then and the ranges of that chunk x [J,H,n,d]."""
        if not self.allocates:
            return None
        if self.channel_bits is None:
            self.channel_bits = torch.zeros(batch, x.shape[1], x.shape[3], dtype=torch.uint8, device=x.device)
            self.allocated_rows = [False] * batch
        new = [j for j, row in enumerate(rows) if not self.allocated_rows[row]]
        if new:
            new_rows = [rows[j] for j in new]
            if query_energy is None:
                raise RuntimeError("keys with bits allocated per channel (key_bit_allocation='query') are allocated "
                                   "from the queries, and none were seen for some row: pass query= to "
                                   "GearCache.store / store_and_read (the patched attention does)")
            weight = query_energy[new_rows]  # [J,H,d]
            # a row whose queries were all zero (e.g. tokens embedded as zeros) says nothing about its channels:
            # every channel weighs alike, and the key ranges alone set the widths
            weight = torch.where(weight.sum(dim=(1, 2), keepdim=True) > 0, weight, torch.ones_like(weight))
            self.channel_bits[new_rows] = allocate_channel_bits(
                weight, x[new], spec.group_for(x.shape[2], x.shape[3]), spec.bits)
            for row in new_rows:
                self.allocated_rows[row] = True
        return self.channel_bits[rows]

    # -- reading ---------------------------------------------------------------------------------------------
    def _segments(self, counts: RowCounts, released: Released, dtype: torch.dtype, sink_tokens: int,
                  first_local: list[int]) -> list[_Segment]:
        """The segments that hold tokens at row-local index >= first_local[b] for some row, reconstructed."""
        nb = self.chunk_len
        s, p, c, f = counts.sink, counts.prompt, counts.chunks, counts.buffer
        out = []

        def needed(starts, lengths):
            return any(n and st + n > lo for st, n, lo in zip(starts, lengths, first_local))

        def tokens(store: TokenStore):
            def take(dtype, out=None, rotary=None, scratch=None):
                if out is None:
                    return store.tokens()
                if rotary is None:
                    return store.tokens(out.dtype, out.shape[2], out)
                return self.plan.reconstruct.rotate(store.tokens(out.dtype, out.shape[2]), *rotary, out)
            return take

        def chunks(store: ChunkStore, count: int):
            return lambda dtype, out=None, rotary=None, scratch=None: store.reconstruct(count, dtype, out, rotary,
                                                                                       scratch)

        zeros = (0,) * len(s)
        if sink_tokens and needed(zeros, s):
            out.append(_Segment(tokens(self.sink), zeros, s))
        if self.prefill is not None and self.prefill.fields and not released.prompt and needed(s, p):
            out.append(_Segment(chunks(self.prefill, 1), s, p))
        live = max(c, default=0) - released.chunks
        starts = tuple(a + b + released.chunks * nb for a, b in zip(s, p))
        lengths = tuple((n - released.chunks) * nb for n in c)
        if live > 0 and self.decode.fields and needed(starts, lengths):
            out.append(_Segment(chunks(self.decode, live), starts, lengths))
        starts = tuple(a + b + n * nb for a, b, n in zip(s, p, c))
        out.append(_Segment(tokens(self.buffer), starts, f))
        return out

    def read(self, layout: RowLayout, counts: RowCounts, released: Released, start: int, dtype: torch.dtype,
             sink_tokens: int, out: torch.Tensor | None = None, rotary=None,
             scratch: torch.Tensor | None = None) -> torch.Tensor | None:
        """This layer's tokens in HF's padded layout from column `start` to the end: [B,H,T-start,d] (keys
        before RoPE). Padding columns hold zeros (finite; the mask hides them). out: an optional [B,H,T-start,d]
        tensor of `dtype` to build the result in (a buffer-only read returns a view of the buffer instead).
        rotary: (cos, sin) [B|1,1,T-start,d] to return the tokens rotated into out (keys for the attention, with no
        pass of their own where the kernels can; scratch: like out, for segments decompressed before they are
        rotated) when the layout lets every segment land straight in its columns; else None (read, then rotate)."""
        T = layout.rect_length
        B, H, _, d = self.buffer.shape
        counts = self.own(counts)
        if layout.uniform(counts):  # padded layout == row-local: the segments, end to end, are the columns
            segments = self._segments(counts, released, dtype, sink_tokens, [start] * B)
            first = segments[0].local_start[0]
            if rotary is not None and first != start:
                return None
            if first <= start:  # (held() of a sliding layer that released: the general path below)
                if len(segments) == 1 and rotary is None:  # the buffer alone (fp16 preset, prompt step): a view
                    return self.buffer.tokens(None, T - first)[:, :, start - first :]
                full = out if out is not None and first == start else \
                    torch.empty(B, H, T - first, d, dtype=dtype, device=self.buffer.device)
                at = 0
                for seg in segments:  # every row fills each segment exactly: reconstruct straight into place
                    n = seg.length[0]
                    columns = (slice(None), slice(None), slice(at, at + n))
                    seg.take(dtype, full[columns], None if rotary is None else tuple(t[columns] for t in rotary),
                             None if scratch is None else scratch[columns])
                    at += n
                return full[:, :, start - first:]
        if rotary is not None:
            return None
        first_local = layout.tokens_before(start)
        if released.prompt:  # nothing before the live chunks is held any more (the sink is outside the window too)
            nb = self.chunk_len
            first_local = [max(lo, s + p + released.chunks * nb)
                           for lo, s, p in zip(first_local, counts.sink, counts.prompt)]
        segments = self._segments(counts, released, dtype, sink_tokens, first_local)
        taken = [seg.take(dtype) for seg in segments]
        if out is None:
            out = torch.empty(B, H, T - start, d, dtype=dtype, device=self.buffer.device)
        held = counts.held(self.chunk_len)
        for b in range(B):
            if not layout.contiguous[b]:
                self._read_row_with_holes(out, b, layout, segments, taken, start)
                continue
            column_of_local0 = T - held[b]  # contiguous rows: local token k sits at column T - held + k
            first_column = column_of_local0 + first_local[b] - start
            if first_column > 0:  # padding (or released) columns: finite, and hidden by the mask
                out[b, :, :first_column].zero_()
            for seg, data in zip(segments, taken):
                lo = max(seg.local_start[b], first_local[b])
                hi = seg.local_start[b] + seg.length[b]
                if hi > lo:
                    at = column_of_local0 + lo - start
                    out[b, :, at : at + hi - lo] = data[b, :, lo - seg.local_start[b] : hi - seg.local_start[b]]
        return out

    def read_slots(self, slots: SlotPlan, out: torch.Tensor, rotary=None,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's tokens in the slot layout (`SlotPlan`) into out [B,H,T_slot,d] (keys before RoPE): each
        store reconstructs for every row at once, straight into its columns; each row's buffer follows its own
        decode chunks. Holes hold finite leftovers (zeros of a short prompt chunk, unused chunk slots, old buffer
        tokens) that the remapped mask hides. rotary: (cos, sin) [B,1,T_slot,d] to write every segment rotated,
        scratch: like out (see `read`)."""
        def cols(lo: int, hi: int, row: int | None = None):
            if rotary is None:
                return None
            rows = slice(None) if row is None else slice(row, row + 1)
            return tuple(t[rows, :, lo:hi] for t in rotary)

        def scratch_cols(lo: int, hi: int):
            return None if scratch is None else scratch[:, :, lo:hi]

        def tokens(source: torch.Tensor, into: torch.Tensor, rotation):
            if rotation is None:
                return into.copy_(source)
            return self.plan.reconstruct.rotate(source, *rotation, into)

        slots = self._own_slots(slots)
        at = 0
        if slots.sink:
            tokens(self.sink.data[:, :, : slots.sink], out[:, :, : slots.sink], cols(0, slots.sink))
            at = slots.sink
        if slots.prompt:
            self.prefill.reconstruct(1, out.dtype, out[:, :, at : at + slots.prompt], cols(at, at + slots.prompt),
                                     scratch_cols(at, at + slots.prompt))
            at += slots.prompt
        chunk_width = slots.chunks * self.chunk_len
        if slots.chunks:  # before the buffers: a row with fewer chunks has its buffer over the others' last chunks
            self.decode.reconstruct(slots.chunks, out.dtype, out[:, :, at : at + chunk_width],
                                    cols(at, at + chunk_width), scratch_cols(at, at + chunk_width))
        # past the chunks only buffers are written, each as long as its row's: the rest of the tail is a hole that
        # must be finite (the masked weight 0 times NaN would poison the row), and `out` is an uninitialised
        # workspace (zeros rotate to zeros)
        out[:, :, at + chunk_width : at + slots.tail].zero_()
        buffer = self.buffer.tokens(out.dtype, max(slots.buffer))
        if len(set(slots.buffer_at)) == 1:  # rows that flushed alike: one copy (shorter rows' extra columns: holes)
            start, n = at + slots.buffer_at[0], max(slots.buffer)
            tokens(buffer[:, :, :n], out[:, :, start : start + n], cols(start, start + n))
        else:
            for row, (offset, n) in enumerate(zip(slots.buffer_at, slots.buffer)):
                lo = at + offset
                tokens(buffer[row : row + 1, :, :n], out[row : row + 1, :, lo : lo + n], cols(lo, lo + n, row))
        return out

    @staticmethod
    def _read_row_with_holes(out, b, layout: RowLayout, segments, taken, start) -> None:
        """A row whose tokens are not one run of columns (a mask with holes): gather through rect_to_local."""
        parts = [data[b, :, : seg.length[b]] for seg, data in zip(segments, taken)]
        local = torch.cat(parts, dim=1)  # [H, held, d]: no segment was dropped for such a row
        cols = layout.rect_to_local[b, start : layout.rect_length].long()
        out[b] = local[:, cols.clamp(min=0)].to(out.dtype) * (cols >= 0)[None, :, None]

    # -- the fused kernel's view ---------------------------------------------------------------------------
    def kernel_view(self, sink_tokens: int, prompt: bool, decode_chunks: int, reader=None, counted_own: bool = False):
        """This stream as the fused kernel reads it (`gear_hf.kernels.views.StreamView`): references to the
        storage tensors, nothing copied. prompt: the prompt chunk is live; decode_chunks: live decode chunks of the
        layout, or, counted_own, of this stream as it stores them (`own`: a held chunk is then buffered tokens of
        the kernel's rows, not a held chunk of the view). reader: the attending backend; a coded buffer it reads
        (`Backend.reads_tail`) is handed as stored (`StreamView.tail`), else decoded for this step, as the reference
        path reads it."""
        def run(store: ChunkStore | None, chunks: int):
            if store is None or not store.fields or not chunks:
                return None
            attend = self.plan.attend
            memo = store.derived.get(KERNEL_VIEW)  # (the same view until the store is written: `ChunkStore._changed`)
            if memo is not None and memo[0] == (store.version, chunks, attend):
                return memo[1]
            view = ChunkRunView.of(store)
            # what the attending backend derives from the store once per write (the store owns it)
            derived = attend.view_derived(store, view, chunks, self.kind) if attend else {}
            view = dataclasses.replace(view, derived=derived) if derived else view
            store.derived[KERNEL_VIEW] = ((store.version, chunks, attend), view)
            return view

        held = self.held_chunk and not counted_own
        if held:  # (the newest chunk of each row is at its buffer's front)
            decode_chunks = max(decode_chunks - 1, 0)
        buffer, tail = self.buffer, None
        sink = self.sink.data if sink_tokens else None
        # centered chunks: every value is handed centered (the chunks and the buffer's codes as stored, the sink and
        # this step's own tokens minus the centers, or as they are for a reader that centers them itself:
        # `Backend.centers_exact_tokens`) and the kernel's output takes the centers once (StreamView.center)
        centers = self.chunk_centers if self.chunk_centers is not None and self.chunk_centers.fitted else None
        affine = buffer.center_affine() if centers is not None else None  # (once a step: normalizing and the output)
        exact_centered = True
        if isinstance(buffer, CodedTokenStore) and reader is not None and reader.reads_tail(buffer.spec,
                                                                                            buffer.head_dim):
            # (the codes as stored, this step's own tokens exact; centered chunks: the codes read as they are coded)
            tokens, tail = buffer.kernel_tail(affine=centers is None)
            exact_centered = not reader.centers_exact_tokens
            if centers is not None and exact_centered:
                tokens = centers.normalized(tokens)
        else:
            tokens = buffer.tokens(centered=True) if centers is not None else buffer.tokens()
        if centers is not None and sink is not None and exact_centered:
            sink = centers.normalized(sink)
        return StreamView(buffer=tokens, sink=sink, prompt=run(self.prefill, 1 if prompt else 0),
                          decode=run(self.decode, decode_chunks), tail=tail, held_chunk=held,
                          specs=(self.prefill_spec, self.decode_spec),
                          center=affine[:, :, 1] if affine is not None else None, exact_centered=exact_centered)

    # -- sliding windows ---------------------------------------------------------------------------------------
    def release(self, before: Released, after: Released, counts: RowCounts) -> None:
        """Free what `after` newly releases: the prompt chunk store, and leading decode chunks."""
        if after.prompt and not before.prompt:
            self.prefill = None
        dropped = after.chunks - before.chunks
        if dropped > 0:
            self.decode.discard_leading(dropped, max(self.own(counts).chunks, default=0) - after.chunks)

    # -- rows --------------------------------------------------------------------------------------------------
    def select_rows(self, index: torch.Tensor) -> None:
        if self.holding:
            self.holding = [self.holding[i] for i in index.tolist()]
        for store in (self.sink, self.buffer, self.prefill, self.decode):
            if store is not None:
                store.select_rows(index)
        if self.channel_bits is not None:
            self.channel_bits = self.channel_bits.index_select(0, index)
            self.allocated_rows = [self.allocated_rows[i] for i in index.tolist()]
