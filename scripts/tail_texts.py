"""Many texts' bench_tail.py results side by side: per configuration, its mean next-token KL over the texts
both it and the baseline were measured on, that mean as a multiple of the baseline's with a paired bootstrap 95%
interval over texts, and on how many texts it is at or below the baseline. Per-text KL moves by up to 2x between
configurations, so only a mean over many texts, with its interval, ranks them. Prints a Markdown table per model;
writes nothing.

    python scripts/tail_texts.py results/tail                       # the current default vs kivi-4
    python scripts/tail_texts.py out/tail-runs --model qwen25 --configs default,kivi-4

Reads every <dir>/**/tail.csv (bench_tail's output, with its tail.conditions.json: model and text) and every
<dir>/**/tail_rows.csv (such rows gathered in one file, each row naming its model and text: results/tail/); a config
measured twice on one text (e.g. on two hosts, whose KL differ) is an error naming both files: pass narrower folders;
a tail.csv without its conditions (a run still going) is skipped, and said so. Prints a Markdown table per model;
nothing is written.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from collections import defaultdict
from pathlib import Path


def collect(roots: list[Path]) -> dict[str, dict[str, dict[int, dict]]]:
    """{model: {config: {text: row}}} from every tail.csv under roots."""
    found: dict[str, dict[str, dict[int, tuple[Path, dict]]]] = defaultdict(lambda: defaultdict(dict))

    def add(path: Path, model: str, text: int, row: dict) -> None:
        old = found[model][row["config"]].get(text)
        if old is not None:
            raise SystemExit(f"{row['config']!r} on {model} text {text} is measured twice: {old[0]} and {path}; pass "
                             "narrower folders")
        found[model][row["config"]][text] = (path, row)

    for root in roots:
        for path in sorted(root.rglob("tail.csv")):
            written = path.with_name("tail.conditions.json")
            if not written.exists():  # (bench_tail writes it when its run ends)
                print(f"skipped {path}: no {written.name} beside it (a run still going?)", file=sys.stderr)
                continue
            conditions = json.loads(written.read_text())
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    add(path, conditions["model"], int(conditions["text"]), row)
        for path in sorted(root.rglob("tail_rows.csv")):
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    add(path, row["model"], int(row["text"]), row)
    return {m: {c: {t: r for t, (_, r) in texts.items()} for c, texts in configs.items()}
            for m, configs in found.items()}


def paired_ratio_interval(kl: list[float], base: list[float], rounds: int = 10000, seed: int = 0):
    """95% interval of mean(kl) / mean(base), resampling the texts (pairs) with replacement."""
    rng = random.Random(seed)
    n, ratios = len(kl), []
    for _ in range(rounds):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(kl[i] for i in picks) / sum(base[i] for i in picks))
    ratios.sort()
    return ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]


def summarize(configs: dict[str, dict[int, dict]], baseline: str, names: list[str] | None) -> list[dict]:
    if baseline not in configs:
        raise SystemExit(f"baseline {baseline!r} not measured; measured: {', '.join(sorted(configs))}")
    base = configs[baseline]
    rows = []
    for name in names or sorted(configs):
        if name not in configs:
            raise SystemExit(f"config {name!r} not measured; measured: {', '.join(sorted(configs))}")
        texts = sorted(set(configs[name]) & set(base))
        if not texts:
            continue
        kl = [float(configs[name][t]["mean_kl"]) for t in texts]
        ref = [float(base[t]["mean_kl"]) for t in texts]
        low, high = paired_ratio_interval(kl, ref)
        rows.append({"config": name, "texts": len(texts),
                     "mean_owned": max(float(configs[name][t]["mean_owned"]) for t in texts),
                     "max_owned": max(float(configs[name][t]["max_owned"]) for t in texts),
                     "mean_kl": sum(kl) / len(kl), "ratio": sum(kl) / sum(ref), "low": low, "high": high,
                     "at_or_below": sum(a <= b for a, b in zip(kl, ref))})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="folders searched for tail.csv")
    parser.add_argument("--baseline", default="kivi-4")
    parser.add_argument("--model", default=None, help="one model (default: every model found)")
    parser.add_argument("--configs", default=None, help="comma list (default: every config found)")
    args = parser.parse_args(argv)
    import benchlib

    names = args.configs.split(",") if args.configs else None
    found = collect(args.roots)
    if args.model is not None and args.model not in found:
        raise SystemExit(f"model {args.model!r} not measured; measured: {', '.join(sorted(found))}")
    for model in [args.model] if args.model else sorted(found):
        rows = summarize(found[model], args.baseline, names)
        print(f"\n{model}: mean KL over the texts each config shares with {args.baseline}; x {args.baseline} with a "
              "paired bootstrap 95% interval over texts; bits owned: the largest mean / max over those texts\n")
        print(benchlib.markdown_table(rows, [
            ("config", "config", "{}"), ("texts", "texts", "{}"), ("mean_owned", "mean owned", "{:.3f}"),
            ("max_owned", "max owned", "{:.3f}"), ("mean_kl", "mean KL", "{:.5f}"),
            ("ratio", f"x {args.baseline}", "{:.2f}"), ("low", "95% low", "{:.2f}"), ("high", "95% high", "{:.2f}"),
            ("at_or_below", f"texts <= {args.baseline}", "{}")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
