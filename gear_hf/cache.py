"""`GearCache`: a transformers `Cache` whose layers keep keys (before RoPE) and values GEAR-compressed.

Each row keeps only its real tokens, in arrival order ("row-local" order):

    [ sink (full precision) | prompt chunk (rank_prefill) | decode chunks of n_b (rank_decode) | buffer (< n_b) ]

so padding never enters a statistic and a row's compressed cache is the same alone or inside a batch.
`rect_to_local` maps HF's padded [B, T] layout (what the attention mask describes) to row-local tokens; it,
the positions and the per-row lengths are shared by all layers and planned once per forward step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .compress import ChunkSpec
from .config import GearConfig
from .storage import ChunkStore, TokenStore, grown_capacity

COMPONENTS = ("codes", "scales", "lowrank", "sparse_values", "sparse_indices", "buffer", "positions")


@dataclass
class _RowFlush:
    """One row's tokens leaving the buffer this step: `prefill` tokens to the prompt chunk, then `decode`
    chunks of n_b starting at chunk slot `first_chunk`; the rest stays buffered."""

    row: int
    buffered: int  # tokens in the buffer before this step
    new_cols: list[int]  # this step's token columns that join the buffer
    prefill: int
    decode: int
    first_chunk: int


@dataclass
class _StepPlan:
    sink_cols: torch.Tensor  # [B, q] long: destination in the sink store, or its scratch column
    buffer_cols: torch.Tensor  # [B, q] long: destination in the buffer, or its scratch column
    buffer_capacity: int
    rect_before: int  # columns of the padded layout before this step
    flushes: list[_RowFlush] = field(default_factory=list)
    decode_chunks_used: int = 0  # max over rows
    decode_reserve: int = 0
    uniform: tuple | None = None  # (sink, prompt, decode chunks, buffer) shared by every row when there is no
    # padding and the rows are equal: the padded layout is then just the row-local one
    read_index: torch.Tensor | None = None  # [B, T] long into cat(sink, prompt, decode, buffer)
    read_positions: torch.Tensor | None = None  # [B, T] long


def _stream_specs(cfg: GearConfig, bits: int, axis: str) -> tuple[ChunkSpec, ChunkSpec]:
    """(prompt chunk spec, decode chunk spec) for one of keys/values."""
    group = 0 if cfg.coarse_groups else cfg.group_size
    ratio = cfg.outlier_ratio if cfg.uses_outliers else 0.0
    ranks = (cfg.rank_prefill, cfg.rank_decode) if cfg.uses_lowrank else (0, 0)
    return tuple(ChunkSpec(bits, axis, group, ratio, rank, cfg.power_iters) for rank in ranks)


class _Stream:
    """Keys or values of one layer."""

    def __init__(self, prefill_spec: ChunkSpec, decode_spec: ChunkSpec, buffer_size: int, backend: str) -> None:
        self.prefill_spec, self.decode_spec = prefill_spec, decode_spec
        self.sink = TokenStore()
        self.buffer = TokenStore()
        self.prefill: ChunkStore | None = None
        self.decode = ChunkStore(decode_spec, buffer_size, backend)
        self.buffer_size = buffer_size
        self.backend = backend

    def apply(self, plan: _StepPlan, x: torch.Tensor, sink_tokens: int, prefill_len: int, batch: int) -> None:
        """Store this step's tokens x [B,H,q,d] as planned."""
        if sink_tokens:
            self.sink.reserve(x, sink_tokens)
            self.sink.write(x, plan.sink_cols)
        self.buffer.reserve(x, plan.buffer_capacity)
        self.buffer.write(x, plan.buffer_cols)
        for f in plan.flushes:
            pending = torch.cat([self.buffer.data[f.row, :, : f.buffered], x[f.row, :, f.new_cols]], dim=1)
            pending = pending.unsqueeze(0)  # [1,H,m,d]
            start = 0
            if f.prefill:
                if self.prefill is None:
                    self.prefill = ChunkStore(self.prefill_spec, prefill_len, self.backend)
                self.prefill.compress_into(pending[:, :, : f.prefill], f.row, 0, batch, 1)
                start = f.prefill
            for c in range(f.decode):
                chunk = pending[:, :, start : start + self.buffer_size]
                self.decode.compress_into(chunk, f.row, f.first_chunk + c, batch, plan.decode_reserve)
                start += self.buffer_size
            rest = pending[0, :, start:]
            self.buffer.data[f.row, :, : rest.shape[1]] = rest

    def read(self, plan: _StepPlan, sink_tokens: int, dtype: torch.dtype, start: int) -> torch.Tensor:
        """This layer's tokens in HF's padded layout from column `start` on: [B,H,T-start,d] (keys before RoPE).

        Laid out as [sink | prompt chunk | decode chunks | buffer]; the chunks decompress straight into their
        slice. When every row holds the same slots in order (`plan.uniform`) that layout is HF's; otherwise
        the stores are taken whole (scratch and padded slots included) and `plan.read_index` gathers."""
        uniform = plan.uniform
        sink = (uniform[0] if uniform else self.sink.data.shape[2]) if sink_tokens else 0
        buffer = uniform[-1] if uniform else self.buffer.data.shape[2]
        runs = [(store, chunks) for store, chunks in ((self.prefill, 1), (self.decode, plan.decode_chunks_used))
                if store is not None and store.fields and chunks]
        if uniform and not sink and not runs:  # fp16 preset: the buffer itself (a view, as DynamicCache's)
            return self.buffer.data[:, :, start:buffer]
        B, H, _, d = self.buffer.data.shape
        total = sink + sum(store.chunk_len * chunks for store, chunks in runs) + buffer
        full = self.buffer.data.new_empty(B, H, total, d, dtype=dtype)
        if sink:
            full[:, :, :sink] = self.sink.data[:, :, :sink]
        at = sink
        for store, chunks in runs:
            store.reconstruct(chunks, dtype, out=full[:, :, at : at + store.chunk_len * chunks])
            at += store.chunk_len * chunks
        full[:, :, at:] = self.buffer.data[:, :, :buffer]
        if uniform:
            return full[:, :, start:]
        index = plan.read_index[:, None, start:, None].expand(B, H, -1, d)
        return full.gather(2, index)

    def nbytes_by_component(self) -> dict[str, int]:
        out = dict.fromkeys(COMPONENTS, 0)
        out["buffer"] = self.sink.nbytes() + self.buffer.nbytes()
        for store in (self.prefill, self.decode):
            if store is not None:
                for name, n in store.nbytes_by_component().items():
                    out[name] += n
        return out

    def select_rows(self, index: torch.Tensor) -> None:
        for store in (self.sink, self.buffer, self.prefill, self.decode):
            if store is not None:
                store.select_rows(index)


class GearLayer(CacheLayerMixin):
    """One decoder layer's GEAR storage. Filled only through `GearCache.store` (keys before RoPE)."""

    is_compileable = False

    def __init__(self, cache: "GearCache", layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.steps = 0
        self.seen_length = 0
        cfg = cache.gear_config
        self.key_stream = _Stream(*_stream_specs(cfg, cfg.key_bits, cfg.key_axis), cfg.buffer_size, cfg.backend)
        self.value_stream = _Stream(*_stream_specs(cfg, cfg.value_bits, cfg.value_axis), cfg.buffer_size,
                                    cfg.backend)

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


def _sliding_windows(config) -> list[int | None]:
    """Per layer: the sliding window, or None for full attention (as transformers' own caches decide)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    if not hasattr(config, "num_hidden_layers"):
        raise TypeError(f"GearCache needs a model or a transformers config, got {type(model_or_config).__name__}")
    return config


class GearCache(Cache):
    """A GEAR-compressed KV cache (see the module docstring for the layout).

    model_or_config: the (gear_hf-enabled) model or its config; gear_config: defaults to the config the model
    was enabled with, else `GearConfig()`. expected_length: optional hint (prompt + new tokens per row) used
    to size the decode storage once instead of growing it.
    """

    def __init__(self, model_or_config, gear_config: GearConfig | None = None, *,
                 expected_length: int | None = None) -> None:
        if gear_config is None:
            gear_config = getattr(getattr(model_or_config, "_gear_hf_state", None), "config", None) or GearConfig()
        if not isinstance(gear_config, GearConfig):
            raise TypeError(f"gear_config must be a gear_hf.GearConfig, got {type(gear_config).__name__}")
        self.gear_config = gear_config
        self.expected_length = expected_length
        windows = _sliding_windows(_text_config(model_or_config))
        super().__init__(layers=[GearLayer(self, i, w) for i, w in enumerate(windows)])
        # Shared row bookkeeping (identical for every layer).
        self.batch_size_ = 0
        self.rect_length = 0  # columns of HF's padded layout seen so far
        self.sink_len: list[int] = []
        self.prefill_len: list[int] = []
        self.decode_chunks: list[int] = []
        self.buffer_len: list[int] = []
        self.prompt_chunk_len = 0  # token length of the prompt chunk store (max over rows)
        self.positions: torch.Tensor | None = None  # [B, cap+1] int32, row-local order (+ scratch column)
        self.rect_to_local: torch.Tensor | None = None  # [B, cap] int32, -1 = padding
        self.steps = 0
        self._plan: _StepPlan | None = None
        self._pending_mask: torch.Tensor | None = None
        self._rope_memo = None
        self._shape = None  # (H, d) of the first stored layer

    # -- inputs from the model-level hook ------------------------------------------------------------------
    def observe_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """The 2D padding mask of the coming forward step ([B, T_past + q]), or None."""
        if attention_mask is not None and attention_mask.ndim != 2:
            attention_mask = None  # 4D custom masks carry no padding information we can trust
        self._pending_mask = attention_mask

    # -- the one entry point of the patched attention ----------------------------------------------------
    def store(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              position_ids: torch.Tensor | None = None) -> "GearLayer":
        """Store this step's keys (before RoPE) and values [B,H,q,d] of one layer; the first layer to store in
        a step plans it for all layers."""
        layer = self.layers[layer_idx]
        if layer.steps == self.steps:
            self._plan_step(key_states, position_ids)
        elif layer.steps != self.steps - 1:
            raise RuntimeError(f"GearCache layer {layer_idx} is {self.steps - layer.steps} steps behind; layers "
                               "must be updated once per forward step, in order")
        if key_states.shape[0] != self.batch_size_:
            raise ValueError(f"batch size changed from {self.batch_size_} to {key_states.shape[0]} in one GearCache")
        cfg = self.gear_config
        for stream, x in ((layer.key_stream, key_states), (layer.value_stream, value_states)):
            stream.apply(self._plan, x, cfg.sink_tokens, self.prompt_chunk_len, self.batch_size_)
        layer.steps += 1
        layer.seen_length = self.rect_length
        if self._shape is None:
            self._shape = (key_states.shape[1], key_states.shape[3])
        return layer

    def read(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """All of the layer's keys and values in HF's padded layout [B,H,T,d] after `store` (the reference
        path: reconstructed in full). This step's own tokens (key_states/value_states, the last q columns)
        come back exactly as given: a step attends to itself in full precision, as KIVI and HF's
        QuantizedCache do, and compression shows from the next step on. Positions: `read_positions()`."""
        layer = self.layers[layer_idx]
        plan, sink = self._plan, self.gear_config.sink_tokens
        start = layer.visible_start(plan.rect_before)
        keys = layer.key_stream.read(plan, sink, key_states.dtype, start)
        values = layer.value_stream.read(plan, sink, value_states.dtype, start)
        q = key_states.shape[2]
        keys[:, :, -q:] = key_states
        values[:, :, -q:] = value_states
        return keys, values

    def held(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values of the layer as held after the last step, in HF's padded layout
        [B,H,T,d]: unlike `read`, the last step's own tokens come back as stored (compressed once flushed).
        For diagnostics: what the cache holds, not what the attention was handed."""
        plan, sink = self._plan, self.gear_config.sink_tokens
        layer = self.layers[layer_idx]
        return layer.key_stream.read(plan, sink, dtype, 0), layer.value_stream.read(plan, sink, dtype, 0)

    def store_and_read(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
                       position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`store` then `read`."""
        self.store(layer_idx, key_states, value_states, position_ids)
        return self.read(layer_idx, key_states, value_states)

    def step_compressed(self) -> bool:
        """Whether the current step moved tokens into compressed chunks (for some row)."""
        return bool(self._plan.flushes)

    def read_positions(self, layer_idx: int) -> torch.Tensor:
        """[B, T] positions of the tokens `store_and_read` returned (padding columns hold 0)."""
        return self._plan.read_positions[:, self.layers[layer_idx].visible_start(self._plan.rect_before):]

    def rotary_for_read(self, layer_idx: int, rotary_emb, like: torch.Tensor):
        """(cos, sin) [B,T,d] for the keys `store_and_read` returned, from the model's rotary module; computed
        once per step (per visible length) and shared by the layers."""
        positions = self.read_positions(layer_idx)
        key = (self.steps, positions.shape[1], like.dtype, like.device, rotary_emb)  # Gemma 3: a RoPE per layer type
        if self._rope_memo is None or self._rope_memo[0] != key:
            self._rope_memo = (key, rotary_emb(like, positions))
        cos_sin = self._rope_memo[1]
        if layer_idx == len(self.layers) - 1:
            self._rope_memo = None  # a per-step temporary: not held between steps
        return cos_sin

    # -- planning: decided once per step, executed by every layer -------------------------------------------
    def _plan_step(self, key_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        cfg = self.gear_config
        B, _, q, _ = key_states.shape
        device = key_states.device
        first = self.steps == 0
        if first:
            self.batch_size_ = B
            self.sink_len, self.prefill_len = [0] * B, [0] * B
            self.decode_chunks, self.buffer_len = [0] * B, [0] * B
        rect_before = self.rect_length

        mask = self._pending_mask
        self._pending_mask = None
        if mask is not None:
            if mask.shape[0] != B or mask.shape[1] != rect_before + q:
                raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not match a step of {q} "
                                 f"tokens after {rect_before} cached ones (expected [{B}, {rect_before + q}])")
            new_valid = mask[:, -q:].to(device=device, dtype=torch.bool)
        else:
            new_valid = torch.ones(B, q, dtype=torch.bool, device=device)
        if position_ids is None:
            position_ids = torch.arange(rect_before, rect_before + q, device=device)[None]
        position_ids = position_ids.to(device).expand(B, q)

        # Row-local bookkeeping shared by all layers.
        held_before = torch.tensor([s + p + c * cfg.buffer_size + b for s, p, c, b in
                                    zip(self.sink_len, self.prefill_len, self.decode_chunks, self.buffer_len)],
                                   device=device)
        local = held_before[:, None] + new_valid.long().cumsum(1) - 1  # [B,q] row-local index of each new token
        new_counts = new_valid.sum(1)
        held_after = held_before + new_counts
        self._grow_index_stores(B, int(held_after.max()), rect_before + q, device)
        self.rect_to_local[:, rect_before : rect_before + q] = torch.where(new_valid, local, -1).int()
        pos_scratch = self.positions.shape[1] - 1
        self.positions.scatter_(1, torch.where(new_valid, local, pos_scratch), position_ids.int())

        valid_rows = new_valid.tolist()
        sink_cols = [[cfg.sink_tokens] * q for _ in range(B)]  # sink_tokens = the sink's scratch column
        buffer_cols_l = [[-1] * q for _ in range(B)]
        flushes: list[_RowFlush] = []
        if first and cfg.compresses:
            self.prompt_chunk_len = 0
        prompt_counts = [0] * B
        for i in range(B):
            cols = [j for j in range(q) if valid_rows[i][j]]
            room = cfg.sink_tokens - self.sink_len[i]
            to_sink, rest = cols[: max(room, 0)], cols[max(room, 0):]
            for r, j in enumerate(to_sink):
                sink_cols[i][j] = self.sink_len[i] + r
            self.sink_len[i] += len(to_sink)
            buffered = self.buffer_len[i]
            total = buffered + len(rest)
            prefill = decode = 0
            if cfg.compresses:
                if first:
                    prefill = total // cfg.group_size * cfg.group_size
                    prompt_counts[i] = prefill
                decode = (total - prefill) // cfg.buffer_size
            if prefill or decode:
                flushes.append(_RowFlush(i, buffered, rest, prefill, decode, self.decode_chunks[i]))
            else:
                for r, j in enumerate(rest):
                    buffer_cols_l[i][j] = buffered + r
            self.prefill_len[i] += prefill
            self.decode_chunks[i] += decode
            self.buffer_len[i] = total - prefill - decode * cfg.buffer_size
        if first and cfg.compresses:
            self.prompt_chunk_len = max(prompt_counts)

        current = self.layers[0].key_stream.buffer.capacity
        if cfg.compresses:  # grown to what rows hold, never beyond n_b: a flushing row keeps < n_b tokens
            buffer_capacity = min(cfg.buffer_size, grown_capacity(current, max(self.buffer_len)))
        else:  # fp16: the buffer is the whole cache, grown geometrically (or sized once from the hint)
            wanted = max(max(self.buffer_len), (self.expected_length or 0) if first else 0)
            buffer_capacity = grown_capacity(current, wanted)
        buffer_scratch = buffer_capacity
        buffer_cols = torch.tensor(buffer_cols_l, device=device, dtype=torch.long)
        buffer_cols[buffer_cols < 0] = buffer_scratch
        decode_used = max(self.decode_chunks)
        if self.expected_length:
            wanted = math.ceil(max(self.expected_length - min(s + p for s, p in zip(self.sink_len, self.prefill_len)),
                                   0) / cfg.buffer_size)
        else:
            wanted = 4
        plan = _StepPlan(
            sink_cols=torch.tensor(sink_cols, device=device, dtype=torch.long),
            buffer_cols=buffer_cols,
            buffer_capacity=buffer_capacity,
            rect_before=rect_before,
            flushes=flushes,
            decode_chunks_used=decode_used,
            decode_reserve=max(wanted, decode_used),
        )
        self.rect_length = rect_before + q
        self.steps += 1
        self._plan = plan
        self._plan_read_index(plan, device)

    def _plan_read_index(self, plan: _StepPlan, device) -> None:
        """Map every column of HF's padded layout to its slot in cat(sink, prompt, decode, buffer)."""
        cfg = self.gear_config
        rect = self.rect_to_local[:, : self.rect_length].long()
        k = rect.clamp(min=0)  # padding columns read token 0: finite, and hidden by the mask
        sink = torch.tensor(self.sink_len, device=device)[:, None]
        prompt = torch.tensor(self.prefill_len, device=device)[:, None]
        decode = torch.tensor(self.decode_chunks, device=device)[:, None] * cfg.buffer_size
        sink_width = cfg.sink_tokens + 1 if cfg.sink_tokens else 0
        prompt_width = self.prompt_chunk_len
        decode_width = plan.decode_chunks_used * cfg.buffer_size
        index = torch.where(
            k < sink, k,
            torch.where(k < sink + prompt, sink_width + k - sink,
                        torch.where(k < sink + prompt + decode, sink_width + prompt_width + k - sink - prompt,
                                    sink_width + prompt_width + decode_width + k - sink - prompt - decode)))
        plan.read_index = index
        plan.read_positions = self.positions.long().gather(1, k)
        rows = set(zip(self.sink_len, self.prefill_len, self.decode_chunks, self.buffer_len))
        if len(rows) == 1 and self.tokens_held() == self.rect_length * len(self.sink_len):
            (row,) = rows
            if row[1] == self.prompt_chunk_len:  # the prompt chunk store has no padded tail
                plan.uniform = row

    def _grow_index_stores(self, B: int, held: int, rect: int, device) -> None:
        if self.positions is None:
            cap = max(held, self.expected_length or 0)
            self.positions = torch.zeros(B, cap + 1, dtype=torch.int32, device=device)
            self.rect_to_local = torch.full((B, max(rect, self.expected_length or 0)), -1, dtype=torch.int32,
                                            device=device)
            return
        if held > self.positions.shape[1] - 1:
            cap = grown_capacity(self.positions.shape[1] - 1, held)
            grown = torch.zeros(B, cap + 1, dtype=torch.int32, device=device)
            grown[:, : self.positions.shape[1] - 1] = self.positions[:, :-1]
            self.positions = grown
        if rect > self.rect_to_local.shape[1]:
            cap = grown_capacity(self.rect_to_local.shape[1], rect)
            grown = torch.full((B, cap), -1, dtype=torch.int32, device=device)
            grown[:, : self.rect_to_local.shape[1]] = self.rect_to_local
            self.rect_to_local = grown

    # -- HF Cache protocol ----------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def _select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (in that order) of every layer and of the shared bookkeeping."""
        if self.steps == 0:
            return
        index = index.to(self.positions.device).long()
        rows = index.tolist()
        for layer in self.layers:
            layer.key_stream.select_rows(index)
            layer.value_stream.select_rows(index)
        self.positions = self.positions.index_select(0, index)
        self.rect_to_local = self.rect_to_local.index_select(0, index)
        for name in ("sink_len", "prefill_len", "decode_chunks", "buffer_len"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])
        self.batch_size_ = len(rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.steps:
            self._select_rows(torch.arange(self.batch_size_).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(
                f"GearCache cannot crop {tokens_to_remove} tokens: compressed chunks are not reversible "
                "(assisted/speculative decoding is not supported with a GEAR cache)")

    def reset(self) -> None:
        raise NotImplementedError("GearCache cannot be reset in place; create a new GearCache")

    # -- accounting -------------------------------------------------------------------------------------------
    def tokens_held(self) -> int:
        """Real (non-padding) tokens held per layer, summed over rows."""
        cfg = self.gear_config
        return sum(s + p + c * cfg.buffer_size + b for s, p, c, b in
                   zip(self.sink_len, self.prefill_len, self.decode_chunks, self.buffer_len))

    def memory_report(self) -> dict:
        """Bytes of every tensor this cache holds (allocated capacity included), by component."""
        report = dict.fromkeys(COMPONENTS, 0)
        for layer in self.layers:
            for stream in (layer.key_stream, layer.value_stream):
                for name, n in stream.nbytes_by_component().items():
                    report[name] += n
        plan = self._plan
        step_index = (plan.sink_cols, plan.buffer_cols, plan.read_index, plan.read_positions) if plan else ()
        for t in (self.positions, self.rect_to_local, *step_index):
            if t is not None:
                report["positions"] += t.numel() * t.element_size()
        H, d = self._shape or (0, 0)
        elements = self.tokens_held() * H * d * 2 * len(self.layers)  # keys and values
        total = sum(report[c] for c in COMPONENTS)
        report.update(
            total_bytes=total,
            fp16_bytes=elements * 2,
            elements=elements,
            tokens=self.tokens_held(),
            bits_per_element=(total * 8 / elements) if elements else 0.0,
            method=self.gear_config.describe(),
        )
        return report

    # -- fused Triton decode attention (gear_hf.kernels); store_and_read + attention stays the default/oracle --
    def fused_attention(self, layer_idx: int, query: torch.Tensor, *, scaling: float, inv_freq: torch.Tensor,
                        attention_scaling: float = 1.0) -> torch.Tensor:
        """After `store`, attend `query` [B,Hq,q,d] (already rotated) straight from the compressed storage with
        the fused Triton kernel: nothing is reconstructed. Keys are rotated in the kernel from the stored
        positions with `inv_freq`/`attention_scaling` (the rotary module's). Only for steps that compressed
        nothing (`step_compressed()` False): then this step's tokens are in the buffer or sink, exact, as the
        reference path also has them. Returns [B, q, Hq, d] (HF's attention-function layout)."""
        from .kernels.decode import cache_decode_attention  # imports triton: only on this path

        return cache_decode_attention(self, layer_idx, query, scaling=scaling, inv_freq=inv_freq,
                                      attention_scaling=attention_scaling,
                                      sliding_window=self.layers[layer_idx].sliding_window)
