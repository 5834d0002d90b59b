"""What a GearCache owns against what transformers' dense cache owns, at every generate step (a developer report).

The cases of tests/test_never_above_dense.py (configs x prompts x windows x batch/dtype; tiny random models, head_dim
32, bf16 unless said), each generated twice (tests/dense_reference.py): with the GearCache plain generate builds (its
`memory_report()["owned_bytes"]` after each step) and with transformers' DynamicCache (every storage its layers keep
after each step). Prints a Markdown table (the worst owned/dense ratio over the steps, its step, and the ratio at the
last step); writes nothing.

    OMP_NUM_THREADS=1 python scripts/dev/above_dense.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from dense_reference import run_case  # noqa: E402
from test_never_above_dense import CASES, CONFIGS, WINDOWS  # noqa: E402


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Prints a Markdown table; writes nothing."
                            ).parse_args(argv)
    cases = [(config, dict(prompt=prompt, new=new, **extra)) for config, prompt, new, extra in CASES]
    cases += [(config, dict(arch="mistral", window=window, prompt=17, new=60)) for config, window in WINDOWS]
    cases += [("default", dict(arch="mistral", window=16, prompt=5, new=40, batch=2))]
    print("| config | case | worst owned/dense (step) | at the last step |")
    print("|---|---|--:|--:|")
    for name, case in cases:
        rows, _, _ = run_case(CONFIGS[name](), **case)
        ratios = [(owned / dense, step) for step, owned, dense, _ in rows]
        worst = max(ratios)
        label = ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in case.items())
        print(f"| {name} | {label} | {worst[0]:.3f} ({worst[1]}) | {ratios[-1][0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
