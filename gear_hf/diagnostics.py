"""Measure compression where its error is consumed: attention output, not only reconstruction.

`capture_qkv` records every layer's queries, keys (before RoPE) and values for a text; `layer_errors`
streams those keys/values through a real `GearCache` (prompt compressed at prefill, the rest fed one token
at a time, so decode chunks count) and compares, per layer, the reconstruction and the attention output
of the last queries against the uncompressed tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import apply_rotary
from .cache import GearCache
from .config import GearConfig


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


def _attend(query, key, value, scaling, last: int) -> torch.Tensor:
    """Causal attention output of the last `last` queries, fp32, GQA expanded: [1, Hq, last, d]."""
    group = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(group, dim=1)
    value = value.float().repeat_interleave(group, dim=1)
    T = key.shape[2]
    q = query[:, :, T - last:].float()
    scores = q @ key.transpose(-1, -2) * scaling  # [1,Hq,last,T]
    causal = torch.arange(T)[None, :] > torch.arange(T - last, T)[:, None]
    scores = scores.masked_fill(causal.to(scores.device), float("-inf"))
    return scores.softmax(-1) @ value


def layer_errors(captures: list[LayerCapture], config: GearConfig, decode_tokens: int = 64,
                 last_queries: int = 32) -> list[dict]:
    """Per layer: relative errors of K, V (reconstruction) and of the attention output of the last queries,
    with the first T - decode_tokens tokens as the prompt and the rest fed one by one."""
    T = captures[0].key.shape[2]
    if not 0 <= decode_tokens < T:
        raise ValueError(f"decode_tokens={decode_tokens} must be in [0, {T})")
    layers = len(captures)
    cache = GearCache(_NumLayers(layers), config)
    prompt = T - decode_tokens
    cols = [(0, prompt)] + [(t, 1) for t in range(prompt, T)]
    rebuilt: list[tuple[torch.Tensor, torch.Tensor]] = [None] * layers
    for start, length in cols:
        for i, cap in enumerate(captures):
            k = cap.key[:, :, start:start + length]
            if not config.pre_rope:
                k = apply_rotary(k, cap.cos[:, start:start + length], cap.sin[:, start:start + length])
            rebuilt[i] = cache.store_and_read(i, k, cap.value[:, :, start:start + length])
    rows = []
    for i, cap in enumerate(captures):
        keys, values = rebuilt[i]
        if config.pre_rope:
            keys = apply_rotary(keys, cap.cos, cap.sin)
        exact_keys = apply_rotary(cap.key, cap.cos, cap.sin)
        query = apply_rotary(cap.query, cap.cos, cap.sin)
        out = _attend(query, exact_keys, cap.value, cap.scaling, last_queries)
        approx = _attend(query, keys, values, cap.scaling, last_queries)
        rows.append({
            "layer": i,
            "key_error": _relative(keys, exact_keys),
            "value_error": _relative(values, cap.value),
            "attention_output_error": _relative(approx, out),
        })
    return rows


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


class _NumLayers:
    """The minimal config a GearCache needs when no model is at hand."""

    def __init__(self, layers: int) -> None:
        self.num_hidden_layers = layers


@torch.no_grad()
def teacher_forced_agreement(model, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor,
                             config: GearConfig) -> dict:
    """Feed prompt + continuation through `model` the way generation does (prompt at prefill, then one token
    per step), once with transformers' DynamicCache and once with a GEAR cache, and compare each next-token
    distribution: top-1 agreement rate and KL(stock || gear). Both id tensors are [1, n]."""
    from transformers import DynamicCache

    from .api import enabled

    stock = _streamed_logits(model, prompt_ids, continuation_ids, DynamicCache(config=model.config))
    with enabled(model, config):
        gear = _streamed_logits(model, prompt_ids, continuation_ids, GearCache(model, config))
    log_p, log_q = stock.log_softmax(-1), gear.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"top1_agreement": (stock.argmax(-1) == gear.argmax(-1)).float().mean().item(),
            "mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "positions": kl.shape[0]}


def _streamed_logits(model, prompt_ids, continuation_ids, cache) -> torch.Tensor:
    """Next-token logits [n, V] (float32) after the prompt and after each continuation token but the last."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    steps = [model(input_ids=prompt_ids, **{name: cache}).logits[0, -1]]
    for t in range(continuation_ids.shape[1] - 1):
        steps.append(model(input_ids=continuation_ids[:, t: t + 1], **{name: cache}).logits[0, -1])
    return torch.stack(steps).float()
