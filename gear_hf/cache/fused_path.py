"""`FusedPath`: the fused decode attention of a `GearCache` — whether a step takes it, and the kernel's views.

The attending backend (`GearCache.plan.attend`: numba on CPU, Triton on CUDA) reads the compressed storage and the
buffer directly; the reference path (reconstruct, rotate, the model's attention function) stays the default and
the oracle (`GearCache.attention_inputs`). With the Triton backend reconstructing too, the reference path is the
memory-bound fallback (one reconstruction launch per store into the step's workspace, then SDPA), and under
backend="auto" a decode step takes whichever of the two the cost model (`gear_hf.backends.cost`) finds faster for
the format, the history's length and the batch; `decode_path` overrides that per cache.
"""

from __future__ import annotations

import torch

from ..backends.cost import PathCosts, decode_path_costs
from ..compress.rope import apply_rotary
from ..kernels import MAX_FUSED_QUERY
from ..kernels.views import DecodeLayout

DECODE_PATHS = ("auto", "fused", "fallback")


class FusedPath:
    """Mixed into GearCache (which owns `plan`, `layout`, `layers`, `gear_config`, `kernel_state`).

    decode_path: "auto" (the default: under backend="auto" the cost model chooses between the fused kernel and the
    fallback when both exist; a forced backend's fused kernel always runs), "fused", or "fallback" (decode steps
    take the reference path, with the Triton reconstruction where the plan has it)."""

    decode_path = "auto"
    path_costs: PathCosts | None = None  # the cost model's last estimate (None until it ran)
    _path_memo: tuple | None = None  # ((step, tokens, buffered), chose fused) of the current step

    @property
    def reference_path_name(self) -> str:
        """What `step_paths` calls a decode step on the reference path: "fallback" when the Triton kernel
        reconstructs (the memory-bound fallback), else "reference"."""
        return "fallback" if self.plan is not None and self.plan.reconstruct.name == "triton" else "reference"

    @property
    def fused_path_name(self) -> str:
        """What `step_paths` calls the last fused step: "fused-tc" (the Triton tensor-core kernel) or "fused" (the
        Triton register kernel, or the CPU kernel); `kernel_state.attend_reason` says why not the tensor-core one."""
        return self.kernel_state.attend_path

    @property
    def backend_names(self) -> dict[str, str]:
        """Which backend runs each operation ({"compress": "numba", "reconstruct": "numba", "attend": "numba" |
        "reference"}); empty before the first step."""
        return {} if self.plan is None else self.plan.names()

    def use_fused(self, query: torch.Tensor, *, training: bool = False, output_attentions: bool = False,
                  rotary_dim: int | None = None, softcap: float | None = None) -> bool:
        """Whether this step of the attention takes the fused kernel (after `store`): the plan has one, and the
        step is one it takes. A forced backend raises on a model-level reason (partial rotary, soft-capping);
        prompt steps always take the reference path."""
        attend = self.plan.attend if self.plan is not None else None
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"GearCache.decode_path={self.decode_path!r}; allowed: {' | '.join(DECODE_PATHS)}")
        if attend is None or training or output_attentions or self.decode_path == "fallback":
            return False
        reason = attend.step_reason(query.shape[-1], query.shape[-2], rotary_dim, softcap)
        if reason is None and getattr(self, "_storing", None) is not None and self._storing.dense is not None:
            return False  # a sliding layer stored dense (`GearLayer.dense`): nothing compressed to fuse
        if reason is None:
            return self._fused_is_cheaper(query) if self._chooses_path() else True
        if self.plan.forced == attend.name and query.shape[-2] <= MAX_FUSED_QUERY:
            raise NotImplementedError(f"GEAR backend {attend.name!r} was forced but {reason}; use backend='auto' "
                                      "or 'torch'")
        return False

    def _chooses_path(self) -> bool:
        """Whether the cost model decides this cache's decode steps: decode_path "auto" under backend="auto" with a
        Triton plan that both attends and reconstructs."""
        plan = self.plan
        return self.decode_path == "auto" and plan.forced is None and plan.attend.name == "triton" \
            and plan.reconstruct.name == "triton"

    def _fused_is_cheaper(self, query: torch.Tensor) -> bool:
        """The cost model's choice for this step (the same for every layer of a step with the same lengths)."""
        counts, nb = self.layout.plan.attend, self.layout.chunk_len
        tokens = max((p + c * nb for p, c in zip(counts.prompt, counts.chunks)), default=0)
        buffered = max((s + f for s, f in zip(counts.sink, counts.buffer)), default=0)
        key = (self.layout.steps, tokens, buffered, query.shape[1], query.shape[2])
        if self._path_memo is None or self._path_memo[0] != key:
            B, Hq, q_len, d = query.shape
            costs = decode_path_costs(self.gear_config, tokens=tokens, batch=B, kv_heads=self.shape[0],
                                      query_heads=Hq, head_dim=d, query_len=q_len, buffered=buffered,
                                      model_bytes=query.element_size())
            self.path_costs = costs
            self._path_memo = (key, costs.choice == "fused")
        return self._path_memo[1]

    def fused_attention(self, layer_idx: int, query: torch.Tensor, *, scaling: float, inv_freq: torch.Tensor,
                        attention_scaling: float = 1.0, query_rotary=None) -> torch.Tensor:
        """After `store`, attend `query` [B,Hq,q,d] (already rotated; or, with query_rotary = the model's (cos, sin)
        of the step's tokens, before RoPE) straight from the compressed storage and the buffer (this step's own
        tokens included) with the fused kernel (Triton on CUDA, numba on CPU): nothing is written back. Keys are
        rotated in the kernel from the stored positions with `inv_freq`/`attention_scaling` (the rotary module's).
        Returns [B, q, Hq, d] (HF's attention-function layout)."""
        extra = {}
        if query_rotary is not None:  # (rotated by the kernel where it can, bit for bit as here)
            if self.plan.attend.rotates_queries(query, query_rotary[0]):
                extra["query_rotary"] = query_rotary
            else:
                query = apply_rotary(query, *query_rotary)
        layer = self.layers[layer_idx]
        keys, values, layout = self.kernel_views(layer_idx, query.shape[2], query.device, reader=self.plan.attend)
        self.kernel_state.step = self.layout.steps
        self.kernel_state.attend_path, self.kernel_state.attend_reason = "fused", None  # (a backend may say more)
        return self.plan.attend.attend(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                                       attention_scaling=attention_scaling, sliding_window=layer.sliding_window,
                                       shared=self.kernel_state, **extra)

    def kernel_views(self, layer_idx: int, query_len: int, device, reader=None):
        """(keys StreamView, values StreamView, DecodeLayout) of a layer for the fused kernel: during a step
        (stored, not yet compressed) what the step attends to, between steps what the layer holds. reader: the
        backend that attends, when it reads a coded buffer's fields (`Backend.reads_tail`); None: any kernel (a
        coded buffer decoded)."""
        layer, layout = self.layers[layer_idx], self.layout
        in_step = layer.flushed_step != layout.steps
        counts = layout.plan.attend if in_step else layout.counts
        # keys and values both held a chunk longer: each row's newest chunk is at both buffers' front, so the kernels
        # read the rows as the streams store them, (c - 1 chunks, nb + f buffered), with no held chunk of either
        both_held = all(stream.held_chunk for stream in layer.streams)
        if both_held:
            counts = layer.key_stream.own(counts)
        inputs = layout.kernel_inputs(counts, layer.released, query_len, device)
        sink, prompt, chunks, buffer = (max(column, default=0) for column in zip(*inputs["row_lengths"]))
        kernel_layout = DecodeLayout(rows=inputs["rows"], limits=inputs["limits"], positions=inputs["positions"],
                                     max_sink=sink, max_prompt=prompt, max_decode_chunks=chunks, max_buffer=buffer,
                                     buffer_size=self.gear_config.buffer_size)
        keys, values = (stream.kernel_view(self.gear_config.sink_tokens, prompt > 0, chunks, reader,
                                           counted_own=both_held) for stream in layer.streams)
        return keys, values, kernel_layout
