"""`FusedPath`: the fused decode attention of a `GearCache` — whether a step takes it, and the kernel's views.

The attending backend (`GearCache.plan.attend`: numba on CPU, Triton on CUDA) reads the compressed storage and the
buffer directly; the reference path (reconstruct, rotate, the model's attention function) stays the default and
the oracle (`GearCache.attention_inputs`).
"""

from __future__ import annotations

import torch

from ..kernels import MAX_FUSED_QUERY


class FusedPath:
    """Mixed into GearCache (which owns `plan`, `layout`, `layers`, `gear_config`, `kernel_state`)."""

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
        if attend is None or training or output_attentions:
            return False
        reason = attend.step_reason(query.shape[-1], query.shape[-2], rotary_dim, softcap)
        if reason is None:
            return True
        if self.plan.forced == attend.name and query.shape[-2] <= MAX_FUSED_QUERY:
            raise NotImplementedError(f"GEAR backend {attend.name!r} was forced but {reason}; use backend='auto' "
                                      "or 'torch'")
        return False

    def fused_attention(self, layer_idx: int, query: torch.Tensor, *, scaling: float, inv_freq: torch.Tensor,
                        attention_scaling: float = 1.0) -> torch.Tensor:
        """After `store`, attend `query` [B,Hq,q,d] (already rotated) straight from the compressed storage and the
        buffer (this step's own tokens included) with the fused kernel (Triton on CUDA, numba on CPU): nothing is
        written back. Keys are rotated in the kernel from the stored positions with `inv_freq`/`attention_scaling`
        (the rotary module's). Returns [B, q, Hq, d] (HF's attention-function layout)."""
        layer = self.layers[layer_idx]
        keys, values, layout = self.kernel_views(layer_idx, query.shape[2], query.device)
        self.kernel_state.step = self.layout.steps
        return self.plan.attend.attend(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                                       attention_scaling=attention_scaling, sliding_window=layer.sliding_window,
                                       shared=self.kernel_state)

    def kernel_views(self, layer_idx: int, query_len: int, device):
        """(keys StreamView, values StreamView, DecodeLayout) of a layer for the fused kernel: during a step
        (stored, not yet compressed) what the step attends to, between steps what the layer holds."""
        from ..kernels.views import DecodeLayout  # no triton import

        layer, layout = self.layers[layer_idx], self.layout
        in_step = layer.flushed_step != layout.steps
        counts = layout.plan.attend if in_step else layout.counts
        inputs = layout.kernel_inputs(counts, layer.released, query_len, device)
        sink, prompt, chunks, buffer = (max(column, default=0) for column in zip(*inputs["row_lengths"]))
        kernel_layout = DecodeLayout(rows=inputs["rows"], limits=inputs["limits"], positions=inputs["positions"],
                                     max_sink=sink, max_prompt=prompt, max_decode_chunks=chunks, max_buffer=buffer,
                                     buffer_size=self.gear_config.buffer_size)
        keys, values = (stream.kernel_view(self.gear_config.sink_tokens, prompt > 0, chunks)
                        for stream in layer.streams)
        return keys, values, kernel_layout
