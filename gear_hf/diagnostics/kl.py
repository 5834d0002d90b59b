"""Next-token KL(stock ‖ GEAR), teacher forced through the real model and the real streaming cache: the one KL
path of the diagnostics (whole model, one layer, or one KV head compressed)."""

from __future__ import annotations

import torch

from ..cache import GearCache
from ..config import GearConfig
from ..hf_compat import model_cache_kwarg
from .capture import stream_steps


class SelectiveGearCache(GearCache):
    """A real `GearCache` (everything is stored and compressed as usual) whose reads hand the attention the
    exact keys/values except where `select` says to use the compressed ones: select maps a layer index to None
    (the whole layer compressed) or to a list of KV heads. `select=None` compresses everything (a plain
    GearCache). For diagnostics only: it keeps an uncompressed copy of what it was given."""

    def __init__(self, model_or_config, gear_config: GearConfig, select: dict | None = None) -> None:
        super().__init__(model_or_config, gear_config)
        self.select = select
        self._exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def read(self, layer_idx, key_states, value_states):
        keys, values = super().read(layer_idx, key_states, value_states)
        if self.select is None or (layer_idx in self.select and self.select[layer_idx] is None):
            return keys, values
        if layer_idx not in self._exact:
            self._exact[layer_idx] = (key_states, value_states)
        else:
            k, v = self._exact[layer_idx]
            self._exact[layer_idx] = (torch.cat([k, key_states], 2), torch.cat([v, value_states], 2))
        exact_k, exact_v = (t[:, :, t.shape[2] - keys.shape[2]:] for t in self._exact[layer_idx])
        heads = self.select.get(layer_idx) or []
        out_k, out_v = exact_k.clone(), exact_v.clone()
        if heads:
            out_k[:, heads], out_v[:, heads] = keys[:, heads], values[:, heads]
        return out_k, out_v


@torch.no_grad()
def streamed_logits(model, input_ids: torch.Tensor, prompt_len: int, chunk: int, cache) -> torch.Tensor:
    """Teacher forcing the way generation fills a cache: the first `prompt_len` ids at prefill, then the rest in
    chunks of `chunk`. Returns the next-token logits [T - prompt_len, V] (float32) that predict ids
    prompt_len..T-1."""
    name = model_cache_kwarg(model)
    T = input_ids.shape[1]
    logits = []
    for start, length in stream_steps(T, prompt_len, chunk):
        out = model(input_ids=input_ids[:, start:start + length], **{name: cache}).logits[0]
        logits.append(out[-1:] if start == 0 else out)
    return torch.cat(logits)[: T - prompt_len].float()


def kl_divergence(reference: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) ‖ softmax(approx)) per row of logits [n, V] -> [n]."""
    log_p, log_q = reference.log_softmax(-1), approx.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def stock_logits(model, input_ids: torch.Tensor, prompt_len: int, chunk: int) -> torch.Tensor:
    """`streamed_logits` with transformers' own DynamicCache (the uncompressed reference)."""
    from transformers import DynamicCache

    return streamed_logits(model, input_ids, prompt_len, chunk, DynamicCache(config=model.config))


@torch.no_grad()
def next_token_kl(model, input_ids: torch.Tensor, prompt_len: int, config: GearConfig, chunk: int | None = None,
                  select: dict | None = None, reference: torch.Tensor | None = None) -> dict:
    """KL(stock ‖ GEAR) and top-1 agreement of the next-token distribution over ids prompt_len..T-1, teacher
    forced through the real model (GEAR enabled) and cache. select: see `SelectiveGearCache`."""
    from ..api import enabled

    config = config.replace(backend="torch")
    chunk = chunk or config.buffer_size
    if reference is None:
        reference = stock_logits(model, input_ids, prompt_len, chunk)
    with enabled(model, config):
        cache = SelectiveGearCache(model, config, select)
        gear = streamed_logits(model, input_ids, prompt_len, chunk, cache)
    kl = kl_divergence(reference, gear)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "top1_agreement": (reference.argmax(-1) == gear.argmax(-1)).float().mean().item(),
            "positions": kl.shape[0]}


@torch.no_grad()
def kl_map(model, input_ids: torch.Tensor, prompt_len: int, config: GearConfig, chunk: int | None = None,
           level: str = "layer", reference: torch.Tensor | None = None, progress=None) -> dict:
    """{(layer, kv_head): mean next-token KL} with only that layer (level="layer": the value is repeated for
    every KV head) or only that KV head of that layer (level="head") compressed."""
    from ..cache import _text_config

    text = _text_config(model)
    layers = text.num_hidden_layers
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    chunk = chunk or config.buffer_size
    if reference is None:
        reference = stock_logits(model, input_ids, prompt_len, chunk)
    out = {}
    for layer in range(layers):
        targets = [None] if level == "layer" else [[h] for h in range(kv_heads)]
        for heads in targets:
            result = next_token_kl(model, input_ids, prompt_len, config, chunk, {layer: heads}, reference)
            for h in (range(kv_heads) if heads is None else heads):
                out[(layer, h)] = result["mean_kl"]
            if progress:
                progress()
    return out


def teacher_forced_agreement(model, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor,
                             config: GearConfig, reference: torch.Tensor | None = None) -> dict:
    """`next_token_kl` fed the way generation feeds a cache (prompt at prefill, then one token per step): top-1
    agreement and KL(stock ‖ gear) over the continuation. Both id tensors are [1, n]. reference: the stock logits
    [n, V] predicting the continuation, when already at hand (a greedy continuation's own: `generate(...,
    output_logits=True)`, computed the same way), else computed here (`stock_logits`)."""
    ids = torch.cat([prompt_ids, continuation_ids], dim=1)
    return next_token_kl(model, ids, prompt_ids.shape[1], config, chunk=1, reference=reference)
