"""Eager decode ms/step of an enabled model by how the attention calls each layer's cache step, side by side.

    OMP_NUM_THREADS=1 python scripts/dev/eager_step.py [--T 256] [--new 16] [--rounds 5]

Under torch.compile the step is the `gear_hf::cache_step` operator; eager forwards call the Python step directly
(gear_hf/attention.py). This measures what that choice saves, with the same model and cache in one process:

* direct: the shipped eager path (`cache_step` called as a Python function);
* compiler.disable: the earlier design, every eager call through the `torch.compiler.disable` wrapper;
* operator: every eager call through the dispatcher (`torch.ops.gear_hf.cache_step`, StepRef arguments).

A SmolLM2-135M-shaped Llama with random weights (30 layers; scripts/bench_compile.py), float32, one row, a --T
prompt, greedy, --new tokens; decode ms/step: the process's CPU time (time.process_time, one thread) from the
prompt step's logits to the last step's, over the steps (wall time would count the other jobs of a shared machine).
The variants alternate for --rounds rounds; the table gives each one's median, and checks the tokens agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import gear_hf
import gear_hf.attention as attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_compile
from bench_compile import SMOLLM2_135M  # noqa: E402

DIRECT = attention.cache_step


def _through_disable():
    return torch.compiler.disable(DIRECT)


def _through_operator():
    inside = [False]  # the operator's own body calls attention.cache_step: there, the Python step

    def via_operator(module, cache, query, key, value, cos, sin, attention_mask, kwargs):
        if inside[0]:
            return DIRECT(module, cache, query, key, value, cos, sin, attention_mask, kwargs)
        inside[0] = True
        try:
            return torch.ops.gear_hf.cache_step(module._gear_hf_patch.step_ref, cache.step_ref, query, key, value,
                                                cos, sin, attention_mask, kwargs.get("position_ids"),
                                                cache._pending_mask), None
        finally:
            inside[0] = False

    return via_operator


class CpuStepClock(LogitsProcessor):
    """This process's CPU time at each step's logits: on a shared machine, wall time counts the other jobs too."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.process_time())
        return scores

    def decode_ms_per_step(self) -> float:
        return 1000.0 * (self.times[-1] - self.times[0]) / (len(self.times) - 1)


def generate(model, ids, new: int):
    clock = CpuStepClock()
    tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0,
                            logits_processor=LogitsProcessorList([clock]))
    return tokens, clock.decode_ms_per_step()


VARIANTS = {"direct": lambda: DIRECT, "compiler.disable": _through_disable, "operator": _through_operator}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--new", type=int, default=16, help="new tokens (default 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--caches", nargs="+", default=["fp16", "default"])
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), T={args.T}, {args.new} new tokens, "
          f"{args.rounds} rounds; gear_hf from {gear_hf.__file__}")
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (1, args.T), generator=torch.Generator().manual_seed(0))
    rows = []
    for cache in args.caches:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
        model.generation_config.eos_token_id = None
        gear_hf.enable(model, gear_hf.GearConfig.preset("fp16") if cache == "fp16" else gear_hf.GearConfig())
        reference, _ = generate(model, ids, args.new)  # numba kernels load (or compile) once here
        ms = {name: [] for name in VARIANTS}
        same = dict.fromkeys(VARIANTS, True)
        try:
            for _ in range(args.rounds):
                for name, make in VARIANTS.items():
                    attention.cache_step = make()
                    tokens, ms_per_step = generate(model, ids, args.new)
                    ms[name].append(ms_per_step)
                    same[name] &= torch.equal(tokens, reference)
        finally:
            attention.cache_step = DIRECT
        base = statistics.median(ms["direct"])
        for name in VARIANTS:
            median = statistics.median(ms[name])
            rows.append((cache, name, median, median / base, min(ms[name]), max(ms[name]), same[name]))
            print(rows[-1], flush=True)
    print("\n| cache | eager step via | decode CPU ms/step (median) | vs direct | min-max | same tokens |")
    print("|---|---|---|---|---|---|")
    for cache, name, median, ratio, low, high, same in rows:
        print(f"| {cache} | {name} | {median:.1f} | {ratio:.3f}x | {low:.1f}-{high:.1f} | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
