#!/usr/bin/env python3
"""Decode-step attention benchmark: fused GEAR (Triton) vs fp16 SDPA vs the reference GEAR path.

One decode step of one layer with Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128),
random data, for each context length T and batch size:

  sdpa       torch.nn.functional.scaled_dot_product_attention over a dense fp16 K/V cache (enable_gqa)
  reference  what gear_hf does without kernels: reconstruct K/V from the GEAR cache (torch engine), gather
             into HF's layout, RoPE the keys, then SDPA
  fused      gear_hf.kernels: attention straight from the compressed storage (GEAR 2/4-bit, GEAR-L 2-bit, and
             GearConfig(), the library default: kivi, 4-bit keys, 2-bit values, Walsh–Hadamard rotation, 4 sinks; and
             recommended "smallest": 2-bit keys and values in the default's format); rows
             `<name>_fused` run the register kernel, `<name>_fused_tc` the tensor-core kernel (fp16/bf16 runs)

--variants adds rows of the fused kernel at other num_warps/num_stages/block_n (one point: the largest T and
batch).
--padded adds a padded batch (8 rows of 8 different lengths, left padding): fused vs fp16 SDPA over the dense
padded cache with its mask; and --share runs greedy generation of a small random Llama (head_dim 64, GQA 4)
on a padded batch of 8 rows of different lengths through the GEAR cache on CUDA and reports the share of
decode layer-steps that took the fused path (the cache's `step_paths` counter when it has one, else counted
here from the calls to the cache's fused entry point).

Reported per row: median time (CUDA events; `graph_ms` = the same call replayed from a CUDA graph, i.e.
without Python launch overhead, when capture works; `graph_vs_sdpa` = graph time over SDPA's graph time),
bytes the method must read (`bytes`: used compressed storage + positions for GEAR, dense K/V for SDPA; the
reference path reads at least the compressed bytes and writes+reads a dense copy: `bytes` is that lower bound),
achieved bandwidth = bytes / time, and the fused output's relative error against the float32 oracle
(gear_hf.cache.fused) where that is cheap.

Results go to OUT (default $OUT or ./bench_out): bench_decode_attention.json and .csv, written after every
row so a timeout keeps what was measured. Without CUDA the script says so and exits 0 (`make bench` runs it).

    python scripts/bench_decode_attention.py                       # T=1k/8k/32k x batch 1/8, bits 2/4
    python scripts/bench_decode_attention.py --T 1024 --batch 1    # quick
    python scripts/bench_decode_attention.py --T 8192 --batch 8 --variants --padded --share
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from benchlib.timing import median_ms

HQ, HKV, D = 32, 8, 128
_ROWS: list[dict] = []  # every measured row, in order (the variants look up their SDPA baseline here)


def _graph_ms(fn, iters: int, warmup: int) -> float | None:
    """Median time of fn replayed from a CUDA graph (no Python/launch overhead); None if capture fails."""
    if not torch.cuda.is_available():
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay, iters, warmup)
    except Exception as exc:  # capture is an optimisation of the measurement, never a failure
        print(f"   (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
        return None


def _inv_freq():
    return 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def _build(T: int, batch: int, bits: int, dtype, device, method: str = "gear", pad: list[int] | None = None):
    """A one-layer GearCache holding T tokens per row (prompt chunk + decode chunks + buffer; row b has pad[b]
    fewer, left-padded), after one decode step (gear_hf.cache.fused.build_cache: keys with a few large
    channels, like real keys)."""
    from gear_hf.cache.fused import build_cache
    from gear_hf.config import GearConfig

    if method in _RECOMMENDED_ROWS:
        cfg = GearConfig() if method == "default" else GearConfig.recommended(name=method)
    else:
        cfg = GearConfig.preset(method, bits=bits)
    decode_part = min(4 * cfg.buffer_size - 1, T // 4)
    cache, _, _ = build_cache(cfg, batch=batch, kv_heads=HKV, head_dim=D, steps=[T - decode_part - 1, decode_part, 1],
                              pad=pad, dtype=dtype, device=device, seed=T * 31 + batch * 7 + bits, outlier_channels=4)
    return cache


def _compressed_bytes(cache) -> int:
    """Bytes of the cache's used storage (what the fused kernel must read) + positions (int32); 0 when this
    cache does not expose the storage this function knows."""
    try:
        return _storage_bytes(cache)
    except AttributeError:
        return 0


def _storage_bytes(cache) -> int:
    layer = cache.layers[0]
    total = cache.tokens_held() * 4
    for stream in (layer.key_stream, layer.value_stream):
        for store, chunks in ((stream.prefill, 1), (stream.decode, max(cache.decode_chunks))):
            if store is None or not store.fields:
                continue
            for name, t in store.fields.items():
                used = min(chunks * store.extent[name], t.shape[2])
                total += t[:, :, :used].numel() * t.element_size()
        for ts, lengths in ((stream.sink, cache.sink_len), (stream.buffer, cache.buffer_len)):
            if ts.data is not None:
                total += ts.data[:, :, : max(lengths)].numel() * ts.data.element_size()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4], help="GEAR bit widths (GEAR-L: 2-bit)")
    parser.add_argument("--no-gear-l", action="store_true", help="skip the 2-bit GEAR-L rows")
    parser.add_argument("--no-default", action="store_true",
                        help="skip the rows of GearConfig() (the library default) and recommended 'smallest'")
    parser.add_argument("--variants", action="store_true",
                        help="fused 2-bit GEAR at num_warps 4/8 x num_stages 1/2/3 (largest T and batch)")
    parser.add_argument("--padded", action="store_true",
                        help="a padded batch of 8 rows of 8 lengths (largest T): fused vs fp16 SDPA with mask")
    parser.add_argument("--share", action="store_true",
                        help="fused-path share of decode steps: greedy generation, padded batch of 8, small Llama")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) reference GEAR path")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: run tiny sizes through the Triton interpreter to check the script itself")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GEAR_BENCH_QUICK") == "1",
                        help="T=1024, batch 1 only (as `make bench BENCH_ARGS=--quick` asks of every benchmark)")
    args, unknown = parser.parse_known_args()
    if unknown:  # `make bench` hands one BENCH_ARGS to every scripts/bench_*.py
        print(f"bench_decode_attention: ignoring options meant for other benchmarks: {unknown}", file=sys.stderr)
    if args.quick:
        args.T, args.batch = [1024], [1]

    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("bench_decode_attention: no CUDA device; this benchmark measures GPU kernels. Skipped "
              "(--cpu-smoke exercises the script on tiny sizes).")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = _ROWS
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter smoke run)",
            "torch": torch.__version__, "dtype": args.dtype,
            "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "q_len": 1}, "iters": args.iters}
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        meta["triton"] = None

    def save():
        (out_dir / "bench_decode_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        keys = ["T", "batch", "method", "median_ms", "graph_ms", "bytes", "GBps", "graph_GBps", "vs_sdpa",
                "graph_vs_sdpa", "rel_err", "note"]
        with open(out_dir / "bench_decode_attention.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def record(**row):
        row["GBps"] = round(row["bytes"] / row["median_ms"] / 1e6, 1) if row.get("median_ms") and row["bytes"] else None
        row["graph_GBps"] = round(row["bytes"] / row["graph_ms"] / 1e6, 1) if row.get("graph_ms") and row["bytes"] \
            else None
        sdpa = [r for r in rows if r["T"] == row["T"] and r["batch"] == row["batch"]
                and r["method"].startswith("sdpa") and r.get("graph_ms") and r.get("pad") == row.get("pad")]
        if row.get("graph_ms") and sdpa:
            row["graph_vs_sdpa"] = round(row["graph_ms"] / sdpa[-1]["graph_ms"], 3)
        rows.append(row)
        print(f"T={row['T']:>6} B={row['batch']} {row['method']:<22} median {row.get('median_ms')} ms "
              f"graph {row.get('graph_ms')} ms  {row['bytes'] / 1e6:.1f} MB  {row.get('GBps')} GB/s  "
              f"x{row.get('vs_sdpa')} of sdpa (graph x{row.get('graph_vs_sdpa')})  err {row.get('rel_err')}"
              f"{'  ' + row['note'] if row.get('note') else ''}", flush=True)
        save()

    inv_freq = _inv_freq().to(device)
    started = time.time()
    if args.share:  # first: cheap, and the answer to "does every decode step take the fused path"
        meta["fused_share"] = _fused_share(device)
        print(f"fused-path share of decode layer-steps (padded batch of 8): {meta['fused_share']}", flush=True)
        save()
    # The first (T, batch) point, then the padded batch and the variants (at the largest T and batch), then the
    # other points: under a timeout, the rows that matter most are measured first.
    points = [(T, batch) for T in args.T for batch in args.batch]
    extras = []
    if args.padded:
        extras.append(lambda: _bench_padded(max(args.T), args, dtype, device, inv_freq, record))
    if args.variants:
        extras.append(lambda: _bench_variants(max(args.T), max(args.batch), args, dtype, device, inv_freq, record))
    for i, (T, batch) in enumerate(points):
        _bench_point(T, batch, args, dtype, device, inv_freq, record)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"   [{time.time() - started:.0f}s elapsed]", flush=True)
        while i == 0 and extras:
            extras.pop(0)()
            print(f"   [{time.time() - started:.0f}s elapsed]", flush=True)
    save()
    return 0


def _sdpa_dense(q, k, v):
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa
        g = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                                                v.repeat_interleave(g, 1))


def _reference_step(cache, q, inv_freq, dtype):
    """What gear_hf.attention does without kernels, minus the store: reconstruct, gather, rotate, SDPA."""
    from gear_hf.compress.rope import apply_rotary, rope_tables

    keys, values = cache.held(0, dtype)
    cos, sin = rope_tables(cache.layout.read_positions(0), inv_freq)
    return _sdpa_dense(q, apply_rotary(keys, cos.to(dtype), sin.to(dtype)), values)


def _fused_fn(cache, q, inv_freq, **tuning):
    """decode_attention over layer 0 with the views and layout built once (what the new cache hands the kernel;
    key outliers sorted once, as the cache does after each flush) -> a callable that CUDA graphs can capture."""
    from dataclasses import replace

    from gear_hf.kernels import decode
    from gear_hf.kernels.views import prepare_derived

    keys, values, layout = cache.kernel_views(0, q.shape[2], q.device)
    keys = replace(keys, prompt=keys.prompt and replace(keys.prompt, derived=prepare_derived(keys.prompt, 1)),
                   decode=keys.decode and replace(keys.decode, derived=prepare_derived(
                       keys.decode, layout.max_decode_chunks)))
    decode_attention = decode.decode_attention
    if tuning.get("tensor_core"):  # its outlier scratch kept zeroed across calls, as the cache keeps it
        from gear_hf.cache.kernel_state import KernelState

        tuning = {"scratch": KernelState().scratch, **tuning}
    return functools.partial(decode_attention, q, keys, values, layout, scaling=D ** -0.5, inv_freq=inv_freq,
                             **tuning)


def _time_fused(cache, q, inv_freq, args, record, T, batch, label, sdpa_ms, comp_bytes, check=True, pad=None,
                **tuning):
    from gear_hf.cache.fused import reference_decode_attention

    try:
        fused = _fused_fn(cache, q, inv_freq, **tuning)
        out = fused()
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        err = None
        if check and T * q.shape[0] <= 8 * 8192:  # the float32 oracle is cheap enough here
            ref = reference_decode_attention(cache, 0, q, scaling=D ** -0.5, inv_freq=inv_freq)
            err = float(((out.float() - ref).abs().max() / ref.abs().max()).item())
            del ref
        ms = median_ms(fused, args.iters, args.warmup)
        record(T=T, batch=batch, method=label, median_ms=round(ms, 4),
               graph_ms=_round(_graph_ms(fused, args.iters, args.warmup)), bytes=comp_bytes,
               vs_sdpa=round(ms / sdpa_ms, 3), rel_err=err, pad=pad)
    except Exception as exc:  # noqa: BLE001 - report and go on with the other rows
        record(T=T, batch=batch, method=label, bytes=comp_bytes, note=f"{type(exc).__name__}: {str(exc)[:200]}",
               pad=pad)


# rows named after a recommended configuration (GearConfig(); recommended(name="smallest")), with their key bits
_RECOMMENDED_ROWS = {"default": 4, "smallest": 2}


def _methods(args):
    out = [("gear", b) for b in args.bits]
    if not args.no_gear_l:
        out.append(("gear-l", 2))
    if not args.no_default:
        out += list(_RECOMMENDED_ROWS.items())
    return out


def _bench_point(T, batch, args, dtype, device, inv_freq, record):
    """sdpa, then fused (and reference) GEAR at each bit width and GEAR-L 2-bit, for one (T, batch)."""
    g = torch.Generator(device=device).manual_seed(T + batch)
    q = torch.randn(batch, HQ, 1, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(batch, HKV, T, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(batch, HKV, T, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    fn = functools.partial(_sdpa_dense, q, k, v)
    sdpa_ms = median_ms(fn, args.iters, args.warmup)
    record(T=T, batch=batch, method="sdpa_fp16" if dtype == torch.float16 else "sdpa_bf16",
           median_ms=round(sdpa_ms, 4), graph_ms=_round(_graph_ms(fn, args.iters, args.warmup)),
           bytes=2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size(), vs_sdpa=1.0)
    del fn, k, v
    for method, bits in _methods(args):
        name = method if method in _RECOMMENDED_ROWS else f"{method}{bits}"
        try:
            cache = _build(T, batch, bits, dtype, device, method)
        except torch.cuda.OutOfMemoryError:
            record(T=T, batch=batch, method=f"{name}_fused", bytes=0, note="OOM building the cache")
            continue
        comp_bytes = _compressed_bytes(cache)
        _time_fused(cache, q, inv_freq, args, record, T, batch, f"{name}_fused", sdpa_ms, comp_bytes)
        if dtype != torch.float32:  # the tensor-core kernel (what the Triton backend runs for 16-bit models)
            _time_fused(cache, q, inv_freq, args, record, T, batch, f"{name}_fused_tc", sdpa_ms, comp_bytes,
                        tensor_core=True)
        if not args.no_reference:
            try:
                ms = median_ms(functools.partial(_reference_step, cache, q, inv_freq, dtype),
                                max(5, args.iters // 3), 2)
                dense = 2 * batch * HKV * T * D * torch.finfo(dtype).bits // 8
                record(T=T, batch=batch, method=f"{name}_reference", median_ms=round(ms, 4),
                       bytes=comp_bytes + 2 * dense, vs_sdpa=round(ms / sdpa_ms, 3),
                       note="bytes: lower bound (compressed read + dense write + dense read)")
            except Exception as exc:  # noqa: BLE001
                record(T=T, batch=batch, method=f"{name}_reference", bytes=0,
                       note=f"{type(exc).__name__}: {str(exc)[:200]}")
        del cache


def _bench_variants(T, batch, args, dtype, device, inv_freq, record):
    """The fused 2-bit GEAR kernel at num_warps 4/8 x num_stages 1/2/3, and 64-token blocks at 4 warps / 1 stage
    (the default launch, 4 warps / 1 stage / 32-token blocks, is the plain row)."""
    g = torch.Generator(device=device).manual_seed(T + batch)
    q = torch.randn(batch, HQ, 1, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    sdpa = [r for r in _ROWS if r["T"] == T and r["batch"] == batch and r["method"].startswith("sdpa")]
    sdpa_ms = sdpa[-1]["median_ms"] if sdpa else float("nan")
    cache = _build(T, batch, 2, dtype, device, "gear")
    comp_bytes = _compressed_bytes(cache)
    for warps in (4, 8):
        for stages in (1, 2, 3):
            _time_fused(cache, q, inv_freq, args, record, T, batch, f"gear2_fused_w{warps}_s{stages}", sdpa_ms,
                        comp_bytes, check=False, num_warps=warps, num_stages=stages)
    _time_fused(cache, q, inv_freq, args, record, T, batch, "gear2_fused_w4_s1_b64", sdpa_ms, comp_bytes,
                check=False, num_warps=4, num_stages=1, block_n=64)
    del cache


def _bench_padded(T, args, dtype, device, inv_freq, record):
    """8 rows of 8 different lengths (left padding up to T/2): fused GEAR 2-bit vs fp16 SDPA over the dense
    padded cache with a boolean key mask (what a stock HF cache does with a padded batch)."""
    batch = 8
    pad = [i * T // 16 for i in range(batch)]
    g = torch.Generator(device=device).manual_seed(T + 99)
    q = torch.randn(batch, HQ, 1, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(batch, HKV, T, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(batch, HKV, T, D, device=device, generator=g, dtype=torch.float32).to(dtype)
    keep = torch.arange(T, device=device)[None, :] >= torch.tensor(pad, device=device)[:, None]  # [B, T]
    mask = keep[:, None, None, :]

    def sdpa_masked():  # (k, v: deleted below, after the last call)
        try:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: F821
        except TypeError:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1), attn_mask=mask)  # noqa: F821

    sdpa_ms = median_ms(sdpa_masked, args.iters, args.warmup)
    label = f"pad{max(pad)}"
    record(T=T, batch=batch, method=f"sdpa_padded_{'fp16' if dtype == torch.float16 else 'bf16'}",
           median_ms=round(sdpa_ms, 4), graph_ms=_round(_graph_ms(sdpa_masked, args.iters, args.warmup)),
           bytes=2 * k.numel() * k.element_size(), vs_sdpa=1.0, pad=label, note="rows padded by " + str(pad))
    del k, v
    for method, bits in [("gear", 2), ("gear", 4)]:
        cache = _build(T, batch, bits, dtype, device, method, pad=pad)
        _time_fused(cache, q, inv_freq, args, record, T, batch, f"{method}{bits}_fused_padded", sdpa_ms,
                    _compressed_bytes(cache), pad=label)
        del cache


def _fused_share(device, steps: int = 40) -> dict:
    """Greedy generation of a small random Llama (2 layers, 8 query / 2 KV heads, head_dim 64) through the GEAR
    cache (2-bit GEAR, buffer 16 so rows flush on different steps) on a left-padded batch of 8 rows of 8
    different lengths: which path each decode layer-step took."""
    import collections

    from transformers import LlamaConfig, LlamaForCausalLM

    import gear_hf
    from gear_hf.cache import GearCache

    _ensure_patches()
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float16).eval()
    model.generation_config.eos_token_id = None
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2, group_size=16, buffer_size=16))
    lengths = [200 - 23 * i for i in range(8)]
    ids = torch.randint(3, 256, (8, max(lengths)), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, max(lengths) - n:] = 1
    ids[mask == 0] = 0
    counted = collections.Counter()
    original_store = getattr(GearCache, "store", None)
    original_fused = getattr(GearCache, "fused_attention", None)

    def store(self, layer_idx, key, value, *a, **kw):
        if key.shape[2] == 1:
            counted["decode layer-steps"] += 1
        return original_store(self, layer_idx, key, value, *a, **kw)

    def fused(self, *a, **kw):
        counted["fused"] += 1
        return original_fused(self, *a, **kw)

    caches = []
    original_init = GearCache.__init__

    def init(self, *a, **kw):
        original_init(self, *a, **kw)
        caches.append(self)

    counting = original_store is not None and original_fused is not None  # today's cache: count the calls
    GearCache.__init__ = init
    if counting:
        GearCache.store, GearCache.fused_attention = store, fused
    try:
        with torch.no_grad():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                           min_new_tokens=steps, do_sample=False, pad_token_id=0)
    finally:
        GearCache.__init__ = original_init
        if counting:
            GearCache.store, GearCache.fused_attention = original_store, original_fused
    paths = getattr(caches[-1], "step_paths", None) if caches else None
    if paths:  # the cache's own counter (per decode layer-step: 'fused' / 'reference')
        total = sum(paths.values())
        fused = paths.get("fused", 0) + paths.get("fused-tc", 0)  # the register or the tensor-core kernel
        return {"source": "cache.step_paths", "paths": dict(paths), "share": round(fused / total, 4)}
    total = counted["decode layer-steps"]
    if not counting:
        return {"source": "none: the cache has neither step_paths nor the entry points counted here", "share": None}
    return {"source": "counted by the benchmark (calls to GearCache.fused_attention / decode layer-steps)",
            "paths": {"fused": counted["fused"], "reference": total - counted["fused"]},
            "share": round(counted["fused"] / total, 4) if total else None, "rows": lengths, "steps": steps}


def _ensure_patches() -> None:
    """gear_hf.patches comes from the repository's patches/ through setup.cfg's package mapping; run from a
    plain source tree (PYTHONPATH, no install) map it the same way for this process."""
    import importlib

    try:
        importlib.import_module("gear_hf.patches")
    except ImportError:
        import tempfile

        import gear_hf

        link_dir = Path(tempfile.mkdtemp(prefix="gear_hf_patches_"))
        (link_dir / "patches").symlink_to(Path(__file__).resolve().parents[1] / "patches")
        gear_hf.__path__.append(str(link_dir))
        importlib.import_module("gear_hf.patches")


def _round(x):
    return None if x is None else round(x, 4)


if __name__ == "__main__":
    sys.exit(main())
