#!/usr/bin/env python
"""Sweep GEAR presets x bits x tasks on one model with lm-eval, and report.

    python scripts/sweep.py --model qwen25 --dtype bfloat16 --presets fp16,kivi,gear --bits 2 \
        --tasks gsm8k_cot_gear --limit 50 --batch_size 4 --data_dir ../shared/data --out results/sweep-qwen25

The model is loaded once (lm-eval's `hf` loader through the `gear_hf` model) and re-patched for every cell
(`fp16` runs once, whatever --bits says). Each finished cell x task is written to
`<out>/cells/<cell>/<task>.json` (+ `.samples.jsonl`) and never rerun: interrupt and restart with the same
command to resume (a cell whose recorded settings differ from the current ones is rerun). After every cell the
report is rewritten:

* `results.csv` / `results.json`: one row per cell x task (and per BBH subtask): accuracy (strict and flexible
  extraction, with stderr), KV bits/element (the caches' `memory_report`, over all generate calls),
  generated tokens/s, agreement with the fp16 run, wall time;
* `results.md`: the conditions (model, dtype, n, git commit, versions, machine) and the table;
* `accuracy_vs_kv.png`: accuracy against KV cache size (% of an fp16 cache), like the GEAR paper's figure.

Agreement with fp16 is computed from the logged samples of the same task: the fraction of documents whose
extracted answer (flexible-extract) equals the fp16 run's, the fraction of identical generations, and the
mean matched prefix (common prefix length / longer generation, in characters). With small models, accuracy
is noisy; agreement with the uncompressed model is the sharper fidelity measure.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FILTERS = ("strict-match", "flexible-extract")
AGREEMENT_FILTER = "flexible-extract"


# Grid ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    method: str
    bits: int | None
    config: Any  # GearConfig


def make_cells(presets: list[str], bits: list[int], overrides: dict[str, Any]) -> list[Cell]:
    from gear_hf.lm_eval.args import parse_gear_args

    cells: list[Cell] = []
    for preset in presets:
        for b in ([None] if preset == "fp16" else bits):
            config = parse_gear_args({"preset": preset, **({"bits": b} if b is not None else {}), **overrides})
            name = config.describe()
            if name not in {c.name for c in cells}:
                cells.append(Cell(name, preset, b, config))
    cells.sort(key=lambda c: c.method != "fp16")  # the fp16 baseline first
    return cells


def parse_kv(text: str | None) -> dict[str, Any]:
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(text) if text else {}


# Conditions ----------------------------------------------------------------------------------------------------
@functools.cache  # read once, at start-up: the code this process imported, even if HEAD moves during the sweep
def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def conditions(args, model_label: str, model_args: dict) -> dict[str, Any]:
    import lm_eval
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return {
        "model": model_label,
        "model_args": {k: str(v) for k, v in model_args.items()},
        "dtype": args.dtype,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "num_fewshot": args.num_fewshot,
        "gen_kwargs": args.gen_kwargs,
        "gear_overrides": args.gear_args,
        "git_commit": git_commit(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "lm_eval": getattr(lm_eval, "__version__", "?")},
        "device": device,
    }


# Running one cell x task ---------------------------------------------------------------------------------------
def signature(args, model_args: dict, cell: Cell, task: str) -> dict[str, Any]:
    return {"model_args": {k: str(v) for k, v in sorted(model_args.items())}, "task": task, "limit": args.limit,
            "num_fewshot": args.num_fewshot, "gen_kwargs": args.gen_kwargs, "batch_size": args.batch_size,
            "gear_config": dataclasses.asdict(cell.config)}


def cell_paths(out: Path, cell: Cell, task: str) -> tuple[Path, Path]:
    d = out / "cells" / cell.name
    return d / f"{task}.json", d / f"{task}.samples.jsonl"


def is_done(out: Path, cell: Cell, task: str, sig: dict) -> bool:
    record_path, samples_path = cell_paths(out, cell, task)
    if not (record_path.is_file() and samples_path.is_file()):
        return False
    try:
        # compared as JSON reads it back (tuples in the config, e.g. extra_terms, come back as lists)
        return json.loads(record_path.read_text()).get("signature") == json.loads(json.dumps(sig))
    except json.JSONDecodeError:
        return False


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_cell(lm, task_manager, args, cell: Cell, task: str, sig: dict, out: Path) -> dict:
    from lm_eval import simple_evaluate

    lm.set_gear_config(cell.config)  # also resets lm.gear_stats
    start = time.perf_counter()
    res = simple_evaluate(model=lm, tasks=[task], limit=args.limit, num_fewshot=args.num_fewshot,
                          gen_kwargs=args.gen_kwargs or None, log_samples=True, task_manager=task_manager,
                          bootstrap_iters=args.bootstrap_iters)
    wall = time.perf_counter() - start
    metrics: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, row in res["results"].items():
        per_filter = {}
        for filt in FILTERS:
            if f"exact_match,{filt}" in row:
                stderr = row.get(f"exact_match_stderr,{filt}")
                per_filter[filt] = {"acc": row[f"exact_match,{filt}"],
                                    "stderr": stderr if isinstance(stderr, (int, float)) else None}
        metrics[name] = per_filter
    n = {name: v["effective"] for name, v in res.get("n-samples", {}).items()}
    samples = []
    for sub, rows in res["samples"].items():
        for s in rows:
            fr = s["filtered_resps"]
            samples.append({"task": sub, "doc_id": s["doc_id"], "filter": s["filter"], "resp": s["resps"][0][0],
                            "answer": fr[0] if isinstance(fr, list) else fr, "target": s["target"],
                            "correct": s.get("exact_match")})
    stats = lm.gear_stats
    record = {
        "cell": cell.name, "method": cell.method, "bits": cell.bits, "task": task,
        "gear_config": dataclasses.asdict(cell.config), "metrics": metrics, "n": n,
        "n_total": sum(v for k, v in n.items()) if task not in n else n[task],
        "kv_bits_per_element": stats.kv_bits_per_element, "tokens_per_second": stats.tokens_per_second,
        "new_tokens": stats.new_tokens, "generate_seconds": stats.seconds, "wall_seconds": wall,
        "warmup_seconds": stats.warmup_seconds,  # the untimed warm-up generate (kernel compilation), not in tokens/s
        "finished": _dt.datetime.now().isoformat(timespec="seconds"), "git_commit": git_commit(), "signature": sig,
    }
    record_path, samples_path = cell_paths(out, cell, task)
    _write_atomic(samples_path, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    _write_atomic(record_path, json.dumps(record, indent=2))  # written last: marks the cell as done
    return record


# Report --------------------------------------------------------------------------------------------------------
def load_samples(path: Path) -> dict[tuple, dict]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            s = json.loads(line)
            out[(s["task"], s["doc_id"], s["filter"])] = s
    return out


def agreement(base: dict[tuple, dict], other: dict[tuple, dict], tasks: set[str] | None = None) -> dict:
    keys = [k for k in base if k in other and k[2] == AGREEMENT_FILTER and (tasks is None or k[0] in tasks)]
    if not keys:
        return {"answer_agreement": None, "identical_generations": None, "matched_prefix": None, "docs": 0}
    same_answer = sum(base[k]["answer"] == other[k]["answer"] for k in keys)
    same_text = sum(base[k]["resp"] == other[k]["resp"] for k in keys)
    prefix = 0.0
    for k in keys:
        a, b = base[k]["resp"], other[k]["resp"]
        longest = max(len(a), len(b))
        common = len(os.path.commonprefix([a, b]))
        prefix += common / longest if longest else 1.0
    n = len(keys)
    return {"answer_agreement": same_answer / n, "identical_generations": same_text / n,
            "matched_prefix": prefix / n, "docs": n}


def collect_rows(out: Path, cells: list[Cell], tasks: list[str]) -> list[dict]:
    rows = []
    fp16 = next((c for c in cells if c.method == "fp16"), None)
    for task in tasks:
        base = load_samples(cell_paths(out, fp16, task)[1]) if fp16 is not None else {}
        for cell in cells:
            record_path, samples_path = cell_paths(out, cell, task)
            if not record_path.is_file():
                continue
            record = json.loads(record_path.read_text())
            samples = load_samples(samples_path)
            for name, per_filter in record["metrics"].items():
                if not per_filter:
                    continue
                subtasks = {k[0] for k in samples} if name == task else {name}
                agree = agreement(base, samples, subtasks) if base and cell.method != "fp16" else {}
                bits = record["kv_bits_per_element"]
                rows.append({
                    "cell": cell.name, "method": cell.method, "bits": cell.bits, "task": name,
                    "is_subtask": name != task,
                    "n": record["n"].get(name, record["n_total"]) if name != task else record["n_total"],
                    "acc_strict": per_filter.get("strict-match", {}).get("acc"),
                    "stderr_strict": per_filter.get("strict-match", {}).get("stderr"),
                    "acc_flexible": per_filter.get("flexible-extract", {}).get("acc"),
                    "stderr_flexible": per_filter.get("flexible-extract", {}).get("stderr"),
                    "kv_bits_per_element": bits,
                    "kv_size_pct_of_fp16": 100.0 * bits / 16.0 if bits is not None else None,
                    "tokens_per_second": record["tokens_per_second"],
                    "answer_agreement_with_fp16": agree.get("answer_agreement"),
                    "identical_generations_with_fp16": agree.get("identical_generations"),
                    "matched_prefix_with_fp16": agree.get("matched_prefix"),
                    "wall_seconds": record["wall_seconds"] if name == task else None,
                })
    return rows


def _fmt(value, kind: str = "pct") -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "f1":
        return f"{value:.1f}"
    if kind == "f2":
        return f"{value:.2f}"
    return str(value)


def write_report(out: Path, cells: list[Cell], tasks: list[str], cond: dict, total_wall: float | None) -> list[dict]:
    rows = collect_rows(out, cells, tasks)
    fields = ["cell", "method", "bits", "task", "is_subtask", "n", "acc_strict", "stderr_strict", "acc_flexible",
              "stderr_flexible", "kv_bits_per_element", "kv_size_pct_of_fp16", "tokens_per_second",
              "answer_agreement_with_fp16", "identical_generations_with_fp16", "matched_prefix_with_fp16",
              "wall_seconds"]
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    _write_atomic(out / "results.json", json.dumps({"conditions": cond, "rows": rows}, indent=2))

    lines = ["# GEAR sweep", "", "Conditions:", ""]
    for key in ("model", "dtype", "limit", "batch_size", "num_fewshot", "gen_kwargs", "gear_overrides",
                "git_commit", "device"):
        lines.append(f"- {key}: `{cond.get(key)}`")
    lines.append(f"- versions: `{cond.get('versions')}`")
    commits = sorted({json.loads(p.read_text()).get("git_commit", "?") for p in (out / "cells").glob("*/*.json")})
    if commits:
        lines.append(f"- commits the cells ran at: `{', '.join(commits)}`")
    if total_wall is not None:
        lines.append(f"- wall time of this invocation: {total_wall / 60:.1f} min")
    lines += ["", "Accuracy is exact match in % (± stderr); agreement columns compare each compressed run with "
              "the fp16 run of the same task, document by document (answer = flexible-extract).", "",
              "| Method | Task | n | Acc strict | Acc flexible | Agree w/ fp16 | Identical gen. | Matched prefix "
              "| KV bits/elem | KV % of 16-bit | Gen. tok/s | Wall s |",
              "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if r["is_subtask"]:
            continue
        acc_s = _fmt(r["acc_strict"]) + (f" ± {_fmt(r['stderr_strict'])}" if r["stderr_strict"] else "")
        acc_f = _fmt(r["acc_flexible"]) + (f" ± {_fmt(r['stderr_flexible'])}" if r["stderr_flexible"] else "")
        lines.append(f"| {r['cell']} | {r['task']} | {r['n']} | {acc_s} | {acc_f} | "
                     f"{_fmt(r['answer_agreement_with_fp16'])} | {_fmt(r['identical_generations_with_fp16'])} | "
                     f"{_fmt(r['matched_prefix_with_fp16'])} | {_fmt(r['kv_bits_per_element'], 'f2')} | "
                     f"{_fmt(r['kv_size_pct_of_fp16'], 'f1')} | {_fmt(r['tokens_per_second'], 'f1')} | "
                     f"{_fmt(r['wall_seconds'], 'f1')} |")
    sub = [r for r in rows if r["is_subtask"]]
    if sub:
        lines += ["", f"Per-subtask rows ({len(sub)}) are in results.csv."]
    _write_atomic(out / "results.md", "\n".join(lines) + "\n")
    plot(out / "accuracy_vs_kv.png", rows, cond)
    return rows


def plot(path: Path, rows: list[dict], cond: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is in the `eval` extra
        return
    main = [r for r in rows if not r["is_subtask"] and r["kv_size_pct_of_fp16"] is not None]
    tasks = sorted({r["task"] for r in main})
    if not tasks:
        return
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 8), squeeze=False)
    markers = {"fp16": "*", "kivi": "o", "kcvt": "v", "outlier": "s", "gear-l": "^", "gear": "D"}
    panels = (("accuracy (%, flexible extract)",
               lambda r: r["acc_flexible"] if r["acc_flexible"] is not None else r["acc_strict"]),
              ("answer agreement with fp16 (%)",
               lambda r: 1.0 if r["method"] == "fp16" else r["answer_agreement_with_fp16"]))
    for row, (ylabel, value) in enumerate(panels):
        for ax, task in zip(axes[row], tasks):
            for r in (r for r in main if r["task"] == task):
                y = value(r)
                if y is None:
                    continue
                ax.scatter(r["kv_size_pct_of_fp16"], 100 * y, marker=markers.get(r["method"], "o"), s=60)
                ax.annotate(r["cell"], (r["kv_size_pct_of_fp16"], 100 * y), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
            ax.set_title(task)
            ax.set_xlabel("KV cache size (% of an fp16 cache, measured)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
    fig.suptitle(f"{cond.get('model')} ({cond.get('dtype')})\nn={cond.get('limit')}, {cond.get('git_commit')}",
                 fontsize=9)  # two lines: a GGUF file name alone can be wider than the figure
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Main ----------------------------------------------------------------------------------------------------------
def resolve_model(args) -> tuple[str, dict[str, Any]]:
    """(label, HFLM model args) from --model NAME|PATH.gguf or --pretrained [--gguf_file]."""
    model_args: dict[str, Any] = {}
    if args.model:
        from gear_hf import weights

        path = weights.gguf_path(args.model)
        label = f"{args.model} ({path.name})"
        if args.snapshot:
            import torch

            weights.load_gguf_model(args.model, dtype=getattr(torch, args.dtype), snapshot=True)
            snaps = sorted((weights.cache_dir() / "snapshots").glob(f"{path.stem}-{args.dtype}-tf*"))
            complete = [s for s in snaps if (s / ".complete").is_file()]
            if not complete:
                raise SystemExit("could not create the converted snapshot; run without --snapshot")
            model_args["pretrained"] = str(complete[-1])
        else:
            model_args.update(pretrained=str(path.parent), gguf_file=path.name)
    elif args.pretrained:
        label = args.pretrained + (f" ({args.gguf_file})" if args.gguf_file else "")
        model_args["pretrained"] = args.pretrained
        if args.gguf_file:
            model_args["gguf_file"] = args.gguf_file
    else:
        raise SystemExit("give --model NAME (smollm2, qwen25, a .gguf path) or --pretrained DIR")
    model_args["dtype"] = args.dtype
    model_args.update(parse_kv(args.model_args))
    return label, model_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="smollm2 | qwen25 | path to a .gguf file (gear_hf.weights)")
    p.add_argument("--pretrained", help="a model directory or hub id (instead of --model)")
    p.add_argument("--gguf_file", help="with --pretrained: the GGUF file inside it")
    p.add_argument("--snapshot", action="store_true", help="with --model: load from a converted snapshot "
                   "(gear_hf.weights snapshot cache; much faster than de-quantizing the GGUF every time)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--model_args", help="more lm-eval hf model args, k=v,k=v (e.g. attn_implementation=eager)")
    p.add_argument("--presets", default="fp16,kivi,gear", help="comma list of GEAR methods")
    p.add_argument("--bits", default="2", help="comma list of bit widths (fp16 runs once)")
    p.add_argument("--gear_args", help="GearConfig overrides for every cell, k=v,k=v (e.g. buffer_size=64)")
    p.add_argument("--tasks", default="gsm8k_cot_gear", help="comma list of tasks or groups")
    p.add_argument("--limit", type=float, default=None, help="documents per task (lm-eval --limit)")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--gen_kwargs", default=None, help="lm-eval gen_kwargs override, e.g. max_gen_toks=128")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--data_dir", default=None, help="local data (else $GEAR_HF_DATA_DIR, else the hub)")
    p.add_argument("--bootstrap_iters", type=int, default=1000)
    p.add_argument("--out", required=True, help="output directory (resumable)")
    p.add_argument("--report_only", action="store_true", help="only rebuild the report from finished cells")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit.is_integer():
        args.limit = int(args.limit)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label, model_args = resolve_model(args)
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    bits = [int(b) for b in args.bits.split(",") if b.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    cells = make_cells(presets, bits, parse_kv(args.gear_args))
    cond = conditions(args, label, model_args)
    cond_path = out / "conditions.json"
    if args.report_only:
        if cond_path.is_file():
            cond = json.loads(cond_path.read_text())
        write_report(out, cells, tasks, cond, None)
        print((out / "results.md").read_text())
        return 0

    todo = [(c, t) for c in cells for t in tasks
            if not is_done(out, c, t, signature(args, model_args, c, t))]
    print(f"sweep: {len(cells)} cells x {len(tasks)} tasks, {len(cells) * len(tasks) - len(todo)} already done, "
          f"{len(todo)} to run -> {out}", flush=True)
    start = time.perf_counter()
    if todo:
        _write_atomic(cond_path, json.dumps(cond, indent=2))
        from lm_eval.tasks import TaskManager
        from tqdm import tqdm

        from gear_hf.lm_eval.cli import task_dir
        from gear_hf.lm_eval.model import GearHFLM

        data_dir = args.data_dir or os.environ.get("GEAR_HF_DATA_DIR")
        task_manager = TaskManager(include_path=str(task_dir()),
                                   metadata={"data_dir": str(Path(data_dir).resolve())} if data_dir else {})
        hf_args = {k: v for k, v in model_args.items()}
        if args.device:
            hf_args["device"] = args.device
        lm = GearHFLM(gear_config=todo[0][0].config, batch_size=args.batch_size, **hf_args)
        bar = tqdm(todo, desc="sweep", unit="cell")
        for cell, task in bar:
            bar.set_postfix_str(f"{cell.name} / {task}")
            record = run_cell(lm, task_manager, args, cell, task, signature(args, model_args, cell, task), out)
            acc = record["metrics"].get(task, {}).get(AGREEMENT_FILTER, {}).get("acc")
            bar.write(f"{cell.name:>10} {task}: acc(flexible)={acc} kv_bits={record['kv_bits_per_element']} "
                      f"tok/s={record['tokens_per_second']} wall={record['wall_seconds']:.0f}s")
            write_report(out, cells, tasks, cond, time.perf_counter() - start)
    _write_atomic(cond_path, json.dumps(cond, indent=2))
    write_report(out, cells, tasks, cond, time.perf_counter() - start if todo else None)
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
