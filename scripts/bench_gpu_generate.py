#!/usr/bin/env python3
"""End-to-end decode on a GPU (issue 26 item 3): tokens/s and peak memory of greedy `generate`, and throughput at
equal KV memory.

Model: a random-weight Llama-3-8B-shaped LlamaForCausalLM built from a config (bf16, 32 layers, 32 query / 8 KV
heads, head_dim 128, hidden 4096, MLP 14336, vocab 128256), sdpa attention. For each method and context T
(default 8k and 32k) the cache is filled with T tokens per row (`fill_cache`: a GEAR cache by a prefill of random
tokens through the model, as a user's prompt, so GearConfig()'s keys get the queries their bits are allocated from;
the others with random keys/values of the right shapes, as decode speed does not depend on the values), then
`generate` decodes `--new` tokens greedily (128 by default, every one forced: no EOS) from the one token not yet
cached. Methods: dynamic (DynamicCache), hf-quanto-int4 (transformers' QuantizedCache, when optimum-quanto
imports), default (`GearConfig()`), kivi-2, gear-2 (`GearConfig.preset`).

Reported per (method, T, batch): decode tokens/s (batch x new tokens / generate's wall time after the fill, CUDA
synchronized; one short warm-up generate per method first, outside the timing: Triton compiles there), peak
`torch.cuda.max_memory_allocated` during fill + decode, and the peak above the weights; the decode path the GEAR
cache took (`cache.step_paths`).

Throughput at equal memory (--kv-budget-gib, default 60): from a probe at --batch, the bytes per row above the
weights (allocator peak / batch) give the largest batch that fits the budget (capped by --max-batch); that batch
is then run and its tokens/s reported (an out-of-memory there is reported, not hidden).

Results go to OUT (default $OUT or ./bench_out): bench_gpu_generate.json and .csv, written after every row.
Without CUDA the script exits with a message unless --smoke: tiny shapes on the CPU (2 layers, head_dim 32),
which only exercise the code path (tests/test_bench_gpu_generate.py runs it).

    python scripts/bench_gpu_generate.py                               # T=8k/32k, batch 1, 128 tokens, 60 GiB
    python scripts/bench_gpu_generate.py --T 8192 --new 32 --methods dynamic,default,gear-2
    python scripts/bench_gpu_generate.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's gear_hf, not an installed one
from benchlib.methods import gear_config, hf_backend_available, make_hf_quantized_cache  # noqa: E402

METHODS = ("dynamic", "hf-quanto-int4", "default", "kivi-2", "gear-2")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=131072)
SMOKE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256, rope_theta=500000.0, max_position_embeddings=4096)


def build_model(shape: dict, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every requested token is decoded
    return model


def method_config(method: str):
    from gear_hf import GearConfig

    return GearConfig() if method == "default" else gear_config(method)


def make_cache(model, method: str):
    """An empty cache of `method` for `model` (enabling gear_hf for GEAR methods, disabling it otherwise)."""
    from transformers import DynamicCache

    import gear_hf

    if method == "dynamic":
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        return DynamicCache(config=model.config)
    if method.startswith("hf-"):
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        return make_hf_quantized_cache(model, method)
    config = method_config(method)
    gear_hf.enable(model, config)
    return gear_hf.GearCache(model, config)


FILL_TOKENS = 1 << 16  # tokens (batch x sequence) per forward of a GEAR cache's fill


@torch.no_grad()
def fill_cache(model, cache, batch: int, tokens: int, seed: int = 0) -> None:
    """`tokens` tokens per row in every layer, at positions 0..tokens-1, as a prompt would leave them.

    A GEAR cache is filled through the model (its base, without the vocabulary head), so that the patched attention
    stores the keys as a user's prefill does: with the queries that GearConfig()'s key bits are allocated from
    (key_bit_allocation='query'), keys before RoPE. Random token ids; sequence chunks of FILL_TOKENS / batch tokens
    at large batches (a chunked prefill), one prompt step otherwise. The other caches get random keys/values of
    the right shapes (decode speed does not depend on the values)."""
    from gear_hf.cache import GearCache
    from gear_hf.hf_compat import model_cache_kwarg

    cfg = model.config
    device, dtype = model.device, model.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    if isinstance(cache, GearCache):
        ids = torch.randint(3, cfg.vocab_size, (batch, tokens), generator=gen, device=device)
        step = max(256, FILL_TOKENS // batch)
        for start in range(0, tokens, step):
            end = min(tokens, start + step)
            model.model(input_ids=ids[:, start:end], attention_mask=torch.ones_like(ids[:, :end]), use_cache=True,
                        **{model_cache_kwarg(model): cache})
        return
    shape = (batch, cfg.num_key_value_heads, tokens, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        cache.update(k, v, layer)
        del k, v


@torch.no_grad()
def timed_decode(model, method: str, batch: int, tokens: int, new: int) -> dict:
    """Fill a fresh cache with `tokens` per row, then greedy-decode `new` tokens; times and memory."""
    from gear_hf.hf_compat import model_cache_kwarg

    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    cache = make_cache(model, method)
    fill_start = time.perf_counter()
    fill_cache(model, cache, batch, tokens)
    ids = torch.randint(3, model.config.vocab_size, (batch, tokens + 1), device=model.device)
    mask = torch.ones_like(ids)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   **{model_cache_kwarg(model): cache})
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {"method": method, "T": tokens, "batch": batch, "new_tokens": new, "fill_s": round(start - fill_start, 3),
           "decode_s": round(seconds, 4), "tokens_per_s": round(batch * new / seconds, 2),
           "decode_paths": dict(getattr(cache, "step_paths", {})) or None}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        row.update(peak_gib=round(peak / 2**30, 3), peak_above_weights_gib=round((peak - base) / 2**30, 3))
    else:  # (smoke: no allocator statistics) what the cache holds
        row["peak_above_weights_gib"] = round(_cache_bytes(cache) / 2**30, 6)
    del cache
    return row


def _cache_bytes(cache) -> int:
    from gear_hf.cache import GearCache

    if isinstance(cache, GearCache):
        return cache.memory_report()["owned_bytes"]
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def equal_memory_batch(row: dict, budget_gib: float, max_batch: int) -> tuple[int, bool]:
    """(largest batch whose peak above the weights fits the budget, from the probe row's per-row bytes; capped)."""
    per_row = row["peak_above_weights_gib"] / row["batch"]
    fits = int(budget_gib // per_row) if per_row > 0 else max_batch
    return max(1, min(fits, max_batch)), fits > max_batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768], help="tokens per row in the cache")
    parser.add_argument("--new", type=int, default=128, help="tokens decoded (greedy, all forced)")
    parser.add_argument("--batch", type=int, default=1, help="probe batch (tokens/s and per-row memory)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--kv-budget-gib", type=float, default=60.0, help="KV memory for the equal-memory rows; "
                        "0: skip them")
    parser.add_argument("--max-batch", type=int, default=256, help="cap on the equal-memory batch")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the code path only)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_gpu_generate: no CUDA device; this benchmark measures a GPU (use --smoke to check the script "
              "on the CPU with tiny shapes)", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.T = [t for t in args.T if t <= 256] or [40, 72]
        args.new = min(args.new, 4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(SMOKE if args.smoke else LLAMA3_8B, dtype, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        meta = {"model": "random-weight Llama-3-8B shapes" if not args.smoke else "smoke (tiny Llama)",
                "dtype": str(dtype), "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                "torch": torch.__version__, "kv_budget_gib": args.kv_budget_gib}
        (out / "bench_gpu_generate.json").write_text(json.dumps({"conditions": meta, "rows": rows}, indent=1))
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(out / "bench_gpu_generate.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)

    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        if method.startswith("hf-") and not hf_backend_available(method.split("-")[1]):
            record({"method": method, "skipped": f"the {method.split('-')[1]} backend of QuantizedCache is not "
                                                 "installed"})
            continue
        try:
            timed_decode(model, method, 1, min(args.T), 2)  # warm-up: kernels compile here, not in the timing
        except Exception as error:  # noqa: BLE001 (a method that cannot run here is reported, the others go on)
            record({"method": method, "skipped": f"{type(error).__name__}: {str(error)[:300]}"})
            continue
        for tokens in args.T:
            try:
                probe = timed_decode(model, method, args.batch, tokens, args.new)
            except torch.cuda.OutOfMemoryError as error:
                record({"method": method, "T": tokens, "batch": args.batch, "error": f"out of memory: {error}"[:300]})
                continue
            record({**probe, "kind": "probe"})
            if args.kv_budget_gib <= 0:
                continue
            budget = args.kv_budget_gib if not args.smoke else 1e-3  # (smoke: a budget the tiny cache fills)
            batch, capped = equal_memory_batch(probe, budget, args.max_batch)
            try:
                row = timed_decode(model, method, batch, tokens, args.new)
                record({**row, "kind": "equal memory", "kv_budget_gib": budget, "capped": capped})
            except torch.cuda.OutOfMemoryError as error:
                record({"method": method, "T": tokens, "batch": batch, "kind": "equal memory",
                        "error": f"out of memory at the estimated batch: {error}"[:300]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
