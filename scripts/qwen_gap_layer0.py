"""Next-token KL of a bench_tail config with chosen layers handed exact keys/values (gear_hf.diagnostics
SelectiveGearCache, torch path, one token per step after the prompt): does one layer carry the KL? (session 22)

    python qwen_gap_layer0.py --model qwen25 --text 1 --config steady --exact 0 --out ../results/tail/qwen-gap/layers
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
    parser.add_argument("--config", default="steady")
    parser.add_argument("--exact", default="0", help="';'-separated sets of comma-separated layers given exact K/V")
    parser.add_argument("--out", default="../results/tail/qwen-gap/layers")
    args = parser.parse_args(argv)
    from gear_hf import diagnostics as D

    torch.set_grad_enabled(False)
    model, tokenizer = benchlib.load_model(args.model, "bfloat16")
    ids = tokenizer(benchlib.gsm8k_text(args.text), return_tensors="pt").input_ids[:, -(args.prompt + args.steps):]
    layers = model.config.num_hidden_layers
    reference = D.stock_logits(model, ids, args.prompt, 1)
    rows = []
    for exact in args.exact.split(";"):
        skip = {int(x) for x in exact.split(",") if x}
        select = {i: None for i in range(layers) if i not in skip}
        result = D.next_token_kl(model, ids, args.prompt, bench_tail.config_of(args.config), 1, select, reference)
        rows.append({"config": args.config, "text": args.text, "exact_layers": exact or "none", **result})
        print(rows[-1], flush=True)
        benchlib.write_csv(benchlib.Path(args.out) / f"{args.model}-t{args.text}-{args.config}-exact-layers.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
