"""Greedy agreement with the uncompressed model on GSM8K (8-shot CoT): matched tokens and same final answer for
every method, HF QuantizedCache included. Writes <out>/agreement.csv and agreement.md (--out, default out/,
untracked).

    python scripts/bench_agreement.py                    # SmolLM2, 10 test prompts, 128 new tokens
    python scripts/bench_agreement.py -n 50              # 50 prompts, as results/agreement (hours on 2 CPUs; resumable)
    python scripts/bench_agreement.py --quick            # fewer methods, 3 prompts
    python scripts/bench_agreement.py --models qwen25 -n 20
    python scripts/bench_agreement.py --report-only      # rebuild the tables from what was run

Long on a 2-core CPU (every method x prompt is a ~1.4k-token prefill plus up to --max-new tokens), so it is
resumable: each finished (model, method, prompt) is appended to <out>/agreement_raw.jsonl (generated token
ids and the extracted final answer; no prompt text) and skipped on the next run; -n 50 after -n 5 only runs
the rest. Prompts are interleaved (prompt i runs for every method before prompt i+1), so a partial run
compares all methods on the same prompts. The reference is transformers' DynamicCache ("dynamic", the
uncompressed model); gear_hf's `fp16` preset must match it exactly.

Per method: mean matched prefix (greedy tokens identical to the reference before the first difference),
identical outputs, final answer equal to the reference's, accuracy against the gold answer (informative only:
these models are too small to solve GSM8K), and KV bits/element at the end of generation (gear_hf:
memory_report; HF caches and DynamicCache: bytes of the tensors they hold). Generation stops at the next
"Question:" or --max-new tokens. Writes <out>/agreement.csv and <out>/agreement.md (<out>: --out, default out/, untracked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import benchlib
import torch

DEFAULT_METHODS = ("dynamic", "fp16", "kivi-2", "outlier-2", "gear-l-2", "gear-2", "kivi-4", "gear-4",
                   "hf-quanto-int2", "hf-quanto-int4", "hf-hqq-int2", "hf-hqq-int4")
QUICK_METHODS = ("dynamic", "fp16", "kivi-2", "gear-2", "gear-4", "hf-quanto-int2", "hf-quanto-int4")


def kv_bits(model, cache, method: str, batch: int = 1) -> float | None:
    if cache is None:
        return None
    if hasattr(cache, "memory_report"):
        return cache.memory_report()["bits_per_element"]
    from gear_hf.cache import _text_config

    text = _text_config(model)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tokens = cache.get_seq_length()
    elements = text.num_hidden_layers * 2 * heads * dim * tokens * batch
    return benchlib.tensor_bytes(cache) * 8 / elements if elements else None


def load_raw(path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["model"], r["method"], r["index"], r["max_new"])] = r
    return done


def summarize(raw: dict, models, methods, n: int, max_new: int, tokenizer_answers=None) -> list[dict]:
    from gear_hf.measure import matched_prefix

    rows = []
    for model_name in models:
        for method in methods:
            pairs = []
            for i in range(n):
                ref = raw.get((model_name, "dynamic", i, max_new))
                mine = raw.get((model_name, method, i, max_new))
                if ref and mine:
                    pairs.append((ref, mine))
            if not pairs:
                continue
            k = len(pairs)
            rows.append({
                "model": model_name, "method": method, "prompts": k,
                "matched_prefix": sum(matched_prefix(m["tokens"], r["tokens"]) for r, m in pairs) / k,
                "identical": sum(m["tokens"] == r["tokens"] for r, m in pairs) / k,
                "answer_agrees": sum(m["answer"] == r["answer"] for r, m in pairs) / k,
                "accuracy": sum(m["answer"] == m["gold"] for _, m in pairs) / k,
                "new_tokens": sum(len(m["tokens"]) for _, m in pairs) / k,
                "kv_bits_per_element": benchlib.median(m.get("kv_bits") for _, m in pairs),
                "decode_tok_s": benchlib.median(m.get("tokens_per_s") for _, m in pairs),
            })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1",
                        help="fewer methods and (unless -n) 3 prompts")
    parser.add_argument("-n", "--num-prompts", type=int, default=None, help="GSM8K test prompts (default 10, quick 3)")
    parser.add_argument("--models", nargs="+", default=["smollm2"])
    parser.add_argument("--methods", default=None)
    parser.add_argument("--first", type=int, default=0,
                        help="run prompts FIRST..n-1 only (split a long run across processes sharing --raw; the "
                             "report covers every recorded prompt below n)")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32", "float16"],
                        help="default float32: the fastest for these GGUF models on CPU")
    parser.add_argument("--raw", default=None, help="resumable JSONL (default <out>/agreement_raw.jsonl)")
    parser.add_argument("--report-only", action="store_true")
    benchlib.add_out_argument(parser, "agreement.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, "bench_agreement")
    n = args.num_prompts or (3 if args.quick else 10)
    if not 0 <= args.first < n:
        parser.error(f"--first {args.first}: must be in [0, {n}) for {n} prompts")
    methods, skipped = benchlib.select_methods(args.methods, QUICK_METHODS if args.quick else DEFAULT_METHODS)
    if "dynamic" not in methods:
        methods.insert(0, "dynamic")
    out = benchlib.Path(args.out)
    raw_path = benchlib.Path(args.raw) if args.raw else out / "agreement_raw.jsonl"
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    raw = load_raw(raw_path)
    cond = benchlib.Conditions(extra={"dtype": args.dtype, "prompts": n, "max_new_tokens": args.max_new,
                                      "batch": 1, "shots": 8})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)

    if not args.report_only:
        from gear_hf.lm_eval.answers import gsm8k_flexible

        problems = benchlib.gsm8k_prompts(n)
        for model_name in args.models:
            todo = [(i, m) for i in range(args.first, n) for m in methods
                    if (model_name, m, i, args.max_new) not in raw]
            if not todo:
                continue
            model, tokenizer = benchlib.load_model(model_name, args.dtype)
            first = tokenizer(problems[todo[0][0]].prompt, return_tensors="pt").input_ids
            for method in dict.fromkeys(m for _, m in todo):  # untimed: the decode tok/s exclude kernel compilation
                print(f"{model_name} warm-up {method:15s} {benchlib.warm_up(model, first, method).seconds:6.1f}s (not timed)",
                      flush=True)
            for count, (i, method) in enumerate(todo):
                ids = tokenizer(problems[i].prompt, return_tensors="pt").input_ids
                started = time.perf_counter()
                r = benchlib.run_generate(model, ids, method, args.max_new, force_length=False, tokenizer=tokenizer,
                                          stop_strings=["\nQuestion:"])
                tokens = r.tokens[0].tolist()
                record = {"model": model_name, "method": method, "index": i, "max_new": args.max_new,
                          "dtype": args.dtype, "prompt_tokens": ids.shape[1], "tokens": tokens,
                          "answer": gsm8k_flexible(tokenizer.decode(tokens, skip_special_tokens=True)),
                          "gold": problems[i].gold, "kv_bits": kv_bits(model, r.cache, method),
                          "tokens_per_s": r.decode_steps / r.decode_seconds if r.decode_seconds else None,
                          "seconds": time.perf_counter() - started}
                raw[(model_name, method, i, args.max_new)] = record
                with open(raw_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"[{count + 1}/{len(todo)}] {model_name} prompt {i} {method:15s} {len(tokens):4d} tokens "
                      f"answer={record['answer']!r} ({record['seconds']:.0f}s)", flush=True)
            import gear_hf

            if gear_hf.is_enabled(model):

                gear_hf.disable(model)
            del model
    cond.finish()
    rows = summarize(raw, args.models, methods, n, args.max_new)
    benchlib.write_csv(out / "agreement.csv", rows)
    ran = {r["model"]: r["prompts"] for r in rows if r["method"] == "dynamic"}
    body = [f"GSM8K test prompts 0..{n - 1} requested (8-shot CoT from the first 8 train problems), prompts actually "
            f"compared per model: {ran}; greedy, up to {args.max_new} new tokens (stop at the next \"Question:\"), "
            f"{args.dtype}, batch 1. Reference: DynamicCache (uncompressed). HF QuantizedCache: defaults (per-token "
            "axes, post-RoPE), q_group_size=64, residual_length=128."]
    if args.report_only:
        body.append("Report rebuilt from the recorded rows (--report-only): the conditions line above describes "
                    "this process, not the runs that measured the rows (their decode tok/s are their own).")
    if skipped:
        body.append(f"Not measured (backend not installed): {', '.join(skipped)}.")
    body.append(benchlib.markdown_table(rows, [
        ("model", "model", "{}"), ("method", "method", "{}"), ("prompts", "prompts", "{}"),
        ("kv_bits_per_element", "KV bits/elem", "{:.2f}"), ("matched_prefix", "matched prefix (tokens)", "{:.1f}"),
        ("identical", "identical output", "{:.0%}"), ("answer_agrees", "same final answer", "{:.0%}"),
        ("accuracy", "accuracy (gold)", "{:.0%}"), ("new_tokens", "mean new tokens", "{:.0f}"),
        ("decode_tok_s", "decode tok/s", "{:.1f}")]))
    benchlib.write_summary(out / "agreement.md", "Greedy agreement with the uncompressed model (GSM8K)", cond,
                           "\n\n".join(body))
    print((out / "agreement.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
