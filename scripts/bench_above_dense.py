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
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import gear_hf  # noqa: E402
from tiny_models import CACHE_ARG, tiny_model  # noqa: E402


def dense_owned(cache) -> int:
    """Bytes of every distinct storage a transformers cache's layers keep."""
    seen = {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class _EachStep(StoppingCriteria):
    def __init__(self, measure):
        self.measure, self.values = measure, []

    def __call__(self, input_ids, scores, **kwargs):
        self.values.append(self.measure())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _model(arch: str, dtype, window: int | None):
    model = tiny_model(arch, dtype=dtype, head_dim=32)
    if window is not None:
        model.config.sliding_window = window
        for module in model.modules():
            if hasattr(module, "sliding_window"):
                module.sliding_window = window
    return model


def _inputs(batch: int, prompt: int):
    ids = torch.randint(3, 128, (batch, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding: row 1 is 3 tokens shorter (at least 1 token)
        pad = min(3, prompt - 1)
        mask[1, :pad] = 0
        ids[1, :pad] = 0
    return ids, mask


def run_case(config, arch="llama3", dtype=torch.bfloat16, batch=1, prompt=5, new=40, window=None):
    """[(step, gear owned, dense owned, report dense_bytes)] of one case; and the last cache's summary()."""
    model = _model(arch, dtype, window)
    ids, mask = _inputs(batch, prompt)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)
    dense_cache = DynamicCache(config=model.config)
    dense = _EachStep(lambda: dense_owned(dense_cache))
    with torch.inference_mode():
        model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([dense]), **{CACHE_ARG: dense_cache})
    gear_hf.enable(model, config)
    cache = gear_hf.GearCache(model)
    reports = _EachStep(lambda: cache.memory_report())
    with torch.inference_mode():
        model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([reports]), **{CACHE_ARG: cache})
    gear_hf.disable(model)
    rows = [(i, r["owned_bytes"], d, r["dense_bytes"]) for i, (r, d) in enumerate(zip(reports.values, dense.values))]
    return rows, cache.summary(), reports.values


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
    print(f"| config | case | worst owned/dense (step) | owned/dense at the last step |")
    print("|---|---|--:|--:|")
    for name, case in cases:
        rows, _, _ = run_case(CONFIGS[name](), new=args.new, **case)
        ratios = [(g / d, i) for i, g, d, _ in rows]
        worst = max(ratios)
        label = ", ".join(f"{k}={v if not isinstance(v, torch.dtype) else str(v)[6:]}" for k, v in case.items())
        print(f"| {name} | {label} | {worst[0]:.3f} ({worst[1]}) | {ratios[-1][0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
