"""Errors where they are consumed, per layer (`layer_errors`) and per layer x head (`head_errors`), streaming the
captured keys/values through a real `GearCache` as generation fills it."""

from __future__ import annotations

import torch

from ..attention import apply_rotary
from ..cache import GearCache
from ..config import GearConfig
from .capture import LayerCapture, _NumLayers, stream_steps


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
    for start, length in cols:
        for i, cap in enumerate(captures):
            k = cap.key[:, :, start:start + length]
            if not config.pre_rope:
                k = apply_rotary(k, cap.cos[:, start:start + length], cap.sin[:, start:start + length])
            cache.store_and_read(i, k, cap.value[:, :, start:start + length],
                                 query=cap.query[:, :, start:start + length])
    rows = []
    for i, cap in enumerate(captures):
        keys, values = cache.held(i, cap.value.dtype)  # what the cache holds after the last step (its flush done)
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


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().repeat_interleave(group, dim=1)


@torch.no_grad()
def head_errors(captures: list[LayerCapture], config: GearConfig, prompt_len: int, chunk: int | None = None,
                include_prompt: bool = False) -> list[dict]:
    """Per layer and query head: the errors of `METRIC_DOC` (all but `kl`), streaming the captured keys/values
    through a `GearCache` the way generation fills it (the prompt's first `prompt_len` tokens at prefill, the
    rest in chunks of `chunk`, default the buffer size). Each step's queries are compared against what the cache
    returned at that step. Measured queries: the continuation's (and the prompt's with include_prompt)."""
    config = config.replace(backend="torch")
    T = captures[0].key.shape[2]
    steps = stream_steps(T, prompt_len, chunk or config.buffer_size)
    layers = len(captures)
    cache = GearCache(_NumLayers(layers), config)
    Hq, Hkv = captures[0].query.shape[1], captures[0].key.shape[1]
    zeros = lambda: torch.zeros(layers, Hq, dtype=torch.float64)
    acc = {name: zeros() for name in ("score_diff", "score_ref", "tv", "rows", "out_diff", "out_ref")}
    final: list[tuple[torch.Tensor, torch.Tensor]] = [None] * layers
    for step, (start, length) in enumerate(steps):
        end = start + length
        measured = include_prompt or step > 0
        for i, cap in enumerate(captures):
            cos, sin = cap.cos[:, :end], cap.sin[:, :end]
            k = cap.key[:, :, start:end]
            if not config.pre_rope:
                k = apply_rotary(k, cap.cos[:, start:end], cap.sin[:, start:end])
            keys, values = cache.store_and_read(i, k, cap.value[:, :, start:end],  # what attention gets
                                                query=cap.query[:, :, start:end])
            if config.pre_rope:
                keys = apply_rotary(keys, cos, sin)
            if step == len(steps) - 1:
                final[i] = _held(cache, i, cap, config)
            if not measured:
                continue
            group = Hq // Hkv
            exact_k = _expand(apply_rotary(cap.key[:, :, :end], cos, sin), group)
            exact_v = _expand(cap.value[:, :, :end], group)
            approx_k, approx_v = _expand(keys, group), _expand(values, group)
            q = apply_rotary(cap.query[:, :, start:end], cap.cos[:, start:end], cap.sin[:, start:end]).float()
            causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]  # [q, T]
            causal = causal.to(q.device)
            s_exact = (q @ exact_k.transpose(-1, -2)) * cap.scaling  # [1,Hq,q,T]
            s_approx = (q @ approx_k.transpose(-1, -2)) * cap.scaling
            diff = (s_approx - s_exact).masked_fill(~causal, 0.0)
            acc["score_diff"][i] += diff.square().sum(dim=(0, 2, 3)).double().cpu()
            acc["score_ref"][i] += s_exact.masked_fill(~causal, 0.0).square().sum(dim=(0, 2, 3)).double().cpu()
            p_exact = s_exact.masked_fill(~causal, float("-inf")).softmax(-1)
            p_approx = s_approx.masked_fill(~causal, float("-inf")).softmax(-1)
            acc["tv"][i] += 0.5 * (p_approx - p_exact).abs().sum(-1).sum(dim=(0, 2)).double().cpu()
            acc["rows"][i] += length
            o_exact, o_approx = p_exact @ exact_v, p_approx @ approx_v
            acc["out_diff"][i] += (o_approx - o_exact).square().sum(dim=(0, 2, 3)).double().cpu()
            acc["out_ref"][i] += o_exact.square().sum(dim=(0, 2, 3)).double().cpu()
    rows = []
    for i, cap in enumerate(captures):
        keys, values = final[i]
        exact_keys = apply_rotary(cap.key, cap.cos, cap.sin)
        k_err = _relative_per_head(keys, exact_keys)
        v_err = _relative_per_head(values, cap.value)
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            rel = lambda d, r: float((acc[d][i, h] / acc[r][i, h].clamp_min(1e-30)).sqrt()) \
                if acc["rows"][i, h] else float("nan")
            rows.append({
                "layer": i, "head": h, "kv_head": kv,
                "key_error": k_err[kv], "value_error": v_err[kv],
                "score_error": rel("score_diff", "score_ref"),
                "prob_error": float(acc["tv"][i, h] / acc["rows"][i, h]) if acc["rows"][i, h] else float("nan"),
                "output_error": rel("out_diff", "out_ref"),
            })
    return rows


def _held(cache: GearCache, layer_idx: int, cap: LayerCapture, config: GearConfig):
    """Every token as the cache holds it after the last step (compressed chunks reconstructed, buffer exact),
    keys rotated: `read` hands the attention the current step's own tokens exactly, the store holds them
    compressed once flushed, and the reconstruction error is about what is held."""
    keys, values = cache.held(layer_idx, cap.value.dtype)
    if config.pre_rope:
        keys = apply_rotary(keys, cap.cos, cap.sin)
    return keys, values


def _relative_per_head(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    diff = (a.float() - b.float()).square().sum(dim=(0, 2, 3))
    ref = b.float().square().sum(dim=(0, 2, 3)).clamp_min(1e-30)
    return (diff / ref).sqrt().tolist()
