"""Decode tokens/s and peak RSS at T≈1k: DynamicCache, HF QuantizedCache int2/int4 and gear_hf presets.
Writes <out>/decode.csv and decode.md (--out, default out/, untracked).

    python scripts/bench_decode.py                       # SmolLM2, batch 1 and 4, 32 new tokens, 3 repeats
    python scripts/bench_decode.py --quick               # SmolLM2, batch 1, 16 new tokens, 5 methods
    python scripts/bench_decode.py --models smollm2 qwen25 --batch 1 4 --new 64   # the full grid (long)
    OMP_NUM_THREADS=1 python scripts/bench_decode.py --dtype float32 --T 1000 --batch 4 --padded \
        --methods dynamic,rec-balanced                 # the default against the stock cache, left-padded rows

Every (model, batch) cell runs every method once per repeat, interleaved (the method order rotates between
repeats), so all methods see the same machine load; the table gives medians over repeats and the median of
the per-repeat ratios to DynamicCache (paired). Prompts: the last T tokens of 8-shot GSM8K CoT prompts (one
per row; --padded: row b left-padded by 37*b columns, masked out), greedy, exactly --new tokens. tokens/s counts generated tokens of all rows over the
decode steps only (prefill excluded: the step clock starts when the first logits arrive). On a shared machine
the load changes within seconds, so a second estimate uses each run's fast steps: batch / (20th percentile
of the step durations), the speed when the process was not starved; its ratios are the steadier ones. Peak RSS: resident
memory sampled every 2 ms during `generate`, reported as the increase over the RSS before the call (the
weights are already resident) and as the absolute peak. gear_hf decodes with the numba CPU kernels when they are
installed (`gear-hf[cpu]`): decode steps take the fused CPU attention, which reads the compressed storage directly
(`gear_hf.kernels.cpu.attend`); without numba, the torch reference path, which reconstructs the whole compressed
history at every step. Writes <out>/decode.csv and <out>/decode.md (<out>: --out, default out/, untracked).
"""

from __future__ import annotations

import argparse
import os
import sys

import benchlib
import torch

DEFAULT_METHODS = ("dynamic", "rec-balanced", "hf-quanto-int2", "hf-quanto-int4", "fp16", "kivi-2", "gear-2", "gear-4")
QUICK_METHODS = ("dynamic", "rec-balanced", "hf-quanto-int2", "kivi-2", "gear-2")


def _cpu_reads() -> str:
    import torch

    from gear_hf import GearConfig
    from gear_hf.backends import resolve

    backend = resolve(GearConfig(), 64, torch.float32, "cpu").attend
    backend = "torch" if backend is None else backend.name
    return ("numba CPU kernels (backend 'numba'): decode steps by the fused CPU attention, the prompt step by the "
            "reference path" if backend == "numba" else f"{backend} backend: the reference path")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--T", type=int, default=1024, help="prompt tokens per row (default 1024)")
    parser.add_argument("--new", type=int, default=None, help="new tokens (default 32, quick 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--padded", action="store_true", help="left-pad row b by 37*b columns (masked out)")
    parser.add_argument("--hf-residual", type=int, default=128, help="HF QuantizedCache residual_length")
    benchlib.add_out_argument(parser, "decode.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, "bench_decode")
    models = args.models or ["smollm2"]
    batches = args.batch or ([1] if args.quick else [1, 4])
    new = args.new or (16 if args.quick else 32)
    methods, skipped = benchlib.select_methods(args.methods, QUICK_METHODS if args.quick else DEFAULT_METHODS)
    cond = benchlib.Conditions(extra={"dtype": args.dtype, "T": args.T, "new_tokens": new, "batch": batches,
                                      "repeats": args.repeats, "padded": args.padded, "hf_residual_length": args.hf_residual})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    out = benchlib.Path(args.out)

    raw = []
    warmups: dict[tuple, float] = {}  # (model, batch, method) -> seconds of the untimed warm-up generate
    for model_name in models:
        try:
            model, tokenizer = benchlib.load_model(model_name, args.dtype)
        except Exception as err:  # weights not installed: say so, measure the rest
            print(f"skipping {model_name}: {err}", file=sys.stderr)
            continue
        prompts = [p.prompt for p in benchlib.gsm8k_prompts(max(batches))]
        for batch in batches:
            ids = benchlib.fixed_length_batch(tokenizer, prompts, args.T, batch)
            mask = torch.ones_like(ids)
            if args.padded:  # (the kernels' types depend on neither batch nor padding: the warm-up covers these)
                for row in range(batch):
                    ids[row, : 37 * row], mask[row, : 37 * row] = 0, 0
            for method in methods:  # untimed: allocator, lazy init, JIT kernels (numba loads or compiles them once)
                warm = benchlib.warm_up(model, ids, method)
                warmups[model_name, batch, method] = warm.seconds
                print(f"{model_name} b={batch} warm-up {method:15s} {warm.seconds:6.1f}s (not timed; "
                      f"{warm.compile_seconds:.1f} s of it compiling kernels)", flush=True)
            for rep in range(args.repeats):
                order = methods[rep % len(methods):] + methods[: rep % len(methods)]
                for method in order:
                    r = benchlib.run_generate(model, ids, method, new, attention_mask=mask, hf_residual=args.hf_residual)
                    if r.kernels_compiled:  # (the warm-up missed a kernel: this run's tokens/s include compiling)
                        print(f"warning: {method}'s timed run compiled {r.kernels_compiled} kernel(s) "
                              f"({r.compile_seconds:.1f} s)", file=sys.stderr)
                    tps = batch * r.decode_steps / r.decode_seconds if r.decode_seconds else float("nan")
                    fast = batch / benchlib.quantile(r.step_seconds, 0.2) if r.step_seconds else float("nan")
                    raw.append({"model": model_name, "batch": batch, "repeat": rep, "method": method,
                                "decode_steps": r.decode_steps, "decode_s": r.decode_seconds,
                                "tokens_per_s": tps, "tokens_per_s_p20": fast, "prefill_s": r.prefill_seconds,
                                "peak_rss_mb": r.peak_rss / 2**20, "rss_increase_mb": (r.peak_rss - r.rss_before) / 2**20})
                    print(f"{model_name} b={batch} rep={rep} {method:15s} {tps:7.2f} tok/s ({fast:7.2f} p20-step)  prefill {r.prefill_seconds:6.1f}s"
                          f"  +{(r.peak_rss - r.rss_before) / 2**20:7.1f} MiB RSS", flush=True)
                    benchlib.write_csv(out / "decode_raw.csv", raw)
        import gear_hf

        if gear_hf.is_enabled(model):

            gear_hf.disable(model)
        del model
    cond.finish()

    rows = []
    for model_name in models:
        for batch in batches:
            cell = [r for r in raw if r["model"] == model_name and r["batch"] == batch]
            if not cell:
                continue
            for method in methods:
                mine = [r for r in cell if r["method"] == method]

                def paired(key):
                    ratios = []
                    for rep in {r["repeat"] for r in mine}:
                        base = [r for r in cell if r["method"] == "dynamic" and r["repeat"] == rep]
                        if base:
                            ratios.append(next(r for r in mine if r["repeat"] == rep)[key] / base[0][key])
                    return benchlib.median(ratios) if ratios else None

                rows.append({"model": model_name, "batch": batch, "method": method, "repeats": len(mine),
                             "tokens_per_s": benchlib.median(r["tokens_per_s"] for r in mine),
                             "ratio_vs_dynamic": paired("tokens_per_s"),
                             "tokens_per_s_p20": benchlib.median(r["tokens_per_s_p20"] for r in mine),
                             "ratio_p20_vs_dynamic": paired("tokens_per_s_p20"),
                             "prefill_s": benchlib.median(r["prefill_s"] for r in mine),
                             "rss_increase_mb": benchlib.median(r["rss_increase_mb"] for r in mine),
                             "peak_rss_mb": benchlib.median(r["peak_rss_mb"] for r in mine),
                             "warmup_s": warmups.get((model_name, batch, method))})
    benchlib.write_csv(out / "decode.csv", rows)
    body = [f"T={args.T} prompt tokens per row{' (row b left-padded by 37*b of them)' if args.padded else ''}, {new} new tokens (greedy, forced length), {args.dtype}; medians over "
            f"{args.repeats} interleaved repeats, each method after one untimed warm-up generate (warm-up s: its seconds, "
            f"kernel compilation included); ratio = median of per-repeat ratios to DynamicCache; fast steps = "
            f"batch / 20th percentile of a run's step durations (robust to bursts of load from other processes). HF QuantizedCache: "
            f"quanto backend, defaults (per-token axes, post-RoPE), q_group_size=64, residual_length={args.hf_residual}. "
            f"gear_hf: {_cpu_reads()}."]
    if skipped:
        body.append(f"Not measured (backend not installed): {', '.join(skipped)}.")
    body.append(benchlib.markdown_table(rows, [
        ("model", "model", "{}"), ("batch", "batch", "{}"), ("method", "method", "{}"),
        ("tokens_per_s", "decode tok/s", "{:.2f}"), ("ratio_vs_dynamic", "x DynamicCache", "{:.2f}"),
        ("tokens_per_s_p20", "tok/s (fast steps)", "{:.2f}"), ("ratio_p20_vs_dynamic", "x DynamicCache (fast steps)", "{:.2f}"),
        ("rss_increase_mb", "peak RSS increase (MiB)", "{:.1f}"), ("peak_rss_mb", "peak RSS (MiB)", "{:.0f}"),
        ("prefill_s", "prefill s", "{:.1f}"), ("warmup_s", "warm-up s", "{:.1f}")]))
    benchlib.write_summary(out / "decode.md", "Decode throughput and peak RSS", cond, "\n\n".join(body))
    print((out / "decode.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
