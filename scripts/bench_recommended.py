"""What each recommendation gives: bits owned at T = 512, 1k and 4k, and next-token fidelity against the uncompressed
model, beside the paper's KIVI presets.

For each configuration: the budget `GearConfig.recommended(bits_per_element=)` reads (the mean bits/element owned over
the 128 decode steps after a 512-, 1024- or 4096-token prompt, bf16, head_dim 64 and 128: the largest), and on real
weights, teacher-forced over GSM8K test texts (an 8-shot prompt and its worked answer; the last --prompt + --steps
tokens): the mean next-token KL(uncompressed || compressed) and the top-1 agreement over the --steps decode steps.
Writes <out>/recommended.csv and prints a markdown table. ~30 s per configuration and text on 2 CPU cores (SmolLM2).

    GEAR_HF_DATA_DIR=../shared/data OMP_NUM_THREADS=1 python scripts/bench_recommended.py --texts 400 401
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from bench_tail import run  # noqa: E402

CONFIGS = ("smallest", "balanced", "precise", "kivi-2", "kivi-4")


def config_of(name: str):
    import gear_hf

    recommended = [n for n, _, _, _ in gear_hf.config.RECOMMENDED]
    return gear_hf.GearConfig.recommended(name) if name in recommended else gear_hf.GearConfig.preset(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, qwen25, a .gguf file or a HF directory")
    parser.add_argument("--texts", type=int, nargs="+", default=[400, 401], help="GSM8K test problem indices")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens before the teacher-forced steps")
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list (default {','.join(CONFIGS)})")
    parser.add_argument("--out", default="out", help="folder for recommended.csv (default out/, untracked)")
    args = parser.parse_args(argv)
    from transformers import DynamicCache

    import gear_hf
    from gear_hf import diagnostics
    from gear_hf.measure import owned_bits_budget

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    configs = {name: config_of(name) for name in names}
    budgets = {name: owned_bits_budget(config)["budget"] for name, config in configs.items()}
    model, tokenizer = benchlib.load_model(args.model)
    rows = []
    with torch.no_grad():
        for text in args.texts:
            ids = tokenizer(benchlib.gsm8k_text(text), return_tensors="pt").input_ids[:, -(args.prompt + args.steps):]
            reference = run(model, ids, args.prompt, DynamicCache(config=model.config))[0]
            for name, config in configs.items():
                gear_hf.enable(model, config)
                try:
                    logits, bits = run(model, ids, args.prompt, gear_hf.GearCache(model, config))
                finally:
                    if gear_hf.is_enabled(model):
                        gear_hf.disable(model)
                kl = diagnostics.kl_divergence(reference, logits)
                rows.append({"model": args.model, "text": text, "config": name, "budget_bits": round(budgets[name], 3),
                             "mean_owned": round(sum(bits) / len(bits), 3), "mean_kl": round(kl.mean().item(), 5),
                             "top1": round((reference.argmax(-1) == logits.argmax(-1)).float().mean().item(), 3)})
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "recommended.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{args.model}, prompt {args.prompt} + {args.steps} teacher-forced steps, texts {args.texts}\n")
    print("| configuration | bits owned (budget) | mean KL | top-1 agreement |\n|---|--:|--:|--:|")
    for name in names:
        mine = [r for r in rows if r["config"] == name]
        print(f"| {name} | {budgets[name]:.2f} | {sum(r['mean_kl'] for r in mine) / len(mine):.4f} | "
              f"{sum(r['top1'] for r in mine) / len(mine):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
