"""Issue 25 item 5: what a GearCache owns against what transformers' dense cache owns, at every generate step.

For each case (config, tiny model, dtype, batch, prompt length) the same generate runs twice: with the GearCache
(its `memory_report()["owned_bytes"]` after each step) and with transformers' DynamicCache (every storage its layers
keep alive after each step: a sliding layer's window view keeps its whole torch.cat result, as in transformers).
Prints the worst owned/dense ratio over the steps and the step where it happens.

    OMP_NUM_THREADS=1 python scripts/bench_above_dense.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from dense_reference import run_case  # noqa: E402

import gear_hf  # noqa: E402

CONFIGS = {
    "GearConfig()": lambda: gear_hf.GearConfig(),
    "gear-2": lambda: gear_hf.GearConfig.preset("gear", bits=2),
    "kivi-2": lambda: gear_hf.GearConfig.preset("kivi", bits=2),
    "kivi-4": lambda: gear_hf.GearConfig.preset("kivi", bits=4),
    "gear-l-2": lambda: gear_hf.GearConfig.preset("gear-l", bits=2),
    "fp16": lambda: gear_hf.GearConfig.preset("fp16"),
    "int8 tails": lambda: gear_hf.GearConfig(key_buffer="int8", value_buffer="int8"),
    "n_b 64, sink 0": lambda: gear_hf.GearConfig(buffer_size=64, sink_tokens=0),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new", type=int, default=300)
    args = parser.parse_args()
    cases = []
    for name in CONFIGS:
        for prompt in (1, 2, 5, 17, 127):
            cases.append((name, dict(prompt=prompt)))
    for name in ("GearConfig()", "kivi-2", "n_b 64, sink 0"):
        for window in (8, 16, 32, 40):
            cases.append((name, dict(arch="mistral", window=window, prompt=17)))
        cases.append((name, dict(batch=2, prompt=5)))
        cases.append((name, dict(dtype=torch.float32, prompt=5)))
    if args.quick:
        cases = cases[::5]
    print("| config | case | worst owned/dense (step) | owned/dense at the last step |")
    print("|---|---|--:|--:|")
    for name, case in cases:
        rows, _, _ = run_case(CONFIGS[name](), new=args.new, **case)
        ratios = [(g / d, i) for i, g, d, _ in rows]
        worst = max(ratios)
        label = ", ".join(f"{k}={v if not isinstance(v, torch.dtype) else str(v)[6:]}" for k, v in case.items())
        print(f"| {name} | {label} | {worst[0]:.3f} ({worst[1]}) | {ratios[-1][0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
