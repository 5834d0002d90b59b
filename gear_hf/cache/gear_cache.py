"""`GearCache`: a transformers `Cache` whose layers keep keys (before RoPE) and values GEAR-compressed.

One step of one layer, data moving one way (see `RowLayout` for where a row's tokens are):

    store()            new K,V [B,H,q,d] join the full-precision buffer
    read() | fused     the attention sees compressed history + the buffer, its own tokens exactly
    compress_pending() rows whose buffer reached n_b compress, one call per chunk length, after the attention
"""

from __future__ import annotations

from collections import Counter

import torch
from transformers.cache_utils import Cache

from .. import backends  # light: triton and numba are imported only when a kernel runs
from ..compress.rope import RotaryMemo
from ..config import GearConfig, expect_config
from ..step_ref import StepRef
from .fused_path import FusedPath
from .kernel_state import KernelState
from .layer import GearLayer
from .layout import RowLayout, SlotPlan
from .memory import memory_report, summary
from .workspace import StepWorkspace

SLOT_MAX_QUERY = 16  # decode steps (and short chunks) of a batch whose rows differ attend in the slot layout


def _sliding_windows(config) -> list[int | None]:
    """Per layer: the sliding window, or None for full attention (as transformers' own caches decide)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _model_properties(model_or_config):
    """(head_dim, dtype, device) of a model's KV heads when a model (with parameters) is given, else None."""
    parameter = next(iter(model_or_config.parameters()), None) if isinstance(model_or_config, torch.nn.Module) \
        else None
    if parameter is None:
        return None
    config = _text_config(model_or_config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim, parameter.dtype, parameter.device


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    if not hasattr(config, "num_hidden_layers"):
        raise TypeError(f"GearCache needs a model or a transformers config, got {type(model_or_config).__name__}")
    return config


class GearCache(FusedPath, Cache):
    """A GEAR-compressed KV cache.

    GearCache(model) or GearCache(config=model.config) (transformers' convention); gear_config: defaults to
    the config the model was enabled with, else `GearConfig()`. expected_length: a length every row is known
    to reach (prompt + min_new_tokens; `generate` passes it): room for it is allocated at once. Without it storage
    grows in bounded steps and owns little beyond what it holds (`memory_report`). speculative: keep each decode
    step's own tokens uncompressed until the next step, so that `crop` can take back the tokens verification rejected
    (assisted generation, prompt lookup: `generate` sets it when asked for either).
    """

    def __init__(self, model_or_config=None, gear_config: GearConfig | None = None, *, config=None,
                 expected_length: int | None = None, speculative: bool = False) -> None:
        if config is not None and model_or_config is not None:
            raise TypeError("GearCache takes the model or its config once: GearCache(model) or GearCache(config=...)")
        model_or_config = config if model_or_config is None else model_or_config
        if model_or_config is None:
            raise TypeError("GearCache needs the model or its config: GearCache(model) or "
                            "GearCache(config=model.config)")
        if gear_config is None:
            gear_config = getattr(getattr(model_or_config, "_gear_hf_state", None), "config", None) or GearConfig()
        expect_config(gear_config, "gear_config")
        self.gear_config = gear_config
        self.expected_length = expected_length
        windows = _sliding_windows(_text_config(model_or_config))
        super().__init__(layers=[GearLayer(gear_config, i, w, speculative) for i, w in enumerate(windows)])
        self.layout = RowLayout(gear_config, expected_length, speculative=speculative)
        # 'fused-tc' / 'fused' / 'fallback' / 'reference' per decode layer-step (not prompts)
        self.step_paths: Counter = Counter()
        self.shape: tuple[int, int] | None = None  # (H_kv, d) of the stored layers
        self.model_dtype: torch.dtype | None = None
        self._rotary = RotaryMemo()
        self._workspace = StepWorkspace()
        self._slot_mask_memo: tuple | None = None  # (slot plan, model's mask, remapped mask) of the current step
        self._pending_mask: torch.Tensor | None = None
        self._storing: GearLayer | None = None  # the layer of the last `store`
        self._finite: list[torch.Tensor] = []  # this step's "all compressed entries finite" flags
        self.kernel_state = KernelState()  # what the fused kernels share across layers (counted by the report)
        self.plan: backends.BackendPlan | None = None  # who compresses, reconstructs, attends: set at first store
        self.step_ref = StepRef(self)  # this cache as the compiled cache step takes it (gear_hf.step_ref)
        properties = _model_properties(model_or_config)
        if properties is not None:  # a forced backend that cannot serve this model says so now
            backends.resolve(gear_config, *properties)

    # -- inputs from the model-level hook ------------------------------------------------------------------
    def observe_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """The 2D padding mask of the coming forward step ([B, T_past + q]), or None."""
        if attention_mask is not None and attention_mask.ndim != 2:
            attention_mask = None  # 4D custom masks carry no padding information we can trust
        self._pending_mask = attention_mask

    # -- a step: store, attend (read or fused), compress ---------------------------------------------------
    def store(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              position_ids: torch.Tensor | None = None, query: torch.Tensor | None = None,
              query_rotary=None) -> GearLayer:
        """Append this step's keys (before RoPE) and values [B,H,q,d] of one layer to its buffer; the first
        layer to store in a step plans it for all layers. query [B,Hq,q,d]: the step's queries, which
        key_bit_allocation='query' chooses each row's key widths from (the patched attention passes them), rotated;
        or before RoPE, with query_rotary = the model's (cos, sin) of the step's tokens."""
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            raise RuntimeError("GearCache stores compressed keys/values without autograd; run generation under "
                               "torch.no_grad() or torch.inference_mode() (model.generate does), or pass "
                               "use_cache=False to train")
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer {layer_idx} stored into a GearCache of {len(self.layers)} layers: a GearCache "
                             "belongs to the model it was built from; build one for this model (GearCache(model))")
        layer = self.layers[layer_idx]
        layout = self.layout
        if layer.steps == layout.steps:
            self._plan_step(key_states, position_ids)
        elif layer.steps != layout.steps - 1:
            raise RuntimeError(f"GearCache layer {layer_idx} is {layout.steps - layer.steps} steps behind; layers "
                               "must be updated once per forward step, in order")
        if key_states.shape[0] != layout.batch:
            raise ValueError(f"batch size changed from {layout.batch} to {key_states.shape[0]} in one GearCache")
        if self.plan is None:
            self._bind(key_states)
        layer.append(layout.plan, key_states, value_states, self.gear_config.sink_tokens, query, query_rotary)
        self._storing = layer  # (`use_fused`: a dense window takes the reference path)
        return layer

    def _bind(self, key_states: torch.Tensor) -> None:
        """The first tensors fix the format's head_dim and dtype, and the device: resolve the backends once."""
        self.shape, self.model_dtype = (key_states.shape[1], key_states.shape[3]), key_states.dtype
        self.plan = backends.resolve(self.gear_config, key_states.shape[3], key_states.dtype, key_states.device)
        for layer in self.layers:
            layer.bind(self.plan)

    def _plan_step(self, key_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        if self.layout.steps and self.layers[-1].flushed_step != self.layout.steps:
            stored = sum(layer.steps == self.layout.steps for layer in self.layers)
            raise ValueError(f"the last step stored into {stored} of this GearCache's {len(self.layers)} layers (or "
                             "failed part way): a GearCache belongs to the model it was built from; build one for "
                             "this model (GearCache(model))")
        self._check_finite()  # a previous step whose last layer was not patched
        B, _, q, _ = key_states.shape
        rect_before = self.layout.rect_length
        mask, self._pending_mask = self._pending_mask, None
        new_valid = None
        if mask is not None:
            if mask.shape[0] != B or mask.shape[1] != rect_before + q:
                raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not match a step of {q} "
                                 f"tokens after {rect_before} cached ones (expected [{B}, {rect_before + q}])")
            new_valid = mask[:, -q:]
        self.layout.plan_step(B, q, new_valid, position_ids, key_states.device)

    def read(self, layer_idx: int, key_states: torch.Tensor | None = None,
             value_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """After `store`: the layer's keys (before RoPE) and values in HF's padded layout [B,H,T-start,d] (start:
        the first column a sliding layer sees), reconstructed — the reference path. The step's own tokens are
        in the buffer, exact. Positions: `read_positions()`. (key_states/value_states: ignored, for callers of
        the earlier signature.)"""
        return self._read_padded(layer_idx, self.model_dtype if key_states is None else key_states.dtype)

    def _read_padded(self, layer_idx: int, dtype: torch.dtype, workspace_like: torch.Tensor | None = None,
                     streams: tuple[int, ...] = (0, 1)):
        """`read` itself; workspace_like: a [B,H,q,d] tensor of the step, to build into the step's workspace;
        streams: which to read (0 keys, 1 values)."""
        layer, layout = self.layers[layer_idx], self.layout
        start = layer.visible_start(layout.plan.rect_before)
        out = (None, None)
        if workspace_like is not None:
            out = self._key_value_workspace(workspace_like, layout.rect_length - start, dtype)
        return layer.read(layout, layout.plan.attend, start, dtype, self.gear_config.sink_tokens, out, streams)

    def _key_value_workspace(self, like: torch.Tensor, length: int, dtype: torch.dtype):
        """The step's (keys, values) workspace tensors [B,H,length,d], for states like [B,H,q,d]."""
        B, H, _, d = like.shape
        return tuple(self._workspace.get(role, (B, H, length, d), dtype, like.device) for role in ("keys", "values"))

    def attention_inputs(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, rotary_emb,
                         attention_mask: torch.Tensor | None, padded_layout: bool = False):
        """After `store`, what the reference path hands the model's attention function: (keys, values, mask), keys
        rotated at their stored positions by the model's `rotary_emb` (when stored before RoPE).

        Normally HF's padded layout and the model's own mask. On a decode step of a batch whose rows differ
        (left padding, rows that flushed on different steps) the slot layout instead (`SlotPlan`): each segment
        reconstructs for the whole batch straight into place, with no per-row copies, and the mask is the model's
        own, remapped to those columns. padded_layout: always HF's columns (when the attention weights go back to
        the caller). The tensors returned live in a per-step workspace that the next layer overwrites: use them
        before that. A subclass that overrides `read` gets its reads, in the padded layout."""
        layer, layout = self.layers[layer_idx], self.layout
        dtype = key_states.dtype
        slots = None if padded_layout else self._slot_plan(layer, attention_mask)
        # keys rotated as they are read (the CPU kernels: no pass of their own), else rotated after the read
        rotate_in_read = self.gear_config.pre_rope and type(self).read is GearCache.read \
            and self.plan.reconstruct.rotates_in_read
        if slots is None:
            keys = self._read_rotated(layer_idx, key_states, rotary_emb) if rotate_in_read else None
            if keys is not None:
                return keys, self._read_padded(layer_idx, dtype, workspace_like=key_states, streams=(1,))[0], \
                    attention_mask
            if type(self).read is GearCache.read:
                keys, values = self._read_padded(layer_idx, dtype, workspace_like=key_states)
            else:
                keys, values = self.read(layer_idx, key_states, value_states)
            rotary = lambda: self.rotary_for_read(layer_idx, rotary_emb, values)  # noqa: E731
        else:
            rotary = lambda: self._rotary.get(layout.steps, "slots", rotary_emb, key_states,  # noqa: E731
                                              lambda: layout.slot_positions(slots))
            key_out, value_out = self._key_value_workspace(key_states, slots.local.shape[1], dtype)
            if rotate_in_read:
                scratch, key_out = key_out, self._workspace.get("rotated keys", key_out.shape, dtype, key_out.device)
                keys = layer.key_stream.read_slots(slots, key_out, rotary(), scratch)
            else:
                keys = layer.key_stream.read_slots(slots, key_out)
            values = layer.value_stream.read_slots(slots, value_out)
            attention_mask = self._slot_mask(slots, attention_mask)
            if rotate_in_read:
                return keys, values, attention_mask
        if self.gear_config.pre_rope:
            keys = self._rotated(keys, *rotary())
        return keys, values, attention_mask

    def _read_rotated(self, layer_idx: int, key_states: torch.Tensor, rotary_emb) -> torch.Tensor | None:
        """The padded layout's keys, rotated as they are read into the step's workspace (`Stream.read` with
        rotary), or None when the layout needs the plain read."""
        layer, layout = self.layers[layer_idx], self.layout
        if layer.dense is not None:  # a dense window: the plain read
            return None
        start = layer.visible_start(layout.plan.rect_before)
        scratch, _ = self._key_value_workspace(key_states, layout.rect_length - start, key_states.dtype)
        out = self._workspace.get("rotated keys", scratch.shape, key_states.dtype, key_states.device)
        return layer.key_stream.read(layout, layout.plan.attend, layer.released, start, key_states.dtype,
                                     self.gear_config.sink_tokens, out,
                                     self.rotary_for_read(layer_idx, rotary_emb, key_states), scratch)

    def _rotated(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """keys [B,H,T,d] rotated into the step's workspace (HF's apply_rotary_pos_emb bit for bit)."""
        B, H, T, d = keys.shape
        workspace = self._workspace
        return self.plan.reconstruct.rotate(keys, cos, sin,
                                            workspace.get("rotated keys", keys.shape, keys.dtype, keys.device),
                                            scratch=workspace.get("rotary scratch", (B, H, T, d // 2), keys.dtype,
                                                                  keys.device))

    def _slot_plan(self, layer: GearLayer, attention_mask: torch.Tensor | None) -> SlotPlan | None:
        """The slot layout when this step of this layer can attend in it, else None (the padded layout): a
        compressing cache, rows that differ, a short step with a 4D mask over every column, a layer that keeps its
        whole history (a sliding layer reads its window in the padded layout)."""
        layout, plan = self.layout, self.layout.plan
        if (not self.gear_config.compresses or plan.query_len > SLOT_MAX_QUERY or layer.is_sliding
                or type(self).read is not GearCache.read or layout.uniform(plan.attend)):
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4 \
                or attention_mask.shape[-1] != layout.rect_length:  # (None, a 2D mask, flex attention's BlockMask)
            return None
        stream = layer.key_stream
        prompt_width = stream.prefill.chunk_len if stream.prefill is not None and stream.prefill.fields else 0
        return layout.slot_plan(plan.attend, prompt_width)

    def _slot_mask(self, slots: SlotPlan, mask: torch.Tensor) -> torch.Tensor:
        """The model's 4D mask [B|1, H|1, q, T] (bool, or additive float) over padded columns, remapped to the slot
        columns [B, H|1, q, T_slot]; holes are masked out. Remapped once per step: the layers share the mask."""
        memo = self._slot_mask_memo
        if memo is not None and memo[0] is slots and memo[1] is mask:
            return memo[2]
        B = slots.columns.shape[0]
        expanded = mask.expand(B, *mask.shape[1:])
        index = slots.columns.clamp(min=0)[:, None, None, :].expand(*expanded.shape[:3], -1)
        hole = (slots.columns < 0)[:, None, None, :]
        masked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        remapped = expanded.gather(3, index).masked_fill_(hole, masked)
        self._slot_mask_memo = (slots, mask, remapped)
        return remapped

    def compress_pending(self, layer_idx: int) -> None:
        """After the layer attended: compress what left its buffer (planned once for every layer)."""
        layer = self.layers[layer_idx]
        self._finite += layer.flush(self.layout, self.layout.plan)
        if layer_idx == len(self.layers) - 1:  # the step ends: drop its temporaries, check what it compressed
            self._workspace.clear()
            self._rotary.clear()  # (cos/sin tables grow with T: recomputed each step rather than kept)
            self.kernel_state.end_step()
            self._slot_mask_memo = None
            self.layout.end_step()
            self._check_finite()
        elif self._drops_workspace_per_layer():
            self._workspace.clear()
            self._rotary.clear()

    def _drops_workspace_per_layer(self) -> bool:
        """Whether this step gives its read workspace and rotary tables back after each layer instead of reusing
        them in the next: on a step of many new tokens (the prompt, a long chunk) whose own tokens are at least
        half of what it attends. Such a step's peak is in a layer's MLP, where the model's activations (∝ the
        step's tokens) sit on top of every layer's storage; a history-sized workspace kept from layer to layer
        (keys, values, rotated keys [B,H,T,d] and cos/sin [B,1,T,d]: 3.3 layers' worth of dense KV) would sit
        there too, for an allocation per layer saved that costs little next to such a step's compute
        (the peak KV of `generate`). Decode steps (the step's peak is in the attention, which needs the workspace
        anyway) keep reusing them."""
        plan = self.layout.plan
        return plan.query_len > SLOT_MAX_QUERY and plan.query_len >= plan.rect_before

    def _check_finite(self) -> None:
        if self._finite:
            flags, self._finite = self._finite, []
            if not bool(torch.stack(flags).all()):  # one sync per step, only on steps that compressed
                raise ValueError("non-finite keys/values (NaN or inf) reached the GEAR cache; the model produced "
                                 "them before the cache (check the dtype's range, e.g. fp16)")

    def store_and_read(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
                       position_ids: torch.Tensor | None = None, query: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`store`, `read` (what the attention gets), then `compress_pending`: one whole step of one layer."""
        self.store(layer_idx, key_states, value_states, position_ids, query)
        out = self.read(layer_idx, key_states, value_states)
        self.compress_pending(layer_idx)
        return out

    def held(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values of the layer as held after the last step, in HF's padded layout
        [B,H,T,d]: the last step's own tokens come back as stored (compressed once flushed), released sliding
        chunks as zeros. For diagnostics: what the cache holds, not what the attention was handed."""
        return self.layers[layer_idx].read(self.layout, self.layout.counts, 0, dtype, self.gear_config.sink_tokens)

    def read_positions(self, layer_idx: int) -> torch.Tensor:
        """[B, T-start] positions of the tokens `read` returned (padding columns hold token 0's)."""
        layout = self.layout
        return layout.read_positions(self.layers[layer_idx].visible_start(layout.plan.rect_before))

    def rotary_for_read(self, layer_idx: int, rotary_emb, like: torch.Tensor):
        """(cos, sin) [B,1,T,d] for the keys `read` returned, from the model's rotary module; computed once per step
        per (visible start, rotary module) and shared by the layers."""
        start = self.layers[layer_idx].visible_start(self.layout.plan.rect_before)
        return self._rotary.get(self.layout.steps, start, rotary_emb, like, lambda: self.layout.read_positions(start))

    # -- the layout as earlier callers (tests, kernels' adapter, scripts) read it ----------------------------
    steps = property(lambda self: self.layout.steps)
    batch_size_ = property(lambda self: self.layout.batch)
    rect_length = property(lambda self: self.layout.rect_length)
    positions = property(lambda self: self.layout.positions)
    rect_to_local = property(lambda self: self.layout.rect_to_local)
    prompt_chunk_len = property(lambda self: self.layout.prompt_capacity)
    sink_len = property(lambda self: list(self.layout.counts.sink))
    prefill_len = property(lambda self: list(self.layout.counts.prompt))
    decode_chunks = property(lambda self: list(self.layout.counts.chunks))
    buffer_len = property(lambda self: list(self.layout.counts.buffer))

    def tokens_held(self) -> int:
        """Real (non-padding) tokens held per layer, summed over rows."""
        return sum(self.layout.counts.held(self.layout.chunk_len))

    # -- HF Cache protocol ----------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def _select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (in that order) of every layer and of the shared layout."""
        if self.layout.steps == 0:
            return
        index = index.to(self.layout.device).long()
        for layer in self.layers:
            layer.select_rows(index)
        self.layout.select_rows(index.tolist(), index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.layout.steps:
            self._select_rows(torch.arange(self.layout.batch).repeat_interleave(repeats))

    @property
    def speculative(self) -> bool:
        return self.layout.speculative

    @property
    def is_croppable(self) -> bool:
        """transformers asks before assisted decoding: a speculative GearCache can take back its last step."""
        return self.layout.speculative

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the newest tokens: crop(-n) removes n (crop(0): none), crop(m > 0) keeps the first m (the older
        convention). Only tokens of the last step that are still uncompressed can go (a speculative
        cache keeps all of them); anything else raises a ValueError that says why."""
        length = self.layout.rect_length
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(length - tokens_to_remove, 0)
        if remove == 0:
            return
        last_step = self.layout.plan.query_len if self.layout.plan is not None else 0
        if remove > last_step:
            raise ValueError(f"GearCache cannot crop {remove} tokens: only the last step's {last_step} can be taken "
                             "back (older ones may be compressed, and a sliding layer may have released chunks for "
                             "them)")
        self.layout.crop(remove)
        for layer in self.layers:
            layer.cropped(self.layout.rect_length)

    def reset(self) -> None:
        raise NotImplementedError("GearCache cannot be reset in place; create a new GearCache")

    # -- accounting -----------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes the cache owns (the headline: held by tokens, by component, + spare capacity + kernel state +
        workspaces), bits/element owned and held, against the model dtype and 16 bits: see gear_hf.cache.memory."""
        return memory_report(self)

    def summary(self) -> str:
        """One line: method, tokens, bits/element owned, share of the uncompressed KV, what it is made of."""
        return summary(self.memory_report())
