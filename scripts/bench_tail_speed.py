"""CPU decode ms/step of configurations side by side in one process, alternated in rounds (by default
GearConfig() with its buffers' formats swapped: the 16-bit buffer, the 8-bit one and the default's codes).
Prints a Markdown table; writes nothing.

    python scripts/bench_tail_speed.py                 # SmolLM2 bf16, GSM8K text 200, 512-token prompt, 40 new tokens
    python scripts/bench_tail_speed.py --configs full,int8,default --repeats 3 --profile

Each round generates greedily with each config in turn (alternated, so load changes hit both alike); a logits
processor notes the time of every step, and a decode step's time is the gap between two consecutive notes (the
prompt step excluded). Reported per config: the mean ms per decode step of its best round and, less sensitive to other
processes on a shared machine, the mean over the steps of each step's best time across the rounds; the ratios to the
first config (and, of the per-step bests, between every pair), the step paths the caches took and the load average. --profile: cProfile of one more round of each config
(top functions by own time) after the timed rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import benchlib
import torch

CONFIGS = {  # fields over recommended(name="accurate") (GearConfig() of config version 4); "default": GearConfig()
           "full": dict(key_buffer="full", value_buffer="full"), "int8": dict(key_buffer="int8", value_buffer="int8"),
           "accurate": {}, "int4": dict(key_buffer="int4", value_buffer="int4"),
           "stats8": dict(value_statistics="8"),
           # recommended(name="steady"), GearConfig() from config version 5: 64-token key chunks, values held a
           # chunk longer, 8-bit value statistics
           "steady": dict(buffer_size=64, value_buffer_size="auto", value_statistics="8"),
           # recommended(name="held-early"), GearConfig() from config version 7 (the key buffer not centered)
           "held-early": dict(buffer_size=64, value_buffer_size="auto", value_statistics="8", key_buffer_size="auto",
                              held_for="auto", key_bits=3),
           # recommended(name="centered"), GearConfig() from config version 8 (the value buffer not centered)
           "centered": dict(buffer_size=64, value_buffer_size="auto", value_statistics="8", key_buffer_size="auto",
                            held_for="auto", key_bits=3, key_buffer_centered=True),
           # recommended(name="centered-kv"), GearConfig() from config version 9 (the value chunks not centered)
           "centered-kv": dict(buffer_size=64, value_buffer_size="auto", value_statistics="8",
                               key_buffer_size="auto", held_for="auto", key_bits=3, key_buffer_centered=True,
                               value_buffer_centered=True),
           "default": None}  # GearConfig() (config version 10: "centered-chunks", the value chunks centered too)


class _StepClock:
    """A logits processor that notes when each step's logits arrive (it changes nothing)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate_once(model, ids: torch.Tensor, config, new_tokens: int) -> tuple[list[float], dict, torch.Tensor]:
    """(ms of each decode step, the cache's step paths, the generated ids) of one greedy generate."""
    from transformers import LogitsProcessorList

    import gear_hf
    from gear_hf.hf_compat import model_cache_kwarg

    clock = _StepClock()
    gear_hf.enable(model, config)
    cache = gear_hf.GearCache(model)
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([clock]),
                                 **{model_cache_kwarg(model): cache})
    finally:
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
    steps = [(b - a) * 1000 for a, b in zip(clock.times, clock.times[1:])]
    return steps, dict(cache.step_paths), out[0, ids.shape[1]:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--text", type=int, default=200, help="GSM8K test problem index")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each config once per round)")
    parser.add_argument("--configs", default="full,int8,default", help=f"comma list of {', '.join(CONFIGS)} "
                        "(ratios to the first)")
    parser.add_argument("--profile", action="store_true", help="cProfile one more round of each config")
    args = parser.parse_args(argv)
    from gear_hf import GearConfig

    names = benchlib.config_names(args.configs, CONFIGS)
    cond = benchlib.Conditions(extra={"model": args.model, "dtype": args.dtype, "text": args.text,
                                      "prompt": args.prompt, "new_tokens": args.new_tokens})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    model, tokenizer = benchlib.load_model(args.model, args.dtype)
    ids = tokenizer(benchlib.gsm8k_text(args.text), return_tensors="pt").input_ids[:, -args.prompt:]
    configs = {name: GearConfig() if CONFIGS[name] is None
               else GearConfig.from_dict({"gear_config_version": 4, **CONFIGS[name]})
               for name in names}
    for name in names:  # warm-up (numba compiles for this model's shapes and dtypes, caches fill): not timed
        generate_once(model, ids, configs[name], 3)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    per_step: dict[str, list[list[float]]] = {name: [] for name in names}
    paths, tokens = {}, {}
    loads = [benchlib.load_average()[0]]
    for r in range(args.repeats):
        for name in names:
            steps, paths[name], tokens[name] = generate_once(model, ids, configs[name], args.new_tokens)
            rounds[name].append(sum(steps) / len(steps))
            per_step[name].append(steps)
            print(f"round {r + 1} {name}: {rounds[name][-1]:.1f} ms/step  paths {paths[name]}", flush=True)
        loads.append(benchlib.load_average()[0])
    def step_minima(name):
        return sum(min(column) for column in zip(*per_step[name])) / len(per_step[name][0])

    base, base_minima = min(rounds[names[0]]), step_minima(names[0])
    print(f"\nload average (1 min) during the rounds: {min(loads):.2f}-{max(loads):.2f}")
    print(f"| buffer | ms/step, best round | rounds (ms/step) | ratio | ms/step, per-step best of {args.repeats} | ratio "
          "| step paths |")
    print("|---|--:|---|--:|--:|--:|---|")
    for name in names:
        best, minima = min(rounds[name]), step_minima(name)
        print(f"| {name} | {best:.1f} | {', '.join(f'{v:.1f}' for v in rounds[name])} | {best / base:.2f}x | "
              f"{minima:.1f} | {minima / base_minima:.2f}x | {paths[name]} |")
    for i, name in enumerate(names):
        for other in names[i + 1:]:
            print(f"per-step best, {other} / {name}: {step_minima(other) / step_minima(name):.3f}x")
    for name in names[1:]:
        same = sum(int(a == b) for a, b in zip(tokens[names[0]].tolist(), tokens[name].tolist()))
        print(f"greedy tokens equal between {names[0]} and {name}: {same}/{args.new_tokens}")
    if args.profile:
        import cProfile
        import pstats

        for name in names:
            profiler = cProfile.Profile()
            profiler.enable()
            generate_once(model, ids, configs[name], args.new_tokens)
            profiler.disable()
            print(f"\n== profile: {name}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
