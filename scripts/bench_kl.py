"""Next-token fidelity per position: teacher-forced KL and top-1 agreement vs DynamicCache, for gear_hf presets
and HF QuantizedCache at the same bits. Writes <out>/kl.csv and kl.md (--out, default out/, untracked).

    python scripts/bench_kl.py                          # SmolLM2, GSM8K texts 0 and 1, per-token continuation
    python scripts/bench_kl.py --quick                  # one text, fewer methods
    python scripts/bench_kl.py --models smollm2 qwen25 --texts 0 1 2

Greedy agreement (bench_agreement.py) hinges on single near-ties and needs many prompts; this measures the same
thing position by position. Each text is an 8-shot GSM8K CoT prompt plus its worked answer (read from
../shared/data at run time); its last --tokens tokens are used (so the continuation is the test problem's
worked answer), the last --continuation of them fed one token per step as generation does (--chunk to change),
through each method's real cache. Reported per method: mean
and max KL(DynamicCache || method) of the next-token distribution, top-1 agreement, and the cache's bits/element
after the text. Writes <out>/kl.csv and <out>/kl.md (<out>: --out, default out/, untracked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import benchlib
import torch

DEFAULT_METHODS = ("fp16", "kivi-2", "gear-l-2", "gear-2", "kivi-4", "gear-4", "hf-quanto-int2", "hf-quanto-int4")
QUICK_METHODS = ("kivi-2", "gear-2", "hf-quanto-int2", "hf-quanto-int4")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1")
    parser.add_argument("--models", nargs="+", default=["smollm2"])
    parser.add_argument("--texts", type=int, nargs="+", default=None, help="GSM8K test indices (default 0 1)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1, help="continuation step (default 1: per token)")
    parser.add_argument("--methods", default=None)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32", "float16"])
    benchlib.add_out_argument(parser, "kl.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, "bench_kl")
    import gear_hf
    from gear_hf import diagnostics as D

    texts = args.texts or ([0] if args.quick else [0, 1])
    methods, skipped = benchlib.select_methods(args.methods, QUICK_METHODS if args.quick else DEFAULT_METHODS)
    cond = benchlib.Conditions(extra={"dtype": args.dtype, "tokens": args.tokens, "continuation": args.continuation,
                                      "chunk": args.chunk, "texts": texts})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    out = benchlib.Path(args.out)
    raw = []
    for model_name in args.models:
        model, tokenizer = benchlib.load_model(model_name, args.dtype)
        from gear_hf.cache import _text_config

        text_cfg = _text_config(model)
        kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        for index in texts:
            # the last --tokens tokens: the continuation is the test problem's worked answer
            ids = tokenizer(benchlib.gsm8k_text(index), return_tensors="pt").input_ids[:, -args.tokens:]
            prompt = ids.shape[1] - args.continuation
            if gear_hf.is_enabled(model):
                gear_hf.disable(model)
            reference = D.stock_logits(model, ids, prompt, args.chunk)
            for method in methods:
                started = time.perf_counter()
                if method in benchlib.HF_METHODS:
                    if gear_hf.is_enabled(model):
                        gear_hf.disable(model)
                    cache = benchlib.make_hf_quantized_cache(model, method)
                else:
                    config = benchlib.gear_config(method).replace(backend="torch")
                    gear_hf.enable(model, config)
                    cache = gear_hf.GearCache(model, config)
                logits = D.streamed_logits(model, ids, prompt, args.chunk, cache)
                if gear_hf.is_enabled(model):
                    gear_hf.disable(model)
                kl = D.kl_divergence(reference, logits)
                elements = text_cfg.num_hidden_layers * 2 * kv_heads * head_dim * ids.shape[1]
                bits = cache.memory_report()["bits_per_element"] if hasattr(cache, "memory_report") else \
                    benchlib.tensor_bytes(cache) * 8 / elements
                raw.append({"model": model_name, "text": index, "method": method, "mean_kl": kl.mean().item(),
                            "max_kl": kl.max().item(),
                            "top1_agreement": (reference.argmax(-1) == logits.argmax(-1)).float().mean().item(),
                            "kv_bits_per_element": bits, "positions": kl.shape[0]})
                print(f"{model_name} text {index} {method:15s} KL {raw[-1]['mean_kl']:.4f} (max {raw[-1]['max_kl']:.2f}) "
                      f"top-1 {raw[-1]['top1_agreement']:.3f}  {bits:.2f} bits/elem ({time.perf_counter() - started:.0f}s)",
                      flush=True)
                benchlib.write_csv(out / "kl_raw.csv", raw)
        del model
    cond.finish()
    rows = []
    for model_name in args.models:
        for method in methods:
            mine = [r for r in raw if r["model"] == model_name and r["method"] == method]
            if mine:
                rows.append({"model": model_name, "method": method, "texts": len(mine),
                             "mean_kl": sum(r["mean_kl"] for r in mine) / len(mine),
                             "max_kl": max(r["max_kl"] for r in mine),
                             "top1_agreement": sum(r["top1_agreement"] for r in mine) / len(mine),
                             "kv_bits_per_element": sum(r["kv_bits_per_element"] for r in mine) / len(mine)})
    benchlib.write_csv(out / "kl.csv", rows)
    body = [f"GSM8K test texts {texts} (8-shot CoT prompt + worked answer), last {args.tokens} tokens, the last "
            f"{args.continuation} fed {'one token' if args.chunk == 1 else f'{args.chunk} tokens'} per step through each "
            f"method's cache; KL(DynamicCache || method) of the next-token distribution and top-1 agreement, averaged "
            f"over positions and texts; {args.dtype} (bits/element count the cache's own dtype: fp32 here doubles the "
            "full-precision parts). HF QuantizedCache: defaults (per-token axes, post-RoPE), q_group_size=64, "
            "residual_length=128."]
    if skipped:
        body.append(f"Not measured (backend not installed): {', '.join(skipped)}.")
    body.append(benchlib.markdown_table(rows, [
        ("model", "model", "{}"), ("method", "method", "{}"), ("texts", "texts", "{}"),
        ("kv_bits_per_element", "KV bits/elem", "{:.2f}"), ("mean_kl", "mean KL", "{:.4f}"),
        ("max_kl", "max KL", "{:.2f}"), ("top1_agreement", "top-1 agreement", "{:.3f}")]))
    benchlib.write_summary(out / "kl.md", "Teacher-forced next-token fidelity vs DynamicCache", cond, "\n\n".join(body))
    print((out / "kl.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
