"""Measure compression where its error is consumed: attention scores, attention output, next token.

`capture_qkv` records every layer's queries, keys (before RoPE) and values for a text; `layer_errors`
streams those keys/values through a real `GearCache` (prompt compressed at prefill, the rest fed one token
at a time, so decode chunks count) and compares, per layer, the reconstruction and the attention output
of the last queries against the uncompressed tensors.

`head_errors` does the same per layer and head, step by step as the cache is filled (prompt at prefill, the
continuation in chunks, by default buffer-sized): reconstruction error of K and V (what the cache holds at the
end), error of the attention scores (pre-softmax logits) and probabilities, and of the attention output, each
query measured against exactly what the cache handed the attention at that step (its own step's tokens exact,
earlier ones as stored). `kl_map` gives the next-token KL (stock vs GEAR,
teacher forced through the real model and the real streaming cache) when only one layer, or one KV head of
one layer, is compressed; `next_token_kl` the same with everything compressed. `diagnose` runs them all and
`write_report` writes a CSV, a Markdown summary and one layer x head heatmap PNG per metric.

    python -m gear_hf.diagnostics --model smollm2 --method gear --bits 2 --out results/diagnostics/gear-2
    python -m gear_hf.diagnostics --model smollm2 --method kivi --bits 2 --set key_axis=token \\
        --set value_axis=channel --kl head
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


# ---------------------------------------------------------------------------------------------------------------
# Per layer x head, step by step through the real streaming cache
# ---------------------------------------------------------------------------------------------------------------

METRICS = ("key_error", "value_error", "score_error", "prob_error", "output_error", "kl")
METRIC_DOC = {
    "key_error": "relative Frobenius error of the keys held at the end (after RoPE, as consumed), per KV head",
    "value_error": "relative Frobenius error of the values held at the end, per KV head",
    "score_error": "relative error of the attention logits q·k·scaling over the causal entries of the measured "
                   "queries, per query head",
    "prob_error": "mean total-variation distance ½‖p̂−p‖₁ between attention distributions of the measured "
                  "queries, per query head",
    "output_error": "relative error of the attention output of the measured queries, per query head",
    "kl": "mean KL(stock ‖ GEAR) of the next-token distribution over the continuation when only this layer/KV "
          "head is compressed (teacher forced through the real model), per KV head",
}
KV_METRICS = ("key_error", "value_error", "kl")  # measured per KV head; the rest per query head


def stream_steps(total: int, prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each forward step: the prompt at prefill, then the rest in chunks of `chunk`."""
    if not 0 < prompt <= total:
        raise ValueError(f"prompt length {prompt} must be in [1, {total}]")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    return [(0, prompt)] + [(t, min(chunk, total - t)) for t in range(prompt, total, chunk)]


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
            keys, values = cache.store_and_read(i, k, cap.value[:, :, start:end])  # what attention gets
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


def _cache_arg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def streamed_logits(model, input_ids: torch.Tensor, prompt_len: int, chunk: int, cache) -> torch.Tensor:
    """Teacher forcing the way generation fills a cache: the first `prompt_len` ids at prefill, then the rest in
    chunks of `chunk`. Returns the next-token logits [T - prompt_len, V] (float32) that predict ids
    prompt_len..T-1."""
    name = _cache_arg(model)
    T = input_ids.shape[1]
    logits = []
    for start, length in stream_steps(T, prompt_len, chunk):
        out = model(input_ids=input_ids[:, start:start + length], **{name: cache}).logits[0]
        logits.append(out[-1:] if start == 0 else out)
    return torch.cat(logits)[: T - prompt_len].float()


def _kl(stock: torch.Tensor, gear: torch.Tensor) -> torch.Tensor:
    log_p, log_q = stock.log_softmax(-1), gear.log_softmax(-1)
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
    from .api import enabled

    config = config.replace(backend="torch")
    chunk = chunk or config.buffer_size
    if reference is None:
        reference = stock_logits(model, input_ids, prompt_len, chunk)
    with enabled(model, config):
        cache = SelectiveGearCache(model, config, select)
        gear = streamed_logits(model, input_ids, prompt_len, chunk, cache)
    kl = _kl(reference, gear)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "top1_agreement": (reference.argmax(-1) == gear.argmax(-1)).float().mean().item(),
            "positions": kl.shape[0]}


@torch.no_grad()
def kl_map(model, input_ids: torch.Tensor, prompt_len: int, config: GearConfig, chunk: int | None = None,
           level: str = "layer", reference: torch.Tensor | None = None, progress=None) -> dict:
    """{(layer, kv_head): mean next-token KL} with only that layer (level="layer": the value is repeated for
    every KV head) or only that KV head of that layer (level="head") compressed."""
    from .cache import _text_config

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


@dataclass
class Diagnosis:
    rows: list[dict]  # per (layer, query head): METRICS
    summary: dict  # global numbers (all layers compressed)
    conditions: dict  # model, config, lengths, versions


def diagnose(model, input_ids: torch.Tensor, config: GearConfig, prompt_len: int, chunk: int | None = None,
             kl: str = "layer", include_prompt: bool = False, progress=None) -> Diagnosis:
    """Every metric of `METRIC_DOC` for one text (`input_ids` [1, T]; the first `prompt_len` ids are the
    prompt). kl: "none", "layer" (one teacher-forced run per layer) or "head" (one per layer and KV head)."""
    import transformers

    if kl not in ("none", "layer", "head"):
        raise ValueError(f"kl={kl!r}: one of none, layer, head")
    chunk = chunk or config.buffer_size
    captures = capture_qkv(model, input_ids)
    rows = head_errors(captures, config, prompt_len, chunk, include_prompt)
    reference = stock_logits(model, input_ids, prompt_len, chunk)
    summary = next_token_kl(model, input_ids, prompt_len, config, chunk, None, reference)
    if kl != "none":
        per = kl_map(model, input_ids, prompt_len, config, chunk, kl, reference, progress)
        for row in rows:
            row["kl"] = per[(row["layer"], row["kv_head"])]
    else:
        for row in rows:
            row["kl"] = float("nan")
    for name in METRICS[:-1]:
        summary[f"mean_{name}"] = sum(r[name] for r in rows) / len(rows)
    conditions = {
        "model_type": getattr(getattr(model, "config", None), "model_type", "?"),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "config": config.describe(), "gear_config": {k: v for k, v in vars(config).items()},
        "tokens": int(input_ids.shape[1]), "prompt_tokens": prompt_len, "chunk": chunk, "kl_level": kl,
        "include_prompt_queries": include_prompt,
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
    }
    return Diagnosis(rows, summary, conditions)


def layer_means(rows: list[dict]) -> list[dict]:
    """Rows averaged over heads, one per layer."""
    out = []
    for layer in sorted({r["layer"] for r in rows}):
        mine = [r for r in rows if r["layer"] == layer]
        out.append({"layer": layer, **{m: sum(r[m] for r in mine) / len(mine) for m in METRICS}})
    return out


def heatmap(rows: list[dict], metric: str, path, title: str = "") -> None:
    """One layer x head heatmap PNG of `metric` (KV heads for key/value/kl, query heads otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = "kv_head" if metric in KV_METRICS else "head"
    layers = max(r["layer"] for r in rows) + 1
    heads = max(r[col] for r in rows) + 1
    grid = torch.full((layers, heads), float("nan"))
    for r in rows:
        grid[r["layer"], r[col]] = r[metric]
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * heads, 1.2 + 0.22 * layers))
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("KV head" if col == "kv_head" else "query head")
    ax.set_ylabel("layer")
    ax.set_title(f"{title}\n{metric}" if title else metric, fontsize=9)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(diagnosis: Diagnosis, out_dir) -> dict:
    """heads.csv (one row per layer and query head), summary.md (conditions, global numbers, per-layer table),
    conditions.json and heatmap_<metric>.png. Returns the written paths."""
    import csv
    import json
    import math
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "heads.csv", "md": out / "summary.md", "json": out / "conditions.json"}
    fields = ["layer", "head", "kv_head", *METRICS]
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in diagnosis.rows:
            writer.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in fields})
    cond = diagnosis.conditions
    paths["json"].write_text(json.dumps({"conditions": cond, "summary": diagnosis.summary}, indent=2, default=str))
    metrics = [m for m in METRICS if not all(math.isnan(r[m]) for r in diagnosis.rows)]
    title = f"{cond['model_type']} {cond['config']} ({cond['dtype']})"
    for m in metrics:
        paths[f"png_{m}"] = out / f"heatmap_{m}.png"
        heatmap(diagnosis.rows, m, paths[f"png_{m}"], title)
    s = diagnosis.summary
    lines = [f"# Diagnostics: {title}", ""]
    if cond.get("command"):
        lines += [f"Command: `{cond['command']}`", ""]
    lines += [f"{cond['tokens']} tokens: {cond['prompt_tokens']} at prefill, the rest teacher-forced in chunks of "
             f"{cond['chunk']}; torch {cond['torch']}, transformers {cond['transformers']}, "
             f"{cond['threads']} threads.", "",
             f"All layers compressed: next-token KL mean {s['mean_kl']:.4g} (max {s['max_kl']:.4g}), "
             f"top-1 agreement {s['top1_agreement']:.3f} over {s['positions']} positions.", "",
             "| layer | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for r in layer_means(diagnosis.rows):
        lines.append(f"| {r['layer']} | " + " | ".join(f"{r[m]:.4g}" for m in metrics) + " |")
    lines.append("| mean | " + " | ".join(
        f"{sum(r[m] for r in diagnosis.rows) / len(diagnosis.rows):.4g}" for m in metrics) + " |")
    lines += ["", "Metrics:"] + [f"- `{m}`: {METRIC_DOC[m]}" for m in metrics]
    lines += ["", "Per head: heads.csv; heatmaps: " + ", ".join(f"heatmap_{m}.png" for m in metrics), ""]
    paths["md"].write_text("\n".join(lines))
    return paths


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def _parse_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def default_data_dir():
    from pathlib import Path

    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


def gsm8k_text(data_dir, index: int = 0, shots: int = 8) -> str:
    """An 8-shot chain-of-thought GSM8K prompt for test problem `index` followed by its worked answer (read
    from the local data directory at run time)."""
    from .demo import gsm8k_problems
    import json
    from pathlib import Path

    problem = gsm8k_problems(str(data_dir), hub=False, shots=shots)[index]
    root = Path(data_dir)
    root = root / "gsm8k" if (root / "gsm8k").is_dir() else root
    test = [json.loads(l) for l in (root / "test.jsonl").read_text().splitlines() if l.strip()][index]
    reasoning, final = test["answer"].split("####")
    return f"{problem.prompt} {reasoning.strip()} The answer is {final.strip()}.\n\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(prog="python -m gear_hf.diagnostics",
                                     description="Per layer x head compression errors where they are consumed.")
    parser.add_argument("--model", default="smollm2", help="smollm2 | qwen25 | a .gguf file | a HF model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--method", default="gear")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any GearConfig field, e.g. --set key_axis=token --set pre_rope=false")
    parser.add_argument("--text-file", help="the text to measure on (default: an 8-shot GSM8K CoT prompt + answer)")
    parser.add_argument("--data-dir", default=None, help="GSM8K directory (default ../shared/data/gsm8k)")
    parser.add_argument("--index", type=int, default=0, help="GSM8K test problem (default 0)")
    parser.add_argument("--tokens", type=int, default=640,
                        help="the text's last N tokens are used (default 640; for GSM8K the continuation is then "
                             "the test problem's worked answer)")
    parser.add_argument("--continuation", type=int, default=128,
                        help="last tokens teacher-forced after the prefill (default 128)")
    parser.add_argument("--chunk", type=int, default=None, help="continuation step size (default: buffer size; 1 = "
                                                                 "per token, as generation)")
    parser.add_argument("--kl", default="layer", choices=["none", "layer", "head"])
    parser.add_argument("--include-prompt", action="store_true", help="also measure the prompt's queries")
    parser.add_argument("--out", default=None, help="output directory (default results/diagnostics/<model>-<cfg>)")
    args = parser.parse_args(argv)

    from .config import GearConfig as _Config
    from .demo import load_model

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected FIELD=VALUE")
        overrides[key.strip()] = _parse_value(value.strip())
    try:
        config = _Config.preset(args.method, bits=args.bits, **overrides)
    except ValueError as err:
        parser.error(str(err))
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    if args.text_file:
        from pathlib import Path

        text = Path(args.text_file).read_text()
    else:
        text = gsm8k_text(args.data_dir or default_data_dir(), args.index)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, -args.tokens:]  # ends with the text's end
    T = ids.shape[1]
    if not 0 < args.continuation < T:
        parser.error(f"--continuation {args.continuation} must be in [1, {T}) for a text of {T} tokens")
    prompt_len = T - args.continuation
    torch.set_grad_enabled(False)
    started = time.time()
    diagnosis = diagnose(model, ids, config, prompt_len, args.chunk, args.kl, args.include_prompt)
    diagnosis.conditions.update(model=args.model, seconds=round(time.time() - started, 1),
                                command="python -m gear_hf.diagnostics " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:]))
    tag = f"{_model_tag(args.model)}-{config.describe()}" + "".join(f"-{k}={v}" for k, v in overrides.items())
    out = args.out or f"results/diagnostics/{tag}"
    paths = write_report(diagnosis, out)
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def _model_tag(spec: str) -> str:
    from pathlib import Path

    return Path(spec).stem if ("/" in spec or spec.endswith(".gguf")) else spec


if __name__ == "__main__":
    raise SystemExit(main())
