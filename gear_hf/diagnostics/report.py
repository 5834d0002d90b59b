"""`diagnose` runs every metric on one text; `write_report` writes a CSV, a Markdown summary and one layer x head
heatmap PNG per metric."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import GearConfig
from .capture import capture_qkv
from .errors import head_errors
from .kl import kl_map, next_token_kl, stock_logits

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
