"""Record every layer's queries, keys (before RoPE) and values for a text, and the streaming schedule a cache is
filled with (the prompt at prefill, then chunks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCapture:
    query: torch.Tensor  # [1, Hq, T, d] before RoPE
    key: torch.Tensor  # [1, Hkv, T, d] before RoPE
    value: torch.Tensor  # [1, Hkv, T, d]
    cos: torch.Tensor  # [1, T, d]
    sin: torch.Tensor
    scaling: float


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> list[LayerCapture]:
    """Run `model` (stock forward, no cache) on one row of ids and keep each layer's q/k/v."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"capture_qkv takes one row, got a batch of {input_ids.shape[0]}")
    from gear_hf.patches import spec_for

    captures: dict[int, LayerCapture] = {}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        cos, sin = kwargs["position_embeddings"]
        captures[module.layer_idx] = LayerCapture(
            module.q_proj(hidden).view(shape).transpose(1, 2), module.k_proj(hidden).view(shape).transpose(1, 2),
            module.v_proj(hidden).view(shape).transpose(1, 2), cos, sin, module.scaling)

    modules = spec_for(model).attention_modules(model)
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [captures[i] for i in sorted(captures)]


def stream_steps(total: int, prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each forward step: the prompt at prefill, then the rest in chunks of `chunk`."""
    if not 0 < prompt <= total:
        raise ValueError(f"prompt length {prompt} must be in [1, {total}]")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    return [(0, prompt)] + [(t, min(chunk, total - t)) for t in range(prompt, total, chunk)]


class _NumLayers:
    """The minimal config a GearCache needs when no model is at hand."""

    def __init__(self, layers: int) -> None:
        self.num_hidden_layers = layers
