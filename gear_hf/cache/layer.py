"""`GearLayer`: one decoder layer's GEAR storage (its key and value streams, its sliding window)."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..compress.allocation import query_pair_energy
from ..compress.rope import apply_rotary
from ..config import GearConfig
from ..format import layer_formats, stream_specs  # noqa: F401  (stream_specs: earlier import path)
from .layout import RowLayout, StepPlan
from .stream import Released, Stream
from .window import DenseWindow, dense_window_reason


class GearLayer(CacheLayerMixin):
    """One decoder layer's GEAR storage, filled through `GearCache.store` (keys before RoPE).

    A sliding layer (window w) sees only the last w-1 past columns, like HF's sliding cache layers; chunks that
    left every row's window are released, so its memory stops growing once T passes the window. A window too short
    for compression to pay (`dense_window_reason`) is stored dense instead, as transformers stores it (`dense`: a
    `DenseWindow`; `dense_why` says why)."""

    is_compileable = False

    def __init__(self, config: GearConfig, layer_idx: int, sliding_window: int | None,
                 speculative: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.steps = 0
        self.seen_length = 0
        self.released = Released()
        self.flushed_step = 0  # layout steps completed by this layer (== steps once the step's flush ran)
        # [B,Hkv,d] float64: the step's query energy while some row's key widths are to be chosen; dropped when the
        # step ends (a row takes its widths from the queries of the step it first compresses in: its prompt's, or
        # the step that fills its first decode chunk), so nothing beside the tokens is kept between steps
        self.query_energy: torch.Tensor | None = None
        nb = config.buffer_size
        self.formats = layer_formats(config)  # (keys', values') StreamFormat
        self.key_stream, self.value_stream = (Stream(fmt.prompt, fmt.decode, nb, fmt.stream, fmt.tail,
                                                     fmt.held_chunk, fmt.release_after, fmt.centered,
                                                     fmt.chunks_centered)
                                              for fmt in self.formats)
        self.dense_why = dense_window_reason(sliding_window, nb, config.compresses)
        self.dense = DenseWindow(sliding_window, speculative) if self.dense_why else None

    @property
    def streams(self) -> tuple[Stream, Stream]:
        return self.key_stream, self.value_stream

    def bind(self, plan) -> None:
        for stream in self.streams:
            stream.bind(plan)

    # -- a step --------------------------------------------------------------------------------------------
    def append(self, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor, sink_tokens: int,
               query: torch.Tensor | None = None, query_rotary=None) -> None:
        """query: the step's queries, rotated (query_rotary None) or before RoPE with query_rotary = their (cos,
        sin), rotated here only where their energy is taken."""
        if self.dense is not None:
            self.dense.append(key_states, value_states)
        else:
            if query is not None and self.key_stream.compresses(plan) and self.key_stream.needs_query_energy():
                if query_rotary is not None:
                    query = apply_rotary(query, *query_rotary)
                self.query_energy = query_pair_energy(query, key_states.shape[1], plan.valid)
            for stream, x in zip(self.streams, (key_states, value_states)):
                stream.append(plan, x, sink_tokens)
        self.steps += 1
        self.seen_length = plan.rect_before + plan.query_len

    def read(self, layout: RowLayout, counts, start: int, dtype: torch.dtype, sink_tokens: int, out=(None, None),
             streams: tuple[int, ...] = (0, 1)):
        """(keys before RoPE, values) in HF's padded layout from column `start` (streams: which, 0 keys 1 values);
        out: optional tensors to build them in (see `Stream.read`)."""
        if self.dense is not None:  # (columns it no longer holds, for `GearCache.held`: zeros, as released chunks)
            columns = layout.rect_length - start
            held = self.dense.read(min(columns, self.dense.columns), dtype, out, streams)
            return held if columns <= self.dense.columns else \
                tuple(torch.nn.functional.pad(t, (0, 0, columns - t.shape[2], 0)) for t in held)
        return tuple(self.streams[i].read(layout, counts, self.released, start, dtype, sink_tokens, out[i])
                     for i in streams)

    def flush(self, layout: RowLayout, plan: StepPlan) -> list[torch.Tensor]:
        """Compress what leaves the buffers, then release what left every row's window. Returns device bools
        (all entries finite) for the cache to check once per step."""
        if self.dense is not None:
            self.dense.end_step()
            self.flushed_step = layout.steps
            return []
        reserve = plan.decode_reserve - self.released.chunks
        limit = None
        if self.is_sliding:  # live chunks never exceed a window's worth (+ the partly visible and the newest)
            limit = -(-self.sliding_window // layout.chunk_len) + 2
            reserve = min(reserve, limit)
        finite = [stream.flush(plan, layout.prompt_capacity, layout.batch, self.released.chunks, reserve,
                               self.query_energy, limit) for stream in self.streams]
        self.query_energy = None  # (the step's: see __init__)
        if self.is_sliding:
            self._release(layout)
        self.flushed_step = layout.steps
        return [f for f in finite if f is not None]

    def _release(self, layout: RowLayout) -> None:
        """Drop chunks wholly before the window of every row's next step (the window only moves forward)."""
        nb = layout.chunk_len
        # speculative: `crop` may take back this step's tokens, moving the window back by as many
        length = layout.rect_length - (layout.plan.query_len if layout.speculative else 0)
        before = layout.tokens_before(self.visible_start(length))
        counts = layout.counts
        prompt_dead = all(s + p <= dead for s, p, dead in zip(counts.sink, counts.prompt, before))
        dead_chunks = min((min(c, max(0, (dead - s - p) // nb)) for s, p, c, dead in
                           zip(counts.sink, counts.prompt, counts.chunks, before)), default=0)
        for stream in self.streams:
            if stream.held_chunk:  # (a held chunk is in the buffer: it goes when it is compressed)
                dead_chunks = min(dead_chunks, min(stream.own(counts).chunks, default=0))
        # a dead chunk implies a dead prompt (it comes first), so the two only move forward together
        after = Released(prompt=self.released.prompt or (prompt_dead and any(counts.prompt)),
                         chunks=max(self.released.chunks, dead_chunks))
        if after != self.released:
            for stream in self.streams:
                stream.release(self.released, after, counts)
            self.released = after

    def cropped(self, length: int) -> None:
        """The cache took back its newest columns: `length` remain (`GearCache.crop`)."""
        if self.dense is not None:
            self.dense.crop(self.seen_length - length)
        self.seen_length = length

    def select_rows(self, index: torch.Tensor) -> None:
        if self.dense is not None:
            self.dense.select_rows(index)
        for stream in self.streams:
            stream.select_rows(index)
        if self.query_energy is not None:
            self.query_energy = self.query_energy.index_select(0, index)

    # -- HF CacheLayerMixin ---------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(
            "GearCache.update() was called by an attention layer that gear_hf did not patch. GearCache keeps "
            "keys before RoPE and needs the patched forward: call gear_hf.enable(model) before generating."
        )

    def visible_start(self, length: int) -> int:
        """First column of the padded layout this layer attends to after `length` columns: like HF's sliding
        cache layers, a sliding layer sees only the last window-1 past tokens (the mask hides the rest)."""
        return max(0, length - self.sliding_window + 1) if self.sliding_window else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        start = self.visible_start(self.seen_length)
        return self.seen_length - start + query_length, start

    def get_seq_length(self) -> int:
        return self.seen_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("GearCache cannot be reset in place; create a new GearCache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("reorder a GearCache as a whole: GearCache.reorder_cache(beam_idx)")

    batch_select_indices = batch_repeat_interleave = crop = reorder_cache
