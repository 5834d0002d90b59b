"""Peak KV memory of `generate`, measured by the allocator, beside what the cache reports and an independent walk
of its tensors. Writes <out>/memory-peak.csv and memory-peak.md (--steps: memory-peak-steps.csv/.md; --out,
default out/, untracked).

    python scripts/bench_memory_peak.py                                  # SmolLM2 bf16, T = 1k, 4k, 16k, CPU
    python scripts/bench_memory_peak.py --models smollm2 qwen25 --T 1024 4096
    python scripts/bench_memory_peak.py --device cuda                    # Llama-3-8B-shaped random weights, 8k/32k
    python scripts/bench_memory_peak.py --steps                          # bits held vs owned at every decode step

For each model and prompt length T: one greedy `generate` of T prompt tokens (the last T tokens of a GSM8K 8-shot
prompt, filled with GSM8K train text when shorter) plus --new-tokens tokens with each method, all in one process,
in turn: DynamicCache, transformers' QuantizedCache (quanto int4/int2; skipped with a line when optimum-quanto is
missing), kivi-2, gear-2 and `GearConfig()` (the method `rec-` + its recommended name, e.g. `rec-centered-kv`,
checked equal to `GearConfig()` at start).

What is measured (`benchlib.AllocatorPeak`):
* CPU: every allocation and free of torch's CPU allocator during the call, from torch.profiler's memory events
  (`profile_memory=True`); their running sum is what was allocated and not yet freed. numpy's and numba's own
  allocations are not torch's and are not seen (the walk below counts those that the cache's kernels keep).
* CUDA: `torch.cuda.max_memory_allocated` / `memory_allocated`, relative to the start of the call.

The cache's share of the peak: peak during `generate` minus the peak of one forward of the same prompt that keeps
no cache (`use_cache=False`, last-token logits only, as generate's prefill computes them). Both runs hold the same
weights and see the same prompt activations; what differs is the cache: its stored bytes, its spare capacity, its
workspaces and the temporaries of compressing and reading it. (Decode-step activations are a few tokens wide and
far below the prompt's.) "Retained" is what the allocator still has allocated after `generate` returned, with the
cache alive: its storage, the generated ids (a few hundred bytes) and any module-level kernel memo filled for it.

Beside them: the cache's own `memory_report()` (held by tokens; owned = held + spare + kernel state + workspaces, `owned_bytes`) for gear_hf, the
independent walk of tests/memory_walk.py (every storage reachable from the cache object plus the kernels'
module-level memos; for transformers' caches the storages reachable from the cache object), and the dense bf16
size of the same tokens.

--steps: SmolLM2 bf16, a 1,024-token GSM8K text (test problem --text-index, 8-shot prompt and
its worked answer), 96 decode steps, `GearConfig()` and kivi-4: at every step the bits/element held (the report)
and owned (the walk: held + spare capacity + kernel memos; and once more inside the step, just before its
per-step workspace is dropped, to include it). Writes <out>/memory-peak-steps.{csv,md}.

Writes <out>/memory-peak.csv and <out>/memory-peak.md (<out>: --out, default out/, untracked).
"""

from __future__ import annotations

import argparse
import gc
import sys

import benchlib
import torch
from benchlib.allocator import AllocatorPeak

sys.path.insert(0, str(benchlib.REPO / "tests"))  # the independent walk lives with the tests that use it
import memory_walk  # noqa: E402
from gear_hf.config import DEFAULT_RECOMMENDED  # noqa: E402

DEFAULT_NAME = "rec-" + DEFAULT_RECOMMENDED  # = GearConfig(), checked in main()
METHODS = ("dynamic", DEFAULT_NAME, "kivi-2", "gear-2", "hf-quanto-int4", "hf-quanto-int2")
# a gear_hf method with its tail stored another way: "<method>+int8-tail" (key_buffer = value_buffer = "int8", the
# 8-bit tail) or "<method>+full-tail" (the 16-bit buffer), e.g. rec-centered-kv+int8-tail
TAILS = {"int8-tail": "int8", "full-tail": "full"}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=65536)
MIB = 1 << 20


def method_config(method: str):
    """The GearConfig of a gear_hf method name (a benchlib name, optionally + a TAILS suffix); a bad name exits."""
    import dataclasses

    base, _, tail = method.partition("+")
    config = benchlib.gear_config(base)
    if not tail:
        return config
    if tail not in TAILS:
        raise SystemExit(f"--methods: {method!r}: unknown suffix {tail!r}; allowed: {', '.join(TAILS)}")
    return dataclasses.replace(config, key_buffer=TAILS[tail], value_buffer=TAILS[tail])


def gear_hf_source() -> str:
    """Which gear_hf this process measures: its folder and that checkout's commit (+ "dirty" with uncommitted
    changes). `python scripts/...` imports the installed gear_hf (the main checkout's, for the shared venv), not the
    worktree's: run with PYTHONPATH=<worktree> to measure a worktree."""
    import subprocess
    from pathlib import Path

    import gear_hf

    folder = Path(gear_hf.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(folder)
    return f"{folder} @ {commit}{' (dirty)' if dirty else ''}"


def check_methods(listed: str | None) -> tuple[list[str], list[str]]:
    """benchlib.select_methods, with the TAILS suffixes understood."""
    if not listed:
        return benchlib.select_methods(None, METHODS)
    names = [m.strip() for m in listed.split(",") if m.strip()]
    for name in names:
        if "+" in name:
            method_config(name)
    plain = ",".join(n for n in names if "+" not in n)
    methods, skipped = benchlib.select_methods(plain, METHODS) if plain else ([], [])
    return [n for n in names if "+" in n or n in methods], skipped


def llama3_8b_shaped(device: torch.device):
    """(model, None): a Llama-3-8B-shaped LlamaForCausalLM (bf16, 32 layers, 32/8 heads, head_dim 128) with random
    weights, built on `device` in bf16 directly (never materialized in float32 or on the CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA3_8B, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    model.generation_config.eos_token_id = None  # random weights: run every requested step
    model.generation_config.pad_token_id = 0
    return model, None


def prompt_ids(model, tokenizer, T: int, device: torch.device) -> torch.Tensor:
    """[1, T]: GSM8K text for a real model, seeded random ids for the random-weight one."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(T)
        return torch.randint(3, model.config.vocab_size, (1, T), generator=g).to(device)
    prompts = [p.prompt for p in benchlib.gsm8k_prompts(1)]
    return benchlib.fixed_length_batch(tokenizer, prompts, T, 1).to(device)


def dense_bytes(model, tokens: int) -> int:
    """Keys and values of `tokens` tokens per layer in bf16, as DynamicCache stores them."""
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * tokens * 2


@torch.no_grad()
def model_only_peak(model, ids: torch.Tensor) -> int:
    """Allocator peak of one forward of the prompt that keeps no cache (the weights are allocated before it)."""
    import gear_hf

    if gear_hf.is_enabled(model):

        gear_hf.disable(model)
    with AllocatorPeak(ids.device) as m:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
    return m.result.peak_bytes


def measure(model, ids: torch.Tensor, method: str, new_tokens: int) -> dict:
    """One greedy generate with `method`'s cache under the allocator measurement; the cache is kept alive until the
    report and the walk have read it. Every cache is passed to generate (or, for gear_hf, built by the enabled
    model's generate as a user gets it) so that it outlives the call."""
    import time

    from transformers import DynamicCache

    import gear_hf
    from gear_hf.hf_compat import model_cache_kwarg

    kwargs = {}
    if method == "dynamic":
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        kwargs[model_cache_kwarg(model)] = DynamicCache(config=model.config)
    elif method in benchlib.HF_METHODS:
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        kwargs[model_cache_kwarg(model)] = benchlib.make_hf_quantized_cache(model, method)
    else:
        gear_hf.enable(model, method_config(method))
    pad = model.generation_config.pad_token_id
    pad = model.generation_config.eos_token_id if pad is None else pad
    mask = torch.ones_like(ids)
    gc.collect()
    started = time.perf_counter()
    with AllocatorPeak(ids.device) as m:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, **kwargs)
    seconds = time.perf_counter() - started
    cache = kwargs[model_cache_kwarg(model)] if kwargs else gear_hf.last_cache(model)
    row = {"method": method, "new_tokens": int(out.shape[1] - ids.shape[1]), "alloc_peak_bytes": m.result.peak_bytes,
           "alloc_retained_bytes": m.result.end_bytes, "alloc_events": m.result.events, "generate_s": seconds}
    if hasattr(cache, "memory_report"):
        report = cache.memory_report()
        row.update(report_held_bytes=report["held_bytes"], report_owned_bytes=report["owned_bytes"],
                   report_bits=report["bits_per_element"], report_summary=cache.summary())
        row["walk_bytes"] = memory_walk.walk_cache(cache, model=model).total
    else:
        row["walk_bytes"] = memory_walk.walk({"cache": cache}).total
    del cache, kwargs, out
    if gear_hf.is_enabled(model):  # (drops the enabled model's reference to its last cache)
        gear_hf.disable(model)
    gc.collect()
    return row


def run_table(args, device: torch.device, write) -> list[dict]:
    """Every (model, T, method) row; write(rows) after each row, so a long run leaves its finished part."""
    rows = []
    for name in args.models:
        if name == "llama3-8b-random":
            model, tokenizer = llama3_8b_shaped(device)
        else:
            model, tokenizer = benchlib.load_model(name, "bfloat16")
            model.to(device)
        warm = prompt_ids(model, tokenizer, 64, device)
        for method in args.methods:  # first calls pay one-time costs (kernel compilation, lazy buffers)
            measure(model, warm, method, 2)
        for T in args.T:
            ids = prompt_ids(model, tokenizer, T, device)
            baseline = model_only_peak(model, ids)
            group = []
            for method in args.methods:
                row = {"model": name, "T": T, "device": device.type, **measure(model, ids, method, args.new_tokens)}
                tokens = T + row["new_tokens"] - 1  # the last generated token is never stored
                row.update(model_only_peak_bytes=baseline, kv_peak_bytes=row["alloc_peak_bytes"] - baseline,
                           dense_bf16_bytes=dense_bytes(model, tokens), tokens=tokens)
                group.append(row)
                print(f"{name} T={T} {method:15s} peak KV {row['kv_peak_bytes'] / MIB:9.2f} MiB  retained "
                      f"{row['alloc_retained_bytes'] / MIB:8.2f} MiB  report "
                      f"{row.get('report_owned_bytes', 0) / MIB:8.2f} MiB  walk {row.get('walk_bytes', 0) / MIB:8.2f}"
                      f" MiB  ({row['generate_s']:.1f} s)", flush=True)
                write(rows + group)
            rows += group
        import gear_hf

        if gear_hf.is_enabled(model):

            gear_hf.disable(model)
        del model
        gc.collect()
    return rows


def table_markdown(rows: list[dict]) -> str:
    view = []
    for r in rows:
        mib = {k: r[k] / MIB for k in ("kv_peak_bytes", "alloc_retained_bytes", "dense_bf16_bytes",
                                       "model_only_peak_bytes", "alloc_peak_bytes", "report_owned_bytes",
                                       "report_held_bytes", "walk_bytes") if r.get(k) is not None}
        bits = r["alloc_retained_bytes"] * 16 / r["dense_bf16_bytes"]  # (dense bf16: 16 bits/element)
        view.append({**r, **mib, "retained_bits": bits})
    return benchlib.markdown_table(view, [
        ("model", "model", "{}"), ("T", "T", "{}"), ("method", "method", "{}"),
        ("kv_peak_bytes", "peak KV (alloc) MiB", "{:.2f}"), ("kv_peak_vs_dynamic", "x dynamic", "{:.3f}"),
        ("alloc_retained_bytes", "retained (alloc) MiB", "{:.2f}"), ("retained_vs_dynamic", "x dynamic", "{:.3f}"),
        ("retained_bits", "retained bits/elem", "{:.2f}"),
        ("report_held_bytes", "report held MiB", "{:.2f}"),
        ("report_owned_bytes", "report owned MiB", "{:.2f}"), ("walk_bytes", "walk MiB", "{:.2f}"),
        ("dense_bf16_bytes", "dense bf16 MiB", "{:.2f}"),
        ("alloc_peak_bytes", "peak in generate MiB", "{:.1f}"),
        ("model_only_peak_bytes", "model-only peak MiB", "{:.1f}"),
        ("generate_s", "generate s", "{:.1f}")])


STEP_COLUMNS = ("held_bits", "buffer_bits", "spare_bits", "report_total_bits", "unreported_cache_bits", "memo_bits",
                "owned_bits", "in_step_owned_bits")


def run_steps(args, out) -> int:
    """Item 3: bits/element held vs owned at every step, SmolLM2 bf16, 1,024-token text, 96 decode steps."""
    from benchlib.memory_steps import StepMemory
    from transformers import LogitsProcessorList

    import gear_hf
    from gear_hf.hf_compat import model_cache_kwarg

    prompt, decode_steps = 1024, 96
    methods, _ = check_methods(args.steps_configs)
    cond = benchlib.Conditions(extra={"dtype": "bfloat16", "batch": 1, "model": "smollm2", "prompt_tokens": prompt,
                                      "decode_steps": decode_steps, "text": f"GSM8K test problem {args.text_index}, "
                                      "8-shot prompt + worked answer, last 1024 tokens", "methods": methods,
                                      "gear_hf": gear_hf_source()})
    benchlib.print_conditions(cond)
    model, tokenizer = benchlib.load_model("smollm2", "bfloat16")
    ids = benchlib.fixed_length_batch(tokenizer, [benchlib.gsm8k_text(args.text_index)], prompt, 1)
    rows = []
    for method in methods:
        config = method_config(method)
        gear_hf.enable(model, config)
        # the cache generate() would build (api._generate_with), built here to be hooked before the prompt step
        cache = gear_hf.GearCache(model, config, expected_length=prompt + decode_steps + 1)
        recorder = StepMemory(model, lambda c, memos: memory_walk.walk_cache(c, memos, model), cache)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=decode_steps + 1,
                       min_new_tokens=decode_steps + 1, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                       logits_processor=LogitsProcessorList([recorder]), **{model_cache_kwarg(model): cache})
        del cache
        rows += [{"method": method, **r} for r in recorder.rows]
        recorder.release()  # (the next method's memo walk must not see this cache alive)
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        gc.collect()
        last = recorder.rows[-1]
        print(f"{method}: last step T={last['tokens']} held {last['held_bits']:.2f} owned {last['owned_bits']:.2f} "
              f"bits/element", flush=True)
    cond.finish()
    benchlib.write_csv(out / "memory-peak-steps.csv", rows)
    names = {"held_bits": "held", "buffer_bits": "of which buffer", "spare_bits": "spare (reserved)",
             "report_total_bits": "report held+reserved", "unreported_cache_bits": "in cache, not in report",
             "memo_bits": "kernel memos", "owned_bits": "owned (walk)", "in_step_owned_bits": "owned in step (walk)"}
    summary = []
    for method in methods:
        decode = [r for r in rows if r["method"] == method and r["step"] >= 1]
        for stat, pick in (("mean", lambda v: sum(v) / len(v)), ("max", max), ("min", min)):
            summary.append({"method": method, "stat": stat, **{c: pick([r[c] for r in decode if r[c] is not None])
                                                                 for c in STEP_COLUMNS}})
    columns = [(c, names[c], "{:.3f}") for c in STEP_COLUMNS]
    body = ["bits/element = bytes * 8 / (key + value elements held). held and buffer from `memory_report()`; "
            "owned = every storage reachable from the cache object + the kernels' module-level memos "
            "(tests/memory_walk.py); owned in step: the same walk inside each step (step 0: the prompt step), just "
            "before the step's workspace is dropped.", "",
            f"## Over the {decode_steps} decode steps (T = {prompt + 1}..{prompt + decode_steps})", "",
            benchlib.markdown_table(summary, [("method", "method", "{}"), ("stat", "", "{}")] + columns)]
    for method in methods:
        picked = [r for r in rows if r["method"] == method and (r["step"] % 8 == 0 or r["step"] == decode_steps)]
        body += ["", f"## {method}, every 8th step (step 0: after the prompt)", "",
                 benchlib.markdown_table(picked, [("step", "step", "{}"), ("tokens", "T", "{}")] + columns)]
    benchlib.write_summary(out / "memory-peak-steps.md", "Bits/element held vs owned at every decode step", cond,
                           "\n".join(body))
    print(f"wrote {out / 'memory-peak-steps.csv'} and {out / 'memory-peak-steps.md'}")
    return 0


def add_ratios(rows: list[dict]) -> None:
    """x dynamic: each row against DynamicCache's row of the same model and T (when it ran)."""
    for r in rows:
        dynamic = next((d for d in rows if d["method"] == "dynamic" and d["model"] == r["model"] and d["T"] == r["T"]),
                       None)
        if dynamic is not None:
            r["kv_peak_vs_dynamic"] = r["kv_peak_bytes"] / dynamic["kv_peak_bytes"]
            r["retained_vs_dynamic"] = r["alloc_retained_bytes"] / dynamic["alloc_retained_bytes"]


def write_table(out, rows: list[dict], args, skipped: list[str], cond) -> None:
    add_ratios(rows)
    benchlib.write_csv(out / "memory-peak.csv", [{k: v for k, v in r.items() if k != "report_summary"} for r in rows])
    body = [f"Methods: {', '.join(args.methods)} (`{DEFAULT_NAME}` = `GearConfig()`); prompt T tokens then "
            f"{args.new_tokens} new tokens, batch 1, bf16, greedy. HF QuantizedCache: its defaults (per-token axes, "
            f"post-RoPE), q_group_size=64, residual_length=128."
            + (f" Not run (backend not installed): {', '.join(skipped)}." if skipped else ""),
            "", "peak KV = allocator peak during generate - allocator peak of a no-cache forward of the prompt; "
                "retained = allocated during generate and still allocated after it (cache alive); "
                "retained bits/elem = retained bytes * 8 / (key+value elements of the tokens held); walk = "
                "tests/memory_walk.py over the cache object (+ the kernels' module-level memos for gear_hf).", "",
            table_markdown(rows), "", "`summary()` of each gear_hf cache at the end:", ""]
    body += [f"- {r['model']} T={r['T']} {r['method']}: {r['report_summary']}" for r in rows if "report_summary" in r]
    benchlib.write_summary(out / "memory-peak.md", "Peak KV memory by the allocator", cond, "\n".join(body))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", nargs="+", default=None,
                        help="smollm2, qwen25 (CPU default: smollm2); cuda default: llama3-8b-random")
    parser.add_argument("--T", type=int, nargs="+", default=None, help="prompt lengths (CPU default 1024 4096 "
                                                                        "16384; cuda 8192 32768)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--methods", default=None, help=f"comma list (default: {','.join(METHODS)})")
    parser.add_argument("--steps", action="store_true", help="bits held vs owned at every decode step (item 3)")
    parser.add_argument("--text-index", type=int, default=200, help="--steps: the GSM8K test problem of the text")
    parser.add_argument("--steps-configs", default=f"{DEFAULT_NAME},kivi-4", help="--steps: methods (comma list)")
    benchlib.add_out_argument(parser, "memory-peak.csv/.md (and memory-peak-steps.csv/.md with --steps)")
    args = benchlib.parse_bench_args(parser, argv, "bench_memory_peak")
    from gear_hf import GearConfig

    if benchlib.gear_config(DEFAULT_NAME) != GearConfig():
        raise SystemExit(f"{DEFAULT_NAME} is no longer GearConfig(): update DEFAULT_NAME")
    torch.set_grad_enabled(False)
    out = benchlib.Path(args.out)
    if args.steps:
        return run_steps(args, out)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.models = args.models or (["llama3-8b-random"] if cuda else ["smollm2"])
    args.T = args.T or ([8192, 32768] if cuda else [1024, 4096, 16384])
    args.methods, skipped = check_methods(args.methods)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    cond = benchlib.Conditions(extra={"dtype": "bfloat16", "batch": 1, "device": device_name, "models": args.models,
                                      "T": args.T, "new_tokens": args.new_tokens,
                                      "skipped": ",".join(skipped) or "none", "gear_hf": gear_hf_source()})
    benchlib.print_conditions(cond)
    if skipped:
        print(f"skipped (backend not installed): {', '.join(skipped)}", flush=True)

    def write(rows: list[dict]) -> None:
        cond.finish()
        write_table(out, rows, args, skipped, cond)

    write(run_table(args, device, write))
    print(f"wrote {out / 'memory-peak.csv'} and {out / 'memory-peak.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
