"""Accuracy per byte: every cache configuration as a point (bits/element held, next-token KL), and the Pareto
frontier. Writes <out>/frontier.csv, frontier.md, frontier.png and raw.csv (--out, default out/frontier,
untracked).

    OMP_NUM_THREADS=1 python scripts/frontier.py                        # SmolLM2 + Qwen2.5-0.5B, bf16, T=1024
    python scripts/frontier.py --models smollm2 --tokens 1024 4096 --grid quick
    python scripts/frontier.py --configs kivi-k4v2,kivi-k4v2-rv          # named points only (see --list)
    python scripts/frontier.py --tokens 1028 --configs kivi-3-s4-rkv-gk128,kivi-3-rkv-gk128   # sinks, buffer empty
    python scripts/frontier.py --tokens 1028 --text 1 --out out/frontier-text1 --configs ...  # another text: noise

Names: METHOD-BITS (kBvB: key/value bits), then -sN N sinks, -rv/-rk/-rkv rotation of values/keys/both, -f8 int8
low-rank factors, -vc values per channel over token groups (value_axis="channel"), -gkN key groups of N tokens, -gvN
value groups of N (channels; tokens with -vc), -gpN the prompt chunk's token groups (prompt_group_size), -rPD ranks
prefill/decode, -clipv/-clipk/-clipkv ranges searched (range_search) for values/keys/both.

Bits are held at the end of the text, so a configuration whose last tokens still wait in the full-precision buffer
pays for them there: with 4 sinks, T=1024 leaves 60 (n_b=64) or 124 (n_b=128) tokens buffered; measure sink
configurations at T = 1024 + sinks (and their no-sink twins there) to compare them with an empty buffer.

For each model and length T: the last T tokens of a GSM8K CoT text (8-shot prompt + worked answer; more shots for
longer T), the first T - --continuation at prefill, the rest fed --chunk tokens per step through each cache
(teacher forcing, as generation fills it). Per configuration:

* mean next-token KL(DynamicCache || cache) and top-1 agreement over the continuation positions;
* attention-output error: relative error of every layer's attention output for the last 32 queries, the keys and
  values streamed through the cache with the last 64 tokens one per step (`diagnostics.layer_errors`), mean over
  layers;
* bits per element held after the text: `memory_report()["bits_per_element"]` (the bytes the tokens hold:
  compressed fields of the chunks in use, sink and buffer tokens, positions; no reserved capacity) over
  layers x 2 x KV heads x head_dim x tokens. HF QuantizedCache: every tensor it holds (benchlib.tensor_bytes).

Resumable: every finished point is appended to <out>/raw.csv and skipped on the next run; the reference logits
and captures are recomputed per (model, T). Writes <out>/frontier.csv, frontier.md and frontier.png (KL, log
scale, vs bits/element; frontier marked). Default --out: out/frontier (untracked).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import benchlib
import torch

SHOTS_FOR = {1024: 8, 4096: 40}  # GSM8K exemplars so the text is at least T tokens long


# -- the grid -------------------------------------------------------------------------------------------------

def point(method: str, key_bits: int, value_bits: int, *, sink: int = 0, rotation: str = "none",
          factor_bits: int = 16, key_group: int | None = None, value_group: int | None = None,
          ranks: tuple[int, int] | None = None, range_search: str = "none", value_axis: str = "token",
          prompt_group: int | None = None, allocate: bool = False):
    """(name, GearConfig): the paper's preset of `method` with these changes; the name spells the changes."""
    import gear_hf

    granule = math.lcm(64, key_group or 64, value_group if value_axis == "channel" and value_group else 64)
    config = gear_hf.GearConfig.preset(method, key_bits=key_bits, value_bits=value_bits, sink_tokens=sink,
                                       rotation=rotation, factor_bits=factor_bits, key_group_size=key_group,
                                       value_group_size=value_group, buffer_size=granule, range_search=range_search,
                                       value_axis=value_axis, prompt_group_size=prompt_group,
                                       key_bit_allocation="query" if allocate else "uniform",
                                       **(dict(rank_prefill=ranks[0], rank_decode=ranks[1]) if ranks else {}))
    bits = f"{key_bits}" if key_bits == value_bits else f"k{key_bits}v{value_bits}"
    name = f"{method}-{bits}"
    name += f"-s{sink}" if sink else ""
    name += {"none": "", "values": "-rv", "keys": "-rk", "both": "-rkv"}[rotation]
    name += "-f8" if factor_bits == 8 and config.uses_lowrank else ""
    name += "-vc" if value_axis == "channel" else ""
    name += f"-gk{key_group}" if key_group else ""
    name += f"-gv{value_group}" if value_group else ""
    name += f"-gp{prompt_group}" if prompt_group else ""
    name += f"-r{ranks[0]}{ranks[1]}" if ranks else ""
    name += {"none": "", "values": "-clipv", "keys": "-clipk", "both": "-clipkv"}[range_search]
    name += "-qa" if allocate else ""  # key widths allocated per channel by the queries
    return name, config


def grid(kind: str) -> dict:
    points = [point("kivi", 2, 2), point("kivi", 4, 4), point("gear", 2, 2), point("gear", 4, 4),  # the paper's
              point("gear-l", 2, 2), point("outlier", 2, 2)]
    # bit splits (keys matter more than values) and 3 bits
    points += [point("kivi", 3, 3), point("kivi", 4, 2), point("kivi", 3, 2), point("kivi", 4, 3)]
    # rotation: values, and keys too
    points += [point("kivi", 2, 2, rotation="values"), point("kivi", 2, 2, rotation="both"),
               point("kivi", 4, 2, rotation="values"), point("kivi", 3, 2, rotation="values"),
               point("kivi", 3, 3, rotation="values"), point("kivi", 3, 3, rotation="both"),
               point("kivi", 4, 3, rotation="values"), point("outlier", 2, 2, rotation="values")]
    # attention sinks
    points += [point("kivi", 4, 2, sink=4), point("kivi", 2, 2, sink=4, rotation="values"),
               point("kivi", 3, 2, sink=4, rotation="values")]
    # side information: int8 factors, coarser key groups
    points += [point("gear", 2, 2, factor_bits=8), point("gear-l", 2, 2, factor_bits=8),
               point("gear", 4, 2, factor_bits=8),
               point("kivi", 2, 2, key_group=128, rotation="values"), point("kivi", 3, 2, key_group=128, rotation="values"),
               point("kivi", 3, 3, key_group=128, rotation="values"), point("kivi", 4, 2, key_group=128, rotation="values")]
    # round 2, from the first points: keys rotated too, sinks, coarser key groups together
    points += [point("kivi", 2, 2, sink=4, rotation="both"), point("kivi", 3, 3, rotation="both", key_group=128),
               point("kivi", 2, 2, sink=4, rotation="both", key_group=128),
               point("kivi", 3, 3, sink=4, rotation="both", key_group=128),
               point("kivi", 3, 2, sink=4, rotation="both", key_group=128),
               point("kivi", 4, 3, sink=4, rotation="both", key_group=128),
               point("outlier", 2, 2, sink=4, rotation="both", key_group=128),
               point("gear-l", 2, 2, sink=4, rotation="both", factor_bits=8, key_group=128, ranks=(2, 1)),
               point("kivi", 2, 2, rotation="both", key_group=128), point("kivi", 3, 2, rotation="both", key_group=128),
               point("kivi", 4, 2, rotation="both", key_group=128),
               point("gear-l", 2, 2, rotation="both", factor_bits=8, key_group=128, ranks=(2, 1))]
    # round 3: value ranges searched for the least squared error (range_search), with their min/max twins
    rotated = dict(sink=4, rotation="both", key_group=128)
    points += [point("kivi", 4, 2, **rotated)]
    for key_bits, value_bits in ((2, 2), (3, 2), (3, 3), (4, 2)):
        points += [point("kivi", key_bits, value_bits, range_search="values", **rotated)]
        points += [point("kivi", key_bits, value_bits, sink=4, rotation="values", key_group=128,
                         range_search="values")]  # keys unrotated: Qwen's keys at 3 bits preferred it
    points += [point("kivi", 2, 2, range_search="both", **rotated), point("kivi", 4, 2, range_search="both", **rotated),
               point("gear-l", 2, 2, factor_bits=8, ranks=(2, 1), range_search="values", **rotated),
               point("gear", 2, 2, factor_bits=8, range_search="values")]
    # round 4, at <= 2.75 bits: key groups of 64 tokens, or rank-2/1 int8 factors, with either key rotation
    for rotation in ("both", "values"):
        points += [point("kivi", 2, 2, sink=4, rotation=rotation, range_search="values"),
                   point("gear-l", 2, 2, sink=4, rotation=rotation, factor_bits=8, key_group=128, ranks=(2, 1),
                         range_search="values")]
    # round 5: values per channel over token groups (value_axis="channel", the keys' layout) with groups of 256
    # tokens for both: 1/8 bit of statistics per element instead of 1/4 (keys, groups of 128) and 1/2 (values,
    # groups of one 64-channel head)
    long_groups = dict(sink=4, key_group=256, value_group=256, value_axis="channel")
    for key_bits, value_bits in ((2, 2), (3, 2), (4, 2), (3, 3), (4, 3)):
        points += [point("kivi", key_bits, value_bits, rotation="both", range_search="values", **long_groups)]
    points += [point("kivi", 2, 2, rotation="values", range_search="values", **long_groups),
               point("kivi", 3, 2, rotation="values", range_search="values", **long_groups),
               point("kivi", 4, 2, rotation="both", **long_groups), point("kivi", 3, 2, rotation="both", **long_groups),
               point("kivi", 3, 2, rotation="both", sink=4, key_group=128, value_group=128, value_axis="channel",
                     range_search="values"),
               point("kivi", 4, 2, rotation="both", sink=4, key_group=128, value_group=128, value_axis="channel",
                     range_search="values")]
    # round 6: the same with the prompt chunk alone in 256-token groups (prompt_group_size): a 128-token buffer
    short_buffer = dict(sink=4, key_group=128, value_group=128, value_axis="channel", prompt_group=256)
    for key_bits, value_bits in ((2, 2), (3, 2), (4, 2), (4, 3)):
        points += [point("kivi", key_bits, value_bits, rotation="both", range_search="values", **short_buffer)]
    # round 7: key widths allocated per channel from the queries (key_bit_allocation="query"; keys unrotated, as
    # the allocation needs), with the round-6 layout; their uniform twins with keys unrotated
    for key_bits, value_bits in ((2.5, 2), (3, 2), (3, 3), (3.5, 3)):
        points += [point("kivi", key_bits, value_bits, rotation="values", range_search="values", allocate=True,
                         **short_buffer)]
    for key_bits, value_bits in ((3, 2), (3, 3), (4, 3)):
        points += [point("kivi", key_bits, value_bits, rotation="values", range_search="values", **short_buffer)]
    # round 8: the same without the value range search (compress-time cost: see docs/results.md), values per token or
    # per channel
    for key_bits, value_bits in ((3.5, 3), (3.5, 2), (3.125, 3)):
        points += [point("kivi", key_bits, value_bits, rotation="values", allocate=True, sink=4, key_group=128,
                         prompt_group=256)]
    points += [point("kivi", 3.5, 3, rotation="values", allocate=True, **short_buffer)]
    if kind == "quick":
        keep = {"kivi-2", "kivi-4", "gear-2", "gear-4", "kivi-k4v2", "kivi-k4v2-rv", "kivi-k3v2-rv", "kivi-3-rv",
                "kivi-2-rv", "kivi-2-rv-gk128", "kivi-k3v2-rv-gk128", "gear-2-f8"}
        points = [p for p in points if p[0] in keep]
    return dict(points)


HF_BASELINES = ("hf-quanto-int2", "hf-quanto-int4", "hf-hqq-int2", "hf-hqq-int4")


# -- measurement --------------------------------------------------------------------------------------------------

def _elements(text_cfg, tokens: int) -> int:
    kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    return text_cfg.num_hidden_layers * 2 * kv_heads * head_dim * tokens


def _done(path: Path) -> set:
    if not path.exists():
        return set()
    with open(path) as f:
        return {(r["model"], int(r["tokens"]), r["config"]) for r in csv.DictReader(f)}


def _append(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            for k in ("mean_kl", "top1", "attn_out_error", "bits_per_element", "allocated_bits_per_element"):
                r[k] = float(r[k]) if r.get(k) not in (None, "") else float("nan")
            r["tokens"] = int(r["tokens"])
            rows.append(r)
    return rows


def measure_model(model_name: str, dtype: str, tokens_list, configs: dict, baselines, args, out: Path) -> None:
    import gear_hf
    from gear_hf import diagnostics as D
    from gear_hf.cache.gear_cache import _text_config
    from gear_hf.gsm8k import solved_text

    raw = out / "raw.csv"
    done = _done(raw)
    todo = {T: [n for n in [*configs, *baselines] if (model_name, T, n) not in done] for T in tokens_list}
    if not any(todo.values()):
        return
    model, tokenizer = benchlib.load_model(model_name, dtype)
    text_cfg = _text_config(model)
    for T in tokens_list:
        if not todo[T]:
            continue
        text = solved_text(benchlib.data_dir(), args.text, shots=SHOTS_FOR.get(T, max(8, T // 100)))
        ids = tokenizer(text, return_tensors="pt").input_ids[:, -T:]
        if ids.shape[1] < T:
            raise SystemExit(f"the text has only {ids.shape[1]} tokens < T={T}: raise SHOTS_FOR[{T}]")
        prompt = T - args.continuation
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        started = time.perf_counter()
        reference = D.stock_logits(model, ids, prompt, args.chunk)
        captures = D.capture_qkv(model, ids)
        print(f"{model_name} T={T}: reference + captures in {time.perf_counter() - started:.0f}s", flush=True)
        for name in todo[T]:
            started = time.perf_counter()
            if name in baselines:
                if gear_hf.is_enabled(model):
                    gear_hf.disable(model)
                cache = benchlib.make_hf_quantized_cache(model, name)
                config = None
            else:
                config = configs[name].replace(backend="torch")
                gear_hf.enable(model, config)
                cache = gear_hf.GearCache(model, config)
            logits = D.streamed_logits(model, ids, prompt, args.chunk, cache)
            if gear_hf.is_enabled(model):
                gear_hf.disable(model)
            kl = D.kl_divergence(reference, logits)
            elements = _elements(text_cfg, T)
            if config is None:
                bits = benchlib.tensor_bytes(cache) * 8 / elements
                allocated_bits = bits
                attn = float("nan")  # HF's cache stores post-RoPE keys and is not driven by layer_errors
            else:
                report = cache.memory_report()
                bits = report["bits_per_element"]
                allocated_bits = report["owned_bytes"] * 8 / report["elements"]
                errors = D.layer_errors(captures, config, decode_tokens=64, last_queries=32)
                attn = sum(r["attention_output_error"] for r in errors) / len(errors)
            row = {"model": model_name, "tokens": T, "config": name, "dtype": dtype, "mean_kl": kl.mean().item(),
                   "top1": (reference.argmax(-1) == logits.argmax(-1)).float().mean().item(),
                   "attn_out_error": attn, "bits_per_element": bits, "allocated_bits_per_element": allocated_bits,
                   "positions": kl.shape[0], "seconds": round(time.perf_counter() - started, 1)}
            _append(raw, row)
            print(f"{model_name} T={T} {name:24s} KL {row['mean_kl']:.4f} top-1 {row['top1']:.3f} attn {attn:.4f} "
                  f"{bits:.2f} bits/elem held ({allocated_bits:.2f} allocated) {row['seconds']:.0f}s", flush=True)
        del captures, reference
    del model


# -- frontier, table, plot ----------------------------------------------------------------------------------------

def pareto(rows: list[dict]) -> set:
    """Configs no other config beats: none with fewer-or-equal bits and lower-or-equal KL (one strictly)."""
    front = set()
    for r in rows:
        dominated = any(o is not r and o["bits_per_element"] <= r["bits_per_element"] and o["mean_kl"] <= r["mean_kl"]
                        and (o["bits_per_element"] < r["bits_per_element"] or o["mean_kl"] < r["mean_kl"])
                        for o in rows)
        if not dominated:
            front.add(r["config"])
    return front


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["tokens"]) for r in rows})
    cols = min(2, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(7 * cols, 5 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (model, T) in zip(axes.flat, panels):
        mine = [r for r in rows if r["model"] == model and r["tokens"] == T and r["mean_kl"] > 0]
        front = pareto([r for r in mine if not r["config"].startswith("hf-")])
        for r in mine:
            hf = r["config"].startswith("hf-")
            on = r["config"] in front
            ax.scatter(r["bits_per_element"], r["mean_kl"], marker="s" if hf else "o",
                       color="tab:red" if hf else ("tab:blue" if on else "tab:gray"), s=36 if on or hf else 16)
            if on or hf:
                ax.annotate(r["config"], (r["bits_per_element"], r["mean_kl"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        line = sorted((r for r in mine if r["config"] in front), key=lambda r: r["bits_per_element"])
        ax.plot([r["bits_per_element"] for r in line], [r["mean_kl"] for r in line], color="tab:blue", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("KV bits per element held")
        ax.set_ylabel("mean next-token KL vs DynamicCache")
        ax.set_title(f"{model}, T={T} (blue: gear_hf frontier, red: HF QuantizedCache)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HF_RESIDUAL = 128  # tokens HF QuantizedCache keeps unquantized at most (benchlib.make_hf_quantized_cache)
_DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32}


def half_full_bits(row: dict, configs: dict) -> float:
    """Bits per element held with the full-precision buffer half full: the points are measured where it has just
    been emptied (T = 1024 + 4 sinks, 4096 + 4), but generation stops anywhere, so on average n_b/2 of the T tokens
    sit in the buffer in the model dtype instead of compressed: + (n_b/2) * (dtype bits - bits) / T. NaN for a
    name no longer in the grid."""
    if row["config"].startswith("hf-"):
        buffer = HF_RESIDUAL
    elif row["config"] in configs:
        buffer = configs[row["config"]].buffer_size
    else:
        return float("nan")
    bits = row["bits_per_element"]
    return bits + buffer / 2 * (_DTYPE_BITS[row["dtype"]] - bits) / row["tokens"]


def summarize(out: Path, cond, args) -> str:
    rows = _read(out / "raw.csv")
    if not rows:
        return "no results"
    configs = grid("full")
    for r in rows:
        r["half_full_bits"] = half_full_bits(r, configs)
    lines = []
    for model, T in sorted({(r["model"], r["tokens"]) for r in rows}):
        mine = sorted((r for r in rows if r["model"] == model and r["tokens"] == T),
                      key=lambda r: r["bits_per_element"])
        front = pareto([r for r in mine if not r["config"].startswith("hf-")])
        for r in mine:
            r["frontier"] = "yes" if r["config"] in front else ""
        lines.append(f"### {model}, T={T}, {mine[0]['dtype']}\n")
        lines.append(benchlib.markdown_table(mine, [
            ("config", "config", "{}"), ("bits_per_element", "bits/elem held", "{:.2f}"),
            ("half_full_bits", "bits, buffer half full", "{:.2f}"), ("mean_kl", "mean KL", "{:.4f}"),
            ("top1", "top-1", "{:.3f}"),
            ("attn_out_error", "attn-out err", "{:.4f}"), ("allocated_bits_per_element", "allocated bits", "{:.2f}"),
            ("frontier", "frontier", "{}")]))
        lines.append("")
    benchlib.write_csv(out / "frontier.csv", rows)
    plot(rows, out / "frontier.png")
    body = (f"Teacher-forced next-token KL over the last {args.continuation} tokens of a GSM8K CoT text (fed "
            f"{args.chunk} per step), top-1 agreement, mean attention-output error over layers (last 32 queries, "
            "last 64 tokens streamed one per step); bits/element held from memory_report() (tokens' bytes "
            "only: no reserved capacity; 'allocated' adds it) at T, where every full-precision buffer has just been "
            "emptied; 'buffer half full': + (n_b/2)(dtype bits - bits)/T, the average over where generation stops "
            "(n_b: buffer_size, HF residual_length), HF QuantizedCache by all its tensors (quanto/HQQ, per-token axes, "
            "post-RoPE, q_group_size=64, residual_length=128). Frontier: gear_hf points no other gear_hf point "
            "beats on both bits and KL.\n\n" + "\n".join(lines))
    benchlib.write_summary(out / "frontier.md", "Accuracy per byte: the measured frontier", cond, body)
    return body


def texts_table(dirs: list[Path]) -> str:
    """One markdown row per (config, model) measured in the first run dir: bits and KL in each run (e.g. one run per
    --text), for reading the noise between texts. The runs must share --tokens."""
    runs = [{(r["model"], r["config"]): r for r in _read(d / "raw.csv")} for d in dirs]
    lines = ["| config | model | bits/elem held | " + " | ".join(f"KL ({d.name})" for d in dirs) + " |",
             "|---|---|--:|" + "--:|" * len(dirs)]
    for model, config in sorted(runs[0], key=lambda k: (k[0], runs[0][k]["bits_per_element"], k[1])):
        kls = [f"{run[(model, config)]['mean_kl']:.4f}" if (model, config) in run else "-" for run in runs]
        lines.append(f"| {config} | {model} | {runs[0][(model, config)]['bits_per_element']:.2f} | "
                     + " | ".join(kls) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen25"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024])
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1, help="continuation tokens per step (default 1)")
    parser.add_argument("--text", type=int, default=0, help="GSM8K test problem index")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--grid", default="full", choices=["full", "quick"])
    parser.add_argument("--configs", default=None, help="comma list of grid names (see --list) and HF baselines")
    parser.add_argument("--list", action="store_true", help="print the grid's names and exit")
    parser.add_argument("--summarize", action="store_true", help="only rebuild the table and plot from raw.csv")
    parser.add_argument("--out", default=str(benchlib.REPO / "out" / "frontier"))
    parser.add_argument("--texts", nargs="+", default=None, metavar="DIR",
                        help="print a table of KL per run dir (e.g. one per --text) and exit")
    args = parser.parse_args(argv)
    if args.texts:
        print(texts_table([Path(d) for d in args.texts]))
        return 0
    configs = grid("full")
    if args.list:
        print("\n".join([*configs, *HF_BASELINES]))
        return 0
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in configs and n not in HF_BASELINES]
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown}; see --list")
    else:
        names = [*grid(args.grid), *HF_BASELINES]
    selected = {n: configs[n] for n in names if n in configs}
    baselines = []
    for name in (n for n in names if n in HF_BASELINES):
        if benchlib.hf_backend_available(name.split("-")[1]):
            baselines.append(name)
        else:
            print(f"skipping {name}: its backend is not installed (pip install -e '.[baselines]')", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cond = benchlib.Conditions(extra={"dtype": args.dtype, "tokens": args.tokens, "continuation": args.continuation,
                                      "chunk": args.chunk, "text": args.text})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    if not args.summarize:
        for model_name in args.models:
            measure_model(model_name, args.dtype, args.tokens, selected, baselines, args, out)
    cond.finish()
    print(summarize(out, cond, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
