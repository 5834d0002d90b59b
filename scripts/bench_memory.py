"""KV-cache bytes and bits/element by component: every gear_hf preset vs DynamicCache and HF QuantizedCache
(no model run). Writes <out>/memory.csv and memory.md (--out, default out/, untracked).

    python scripts/bench_memory.py                 # T = 256, 1024, 4096; SmolLM2, Qwen2.5-0.5B and Llama-3-8B shapes
    python scripts/bench_memory.py --quick         # T = 256, 1024; SmolLM2 shape only

No model is run: bytes do not depend on the values, so each cache is filled through its own API with
random bf16 keys/values of a real model's shape (layers x KV heads x head_dim). Two end states per T:
`prefill` (all T tokens in one step) and `decode` (T-100 tokens at prefill, then 100 single-token steps, so
neither cache ends on a flush boundary: HF's residual holds 100 fp16 tokens, ours a partly filled buffer).

For gear_hf the bytes by component come from `GearCache.memory_report()` (allocated capacity included) and
are cross-checked against an independent count of the distinct tensor storages reachable from the cache
object (`benchlib.tensor_bytes`); HF caches are measured with that count only. bits/element = bytes*8 /
(layers * 2 * KV heads * T * head_dim * batch). Writes <out>/memory.csv and <out>/memory.md (<out>: --out, default out/, untracked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import benchlib
import torch

SHAPES = {  # name: (layers, KV heads, head_dim)
    "smollm2": (30, 3, 64),
    "qwen25": (24, 2, 64),
    "llama3-8b": (32, 8, 128),
}
COMPONENTS = ("codes", "scales", "lowrank", "sparse_values", "sparse_indices", "buffer", "positions")


def hf_config(layers: int, heads: int, dim: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       head_dim=dim, hidden_size=heads * dim, intermediate_size=4 * heads * dim, vocab_size=32)


def fill(method: str, config, T: int, tail: int, batch: int, dtype, seed: int = 0):
    """A cache of `method` holding T tokens per row (T - tail at prefill + tail single steps)."""
    from transformers import DynamicCache

    import gear_hf

    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(batch, heads, T, dim, generator=g).to(dtype)
    if method == "dynamic":
        cache = DynamicCache(config=config)
        put = lambda i, k, v: cache.update(k, v, i)
    elif method in benchlib.HF_METHODS:
        cache = benchlib.make_hf_quantized_cache(_Model(config), method)
        put = lambda i, k, v: cache.update(k, v, i)
    else:
        cache = gear_hf.GearCache(config, benchlib.gear_config(method), expected_length=T)  # as generate() sizes it
        put = lambda i, k, v: cache.store(i, k, v)
    steps = [(0, T - tail)] + [(t, 1) for t in range(T - tail, T)]
    for start, length in steps:
        chunk = data[:, :, start:start + length]
        for i in range(layers):
            put(i, chunk, chunk)
    return cache


class _Model:  # make_hf_quantized_cache takes a model; it only reads .config
    def __init__(self, config):
        self.config = config


def measure(method: str, shape: str, T: int, tail: int, batch: int, dtype) -> dict:
    layers, heads, dim = SHAPES[shape]
    config = hf_config(layers, heads, dim)
    started = time.perf_counter()
    cache = fill(method, config, T, tail, batch, dtype)
    seconds = time.perf_counter() - started
    elements = layers * 2 * heads * T * dim * batch
    counted = benchlib.tensor_bytes(cache)
    row = {"shape": shape, "T": T, "state": "prefill" if tail == 0 else f"decode{tail}", "batch": batch,
           "method": method, "counted_bytes": counted, "bits_per_element": counted * 8 / elements,
           "ratio_vs_dynamic": None, "fill_s": seconds}
    report = cache.memory_report() if hasattr(cache, "memory_report") else None
    if report is not None:
        row["report_bytes"] = report["owned_bytes"]
        row["report_matches_count"] = report["owned_bytes"] == counted
        for c in COMPONENTS:
            row[f"{c}_bytes"] = report[c]
        row["report_bits_per_element"] = report["bits_per_element"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1",
                        help="T=256,1024 on the SmolLM2 shape (also: GEAR_BENCH_QUICK=1)")
    parser.add_argument("--T", type=int, nargs="+", default=None)
    parser.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tail", type=int, default=100, help="single-token steps of the `decode` state")
    parser.add_argument("--methods", default=None, help="comma list (default: dynamic, every preset at 2 and 4 "
                                                         "bits, hf-quanto-int2/4, hf-hqq-int2/4 when installed)")
    benchlib.add_out_argument(parser, "memory.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, "bench_memory")
    Ts = args.T or ([256, 1024] if args.quick else [256, 1024, 4096])
    shapes = args.shapes or (["smollm2"] if args.quick else list(SHAPES))
    if args.methods:
        methods = [benchlib.check_method(m.strip()) for m in args.methods.split(",") if m.strip()]
    else:
        methods = ["dynamic", *benchlib.GEAR_PRESETS]
        methods += [m for m in benchlib.HF_METHODS if benchlib.hf_backend_available(m.split("-")[1])]
    missing = [m for m in benchlib.HF_METHODS if m not in methods and not args.methods]
    cond = benchlib.Conditions(extra={"dtype": "bfloat16", "batch": args.batch, "T": Ts, "shapes": shapes})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)

    rows = []
    for shape in shapes:
        for T in Ts:
            for tail in (0, min(args.tail, T - 1)):
                group = [measure(m, shape, T, tail, args.batch, torch.bfloat16) for m in methods]
                dynamic = next((r["counted_bytes"] for r in group if r["method"] == "dynamic"), None)
                for r in group:
                    r["ratio_vs_dynamic"] = r["counted_bytes"] / dynamic if dynamic else None
                    print(f"{shape:10s} T={T:5d} {r['state']:8s} {r['method']:15s} {r['counted_bytes'] / 2**20:8.2f} MiB"
                          f"  {r['bits_per_element']:6.2f} bits/elem"
                          + ("" if r.get("report_matches_count", True) else
                             f"  (memory_report {r['report_bytes']} != counted {r['counted_bytes']})"), flush=True)
                rows += group
    cond.finish()
    out = benchlib.Path(args.out)
    benchlib.write_csv(out / "memory.csv", rows)

    body = []
    mismatches = [r for r in rows if r.get("report_matches_count") is False]
    body.append(f"gear_hf's `memory_report()` total equals the independent tensor-storage count in "
                f"{sum(1 for r in rows if 'report_bytes' in r) - len(mismatches)} of "
                f"{sum(1 for r in rows if 'report_bytes' in r)} cases"
                + ("." if not mismatches else "; mismatches: " + ", ".join(
                    f"{r['shape']} T={r['T']} {r['state']} {r['method']}: {r['report_bytes']} vs {r['counted_bytes']}"
                    for r in mismatches)))
    if missing:
        body.append(f"Not measured (backend not installed): {', '.join(missing)}.")
    body.append("HF QuantizedCache: transformers' defaults (per-token axis for keys and values, post-RoPE), "
                "q_group_size=64, residual_length=128.")
    for shape in shapes:
        L, H, d = SHAPES[shape]
        body.append(f"\n## {shape} shape ({L} layers, {H} KV heads, head_dim {d}), bf16, batch {args.batch}\n")
        body.append("bits/element (x = bytes / DynamicCache bytes), state `decode` (T-100 prefill + 100 steps):\n")
        table = []
        for m in methods:
            row = {"method": m}
            for T in Ts:
                r = next(x for x in rows if x["shape"] == shape and x["T"] == T and x["method"] == m
                         and x["state"] != "prefill")
                row[f"T{T}"] = f"{r['bits_per_element']:.2f} ({r['ratio_vs_dynamic']:.3f}x)"
            table.append(row)
        body.append(benchlib.markdown_table(table, [("method", "method", "{}")] +
                                            [(f"T{T}", f"T={T}", "{}") for T in Ts]))
        T = Ts[-1]
        body.append(f"\nBytes by component at T={T} (`decode` state, from memory_report; MiB):\n")
        comp_rows = []
        for m in methods:
            r = next(x for x in rows if x["shape"] == shape and x["T"] == T and x["method"] == m
                     and x["state"] != "prefill")
            comp_rows.append({"method": m, "total": r["counted_bytes"] / 2**20,
                              **{c: (r[f"{c}_bytes"] / 2**20 if f"{c}_bytes" in r else None) for c in COMPONENTS}})
        body.append(benchlib.markdown_table(comp_rows, [("method", "method", "{}"), ("total", "total", "{:.3f}")] +
                                            [(c, c, "{:.3f}") for c in COMPONENTS]))
    benchlib.write_summary(out / "memory.md", "KV-cache memory by component", cond, "\n".join(body))
    print(f"wrote {out / 'memory.csv'} and {out / 'memory.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
