"""Per-layer attention errors of bench_tail configs on one text (session 22, results/tail/qwen-gap/layers/).

Captures every layer's q/k/v of the text's last --prompt + --steps tokens (stock forward), streams them through a
GearCache (torch path) one token per step after the prompt, as bench_tail feeds the real model, and writes per layer
(mean over query heads) the relative error of scores, attention probabilities (total variation) and attention output
of the --steps decode queries against what the cache returned at that step (gear_hf.diagnostics.head_errors).

    python qwen_gap_layers.py --model qwen25 --text 1 --configs steady,kivi-4 --out ../results/tail/qwen-gap/layers
"""

from __future__ import annotations

import argparse
import sys

import bench_tail
import benchlib
import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen25")
    parser.add_argument("--text", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--configs", default="steady,kivi-4")
    parser.add_argument("--out", default="../results/tail/qwen-gap/layers")
    args = parser.parse_args(argv)
    from gear_hf import diagnostics as D

    torch.set_grad_enabled(False)
    model, tokenizer = benchlib.load_model(args.model, "bfloat16")
    ids = tokenizer(benchlib.gsm8k_text(args.text), return_tensors="pt").input_ids[:, -(args.prompt + args.steps):]
    captures = D.capture_qkv(model, ids)
    rows = []
    for name in args.configs.split(","):
        per_head = D.head_errors(captures, bench_tail.config_of(name), args.prompt, chunk=1)
        for layer in range(len(captures)):
            mine = [r for r in per_head if r["layer"] == layer]
            row = {"config": name, "layer": layer}
            for metric in ("key_error", "value_error", "score_error", "prob_error", "output_error"):
                row[metric] = sum(r[metric] for r in mine) / len(mine)
            rows.append(row)
            print(row, flush=True)
    out = benchlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_csv(out / f"{args.model}-t{args.text}-layers.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
