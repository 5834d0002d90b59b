"""Prefill compression overhead: what compressing the prompt (outlier selection, quantization and packing,
power iteration) adds to the prefill forward, at T = 1k and 4k. Writes <out>/prefill.csv and prefill.md (--out,
default out/, untracked).

    python scripts/bench_prefill.py                # SmolLM2, T=1024 and 4096, every preset at 2 and 4 bits
    python scripts/bench_prefill.py --quick        # T=1024, fp16/kivi-2/gear-2/gear-4
    python scripts/bench_prefill.py --models smollm2 qwen25 --T 1024 4096

For each T the prefill forward runs with DynamicCache and with each preset, interleaved over repeats. Three
numbers per preset, medians over repeats:
  compress_fraction  time inside the cache's chunk compression (every ChunkStore.compress_rows call, timed by
                     wrapping it in this script) / the DynamicCache prefill forward
  read_fraction      time reconstructing compressed chunks during the prefill (0 since attend-then-compress:
                     the prompt attends to its exact buffer) / the DynamicCache prefill forward
  total_overhead     (GEAR prefill forward - DynamicCache prefill forward) / DynamicCache prefill forward
and the same two from the least-disturbed runs (minimum over repeats of each), steadier on a shared machine.
Run it with OMP_NUM_THREADS=1 on a loaded machine: with more threads than free cores, OpenMP's barriers make
many small ops (the compression's) pay far more than large matmuls, which inflates the fraction. --clock cpu
(the default) times the calling thread's CPU time (time.thread_time: with one torch thread all the work runs
there), which waiting for a core on a shared machine does not inflate; --clock wall times wall time.
Writes <out>/prefill.csv and <out>/prefill.md (<out>: --out, default out/, untracked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

import benchlib
import torch

from gear_hf.hf_compat import model_cache_kwarg

ALL = ("fp16", "kivi-2", "kcvt-2", "outlier-2", "gear-l-2", "gear-2", "kivi-4", "gear-4")
QUICK = ("fp16", "kivi-2", "gear-2", "gear-4")


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]  # set from --clock in main()


@contextmanager
def timed_methods(cls, names, totals: dict):
    """Accumulate the time (`clock`) spent in cls.<name> for each name (restored afterwards)."""
    originals = {n: getattr(cls, n) for n in names}

    def wrap(name, fn):
        def inner(*a, **k):
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                totals[name] = totals.get(name, 0.0) + clock() - start
        return inner

    for n, fn in originals.items():
        setattr(cls, n, wrap(n, fn))
    try:
        yield totals
    finally:
        for n, fn in originals.items():
            setattr(cls, n, fn)


def prefill(model, ids, method):
    from transformers import DynamicCache

    import gear_hf
    from gear_hf.cache.storage import ChunkStore

    arg = model_cache_kwarg(model)
    totals: dict = {}
    if method == "dynamic":
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        cache = DynamicCache(config=model.config)
    else:
        gear_hf.enable(model, benchlib.gear_config(method))
        cache = gear_hf.GearCache(model)
    with timed_methods(ChunkStore, ("compress_rows", "reconstruct"), totals):
        start = clock()
        model(input_ids=ids, logits_to_keep=1, **{arg: cache})
        seconds = clock() - start
    return seconds, totals.get("compress_rows", 0.0), totals.get("reconstruct", 0.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1")
    parser.add_argument("--models", nargs="+", default=["smollm2"])
    parser.add_argument("--T", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
    benchlib.add_out_argument(parser, "prefill.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, "bench_prefill")
    global clock
    clock = CLOCKS[args.clock]
    Ts = args.T or ([1024] if args.quick else [1024, 4096])
    methods = [benchlib.check_method(m.strip()) for m in args.methods.split(",")] if args.methods else \
        list(QUICK if args.quick else ALL)
    cond = benchlib.Conditions(extra={"dtype": args.dtype, "T": Ts, "batch": 1, "repeats": args.repeats,
                                      "clock": args.clock})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    out = benchlib.Path(args.out)
    text = benchlib.long_text(max(Ts) * 8)
    raw = []
    for model_name in args.models:
        model, tokenizer = benchlib.load_model(model_name, args.dtype)
        all_ids = tokenizer(text, return_tensors="pt").input_ids
        for T in Ts:
            ids = all_ids[:, :T]
            if ids.shape[1] < T:
                raise SystemExit(f"text too short for T={T}")
            for method in methods:  # untimed warm-up of each method's kernels (numba compiles on first use)
                prefill(model, ids[:, :512], method)
            for rep in range(args.repeats):
                order = ["dynamic", *methods]
                order = order[rep % len(order):] + order[: rep % len(order)]
                for method in order:
                    seconds, comp, read = prefill(model, ids, method)
                    raw.append({"model": model_name, "T": T, "repeat": rep, "method": method, "prefill_s": seconds,
                                "compress_s": comp, "reconstruct_s": read})
                    print(f"{model_name} T={T} rep={rep} {method:10s} prefill {seconds:7.2f}s compress {comp:6.2f}s "
                          f"reconstruct {read:6.2f}s", flush=True)
                    benchlib.write_csv(out / "prefill_raw.csv", raw)
        import gear_hf

        if gear_hf.is_enabled(model):

            gear_hf.disable(model)
        del model
    cond.finish()
    rows = []
    for model_name in args.models:
        for T in Ts:
            cell = [r for r in raw if r["model"] == model_name and r["T"] == T]
            base = {r["repeat"]: r["prefill_s"] for r in cell if r["method"] == "dynamic"}
            for method in methods:
                mine = [r for r in cell if r["method"] == method]
                rows.append({
                    "model": model_name, "T": T, "method": method,
                    "dynamic_prefill_s": benchlib.median(base.values()),
                    "gear_prefill_s": benchlib.median(r["prefill_s"] for r in mine),
                    "compress_s": benchlib.median(r["compress_s"] for r in mine),
                    "compress_fraction": benchlib.median(r["compress_s"] / base[r["repeat"]] for r in mine),
                    "read_fraction": benchlib.median(r["reconstruct_s"] / base[r["repeat"]] for r in mine),
                    "total_overhead": benchlib.median((r["prefill_s"] - base[r["repeat"]]) / base[r["repeat"]]
                                                      for r in mine),
                    # least-disturbed runs (minimum over repeats): steadier on a shared machine
                    "compress_fraction_best": min(r["compress_s"] for r in mine) / min(base.values()),
                    "total_overhead_best": (min(r["prefill_s"] for r in mine) - min(base.values())) / min(base.values()),
                })
    benchlib.write_csv(out / "prefill.csv", rows)
    body = [f"Batch 1, {args.dtype}, prompt = the first T tokens of GSM8K train problems with worked answers; medians "
            f"over {args.repeats} interleaved repeats; {args.clock} time; fractions are of the DynamicCache prefill forward "
            f"of the same repeat.",
            benchlib.markdown_table(rows, [
                ("model", "model", "{}"), ("T", "T", "{}"), ("method", "method", "{}"),
                ("dynamic_prefill_s", "DynamicCache prefill s", "{:.2f}"), ("gear_prefill_s", "GEAR prefill s", "{:.2f}"),
                ("compress_s", "compression s", "{:.3f}"), ("compress_fraction", "compression / prefill", "{:.3f}"),
                ("read_fraction", "reconstruction / prefill", "{:.3f}"),
                ("total_overhead", "total overhead", "{:+.3f}"),
                ("compress_fraction_best", "compression / prefill (best runs)", "{:.3f}"),
                ("total_overhead_best", "total overhead (best runs)", "{:+.3f}")])]
    benchlib.write_summary(out / "prefill.md", "Prefill compression overhead", cond, "\n\n".join(body))
    print((out / "prefill.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
