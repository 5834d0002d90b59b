"""The K/V axis ablation on real weights: four ways to spend the same bits, keys before and after RoPE
(attention-output error and greedy agreement). Writes <out>/ablation.csv, ablation.md and ablation_greedy.jsonl
(--out, default out/, untracked).

    python scripts/ablation.py                               # SmolLM2 and Qwen2.5-0.5B, kivi 2-bit, g=64
    python scripts/ablation.py --models smollm2 -n 3 --max-new 48
    python scripts/ablation.py --method gear --group-size 32 --buffer-size 64

Configurations: keys per-channel / per-token x values per-token / per-channel (equal group size g: g tokens
per key-channel group or g channels per token group), each with keys compressed before RoPE (rotated when
read) and after RoPE (as HF's QuantizedCache does). Default method `kivi` (quantized backbone only: the axis
effect alone, no low-rank or outlier repair).

Per configuration and model, measured where the error is consumed (gear_hf.diagnostics; the first --tokens
tokens of a GSM8K 8-shot CoT prompt, i.e. worked train exemplars, the last --continuation of them
teacher-forced in buffer-sized chunks through the real streaming cache):
  K / V reconstruction error, attention-score (logit) error, attention-probability total variation, attention
  output error (means over layers and heads), next-token KL against the uncompressed model and top-1
  agreement (all layers compressed),
and greedy agreement with the uncompressed model (DynamicCache) on -n GSM8K test prompts: matched prefix
(tokens before the first difference) and same final answer. The greedy runs are appended to
<out>/ablation_greedy.jsonl and skipped when re-run (resumable). Writes <out>/ablation.csv/.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import benchlib
import torch

AXES = [("channel", "token"), ("channel", "channel"), ("token", "token"), ("token", "channel")]


def configs(method: str, bits: int, group: int, buffer: int):
    import gear_hf

    out = {}
    for pre_rope in (True, False):
        for key_axis, value_axis in AXES:
            name = f"K-{key_axis}/V-{value_axis}/{'pre' if pre_rope else 'post'}-RoPE"
            out[name] = gear_hf.GearConfig.preset(method, bits=bits, group_size=group, buffer_size=buffer,
                                                  key_axis=key_axis, value_axis=value_axis, pre_rope=pre_rope)
    return out


def greedy_tokens(model, tokenizer, prompt: str, config, max_new: int) -> list[int]:
    import gear_hf

    if config is None:
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
    else:
        gear_hf.enable(model, config)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad if not isinstance(pad, list) else pad[0],
                             stop_strings=["\nQuestion:"], tokenizer=tokenizer)
    if gear_hf.is_enabled(model):
        gear_hf.disable(model)
    return out[0, ids.shape[1]:].tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen25"])
    parser.add_argument("--method", default="kivi")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--buffer-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--tokens", type=int, default=640)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--index", type=int, default=0, help="GSM8K test problem of the error-level text")
    parser.add_argument("-n", "--num-prompts", type=int, default=5, help="greedy-agreement prompts (0: skip)")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1",
                        help="SmolLM2 only, 2 greedy prompts of 32 tokens")
    benchlib.add_out_argument(parser, "ablation.csv/.md and ablation_greedy.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.num_prompts, args.max_new = ["smollm2"], min(args.num_prompts, 2), min(args.max_new, 32)
    from gear_hf import diagnostics as D
    from gear_hf.lm_eval.answers import gsm8k_flexible
    from gear_hf.measure import matched_prefix

    grid = configs(args.method, args.bits, args.group_size, args.buffer_size)
    cond = benchlib.Conditions(extra={"dtype": args.dtype, "method": args.method, "bits": args.bits,
                                      "group_size": args.group_size, "buffer_size": args.buffer_size,
                                      "tokens": args.tokens, "continuation": args.continuation,
                                      "greedy_prompts": args.num_prompts, "max_new_tokens": args.max_new})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    out = benchlib.Path(args.out)
    greedy_path = out / "ablation_greedy.jsonl"
    greedy_path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if greedy_path.exists():
        for line in greedy_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["model"], r["config"], r["index"], r["max_new"], r["dtype"])] = r
    problems = benchlib.gsm8k_prompts(args.num_prompts) if args.num_prompts else []

    rows = []
    for model_name in args.models:
        model, tokenizer = benchlib.load_model(model_name, args.dtype)
        text = benchlib.gsm8k_text(args.index)
        ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
        prompt_len = ids.shape[1] - args.continuation
        captures = D.capture_qkv(model, ids)
        reference = D.stock_logits(model, ids, prompt_len, args.buffer_size)

        def greedy(name, config, i):
            key = (model_name, name, i, args.max_new, args.dtype)
            if key not in done:
                started = time.perf_counter()
                tokens = greedy_tokens(model, tokenizer, problems[i].prompt, config, args.max_new)  # noqa: F821 (called before `del model`)
                done[key] = {"model": model_name, "config": name, "index": i, "max_new": args.max_new,
                             "dtype": args.dtype, "tokens": tokens,
                             "answer": gsm8k_flexible(tokenizer.decode(tokens, skip_special_tokens=True))}
                with open(greedy_path, "a") as f:
                    f.write(json.dumps(done[key]) + "\n")
                print(f"  greedy {model_name} {name} prompt {i}: {len(tokens)} tokens "
                      f"({time.perf_counter() - started:.0f}s)", flush=True)
            return done[key]

        for name, config in grid.items():
            started = time.perf_counter()
            heads = D.head_errors(captures, config, prompt_len, args.buffer_size)
            kl = D.next_token_kl(model, ids, prompt_len, config, args.buffer_size, reference=reference)
            row = {"model": model_name, "config": name, "key_axis": config.key_axis, "value_axis": config.value_axis,
                   "pre_rope": config.pre_rope,
                   **{m: sum(r[m] for r in heads) / len(heads) for m in D.METRICS if m != "kl"},
                   "next_token_kl": kl["mean_kl"], "top1_agreement": kl["top1_agreement"]}
            print(f"{model_name} {name:36s} K {row['key_error']:.3f} V {row['value_error']:.3f} "
                  f"scores {row['score_error']:.3f} probs {row['prob_error']:.3f} out {row['output_error']:.3f} "
                  f"KL {row['next_token_kl']:.4f} top1 {row['top1_agreement']:.3f} "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
            rows.append(row)
        for i in range(len(problems)):  # interleaved: prompt i for every config before prompt i+1
            greedy("uncompressed", None, i)
            for name, config in grid.items():
                greedy(name, config, i)
        for row in (r for r in rows if r["model"] == model_name):
            pairs = [(done[(model_name, "uncompressed", i, args.max_new, args.dtype)],
                      done[(model_name, row["config"], i, args.max_new, args.dtype)]) for i in range(len(problems))]
            if pairs:
                row["matched_prefix"] = sum(matched_prefix(m["tokens"], r["tokens"]) for r, m in pairs) / len(pairs)
                row["answer_agrees"] = sum(m["answer"] == r["answer"] for r, m in pairs) / len(pairs)
                row["greedy_prompts"] = len(pairs)
        benchlib.write_csv(out / "ablation.csv", rows)
        del model, captures
    cond.finish()
    benchlib.write_csv(out / "ablation.csv", rows)
    body = [f"Method `{args.method}` at {args.bits} bits, group size {args.group_size} on both axes, buffer "
            f"{args.buffer_size}, {args.dtype}. Error levels: the first {args.tokens} tokens of the GSM8K 8-shot CoT "
            f"prompt (worked train exemplars), {args.tokens - args.continuation} tokens at prefill, {args.continuation} "
            f"teacher-forced in chunks of {args.buffer_size}; means over layers and heads of relative errors (K, V: "
            f"keys after RoPE, as consumed; scores: pre-softmax logits; output: attention output), total variation of "
            f"the attention probabilities, and next-token KL / top-1 vs the uncompressed model (all layers "
            f"compressed). Greedy: {len(problems)} GSM8K test prompts, up to {args.max_new} new tokens, vs DynamicCache."]
    for model_name in args.models:
        mine = [r for r in rows if r["model"] == model_name]
        if not mine:
            continue
        body.append(f"\n## {model_name}\n")
        body.append(benchlib.markdown_table(mine, [
            ("config", "keys / values / RoPE", "{}"), ("key_error", "K err", "{:.3f}"),
            ("value_error", "V err", "{:.3f}"), ("score_error", "score err", "{:.3f}"),
            ("prob_error", "prob TV", "{:.4f}"), ("output_error", "attn-out err", "{:.3f}"),
            ("next_token_kl", "next-token KL", "{:.4f}"), ("top1_agreement", "top-1", "{:.3f}"),
            ("matched_prefix", "greedy matched prefix", "{:.1f}"), ("answer_agrees", "same answer", "{:.0%}")]))
    benchlib.write_summary(out / "ablation.md", "K/V axis ablation (real weights)", cond, "\n".join(body))
    print((out / "ablation.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
