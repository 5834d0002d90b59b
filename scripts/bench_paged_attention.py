#!/usr/bin/env python3
"""Decode-step attention over vLLM-style GEAR pages (the GPU backend's kernel, gear_hf.kernels.triton.paged) against
SDPA over the same context held dense in the model dtype.

One decode step of one layer with Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16:
`--requests` requests of `--context` tokens each, in vLLM blocks of `--block` tokens: every full block a page written
by gear_hf.vllm.format.PageFormat (keys stored before RoPE), the rest of the context an open block in a tail slot.
Rows:

  sdpa        torch.nn.functional.scaled_dot_product_attention over dense K/V [R, 8, T, 128] (enable_gqa): what a
              stock bf16 cache reads
  <format>    the paged kernel over that format's pages (fp16: the raw format, the same kernel reading bf16 pages;
              default: GearConfig(); kivi-4; gear-2)

Reported per row: median ms (CUDA events), bytes the step reads (pages + tails, or the dense K/V), achieved GB/s, the
KV bytes per token, and the output's largest error relative to the float32 oracle (pages decoded by gear_hf.compress,
keys rotated, attention in float32). Results: OUT/bench_paged_attention.json and .csv (OUT: --out, $OUT or
./bench_out), written after every row. Without CUDA it says so and exits 0, unless --smoke (tiny shapes in Triton's
CPU interpreter: only to exercise the script).

    python scripts/bench_paged_attention.py                          # 32 requests x 4096 tokens, block 16
    python scripts/bench_paged_attention.py --requests 64 --context 8192
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from pathlib import Path

FORMATS = {"fp16": {"method": "fp16"}, "default": {}, "kivi-4": {"preset": "kivi-4"}, "gear-2": {"preset": "gear-2"}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats {unknown}: allowed {', '.join(FORMATS)}")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # (before the kernels are defined)
    import torch
    from benchlib.timing import median_ms

    if not torch.cuda.is_available() and not args.smoke:
        print("bench_paged_attention: no CUDA device; nothing measured (--smoke exercises the script on the CPU)")
        return 0
    from gear_hf.compress.rope import apply_rotary, rope_tables
    from gear_hf.kernels.triton import paged
    from gear_hf.vllm.format import PageFormat, config_from_env

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, d = (4, 2, 64) if args.smoke else (32, 8, 128)
    R, T, bs, dtype = args.requests, args.context, args.block, torch.bfloat16
    closed, open_tokens = divmod(T, bs)
    if open_tokens == 0:  # (the newest block is always the open one)
        closed, open_tokens = closed - 1, bs
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(R, closed * bs + open_tokens, hkv, d, generator=gen, device=device).to(dtype)
    values = torch.randn(R, closed * bs + open_tokens, hkv, d, generator=gen, device=device).to(dtype)
    query = torch.randn(R, hq, d, generator=gen, device=device).to(dtype)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device=device).float() / d))
    cos, sin = rope_tables(torch.arange(T, device=device), inv_freq)
    rotated = apply_rotary(keys.float().transpose(1, 2), cos[None], sin[None]).to(dtype).transpose(1, 2)  # [R, T, H, d] after RoPE
    tail_k = torch.zeros(R, bs, hkv, d, dtype=dtype, device=device)
    tail_v = torch.zeros_like(tail_k)
    tail_k[:, :open_tokens] = rotated[:, closed * bs:]
    tail_v[:, :open_tokens] = values[:, closed * bs:]
    table = torch.cat([torch.arange(R * closed, dtype=torch.int32, device=device).view(R, closed),  # pages
                       -1 - torch.arange(R, dtype=torch.int32, device=device)[:, None]], 1)  # open block: slot r
    starts = torch.arange(R + 1, dtype=torch.int32, device=device)
    lens = torch.full((R,), T, dtype=torch.int32, device=device)
    empty = tail_k[:0]
    scale = 1 / math.sqrt(d)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def write(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        conditions = {"requests": R, "context": T, "block": bs, "heads": hq, "kv_heads": hkv, "head_dim": d,
                      "dtype": "bfloat16", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
        (out_dir / "bench_paged_attention.json").write_text(json.dumps({"conditions": conditions, "rows": rows},
                                                                       indent=1))
        fields = ["method", "ms", "bytes", "gb_per_s", "bytes_per_token", "max_rel_error"]
        with open(out_dir / "bench_paged_attention.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    dense_k = rotated.transpose(1, 2).contiguous()  # [R, H, T, d]
    dense_v = values.transpose(1, 2).contiguous()
    q4 = query[:, :, None, :]  # [R, Hq, 1, d]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, dense_k, dense_v, enable_gqa=True)  # noqa: E731
    dense_bytes = 2 * dense_k.numel() * dense_k.element_size()
    ms = median_ms(sdpa, args.iters, 1)
    write({"method": "sdpa", "ms": round(ms, 4), "bytes": dense_bytes, "gb_per_s": round(dense_bytes / ms / 1e6, 1),
           "bytes_per_token": dense_bytes // (R * T), "max_rel_error": None})

    for name in formats:
        fmt = PageFormat(config_from_env(json.dumps(FORMATS[name])), bs, d, dtype)
        page_k = keys[:, : closed * bs].reshape(R, closed, bs, hkv, d).permute(0, 1, 3, 2, 4).reshape(-1, hkv, bs, d)
        page_v = values[:, : closed * bs].reshape(R, closed, bs, hkv, d).permute(0, 1, 3, 2, 4).reshape(-1, hkv, bs, d)
        if fmt.raw:  # (raw pages hold the keys as attended: after RoPE)
            page_k = rotated[:, : closed * bs].reshape(R, closed, bs, hkv, d).permute(0, 1, 3, 2, 4).reshape(
                -1, hkv, bs, d)
        pages = fmt.encode(page_k, page_v)  # [R * closed, H, page_bytes]: request r's block j is page r * closed + j
        streams = (None, None) if fmt.raw else [
            paged.page_stream(spec, tuple((n, *w) for n, w in layout.items()), bs, d, is_keys)
            for spec, layout, is_keys in zip(fmt.specs, fmt.layout, (True, False))]
        out = torch.empty(R, hq, d, dtype=dtype, device=device)
        inv = None if fmt.raw else inv_freq

        def step():
            paged.paged_attention(query, starts, lens, table, bs, 1, pages, *streams, tail_k, tail_v, empty, empty,
                                  R, out, scale=scale, inv_freq=inv)

        ms = median_ms(step, args.iters, 1)
        # the float32 oracle: pages decoded, keys rotated at their positions, then attention
        dk, dv = fmt.decode(pages, torch.float32)
        dk = dk.float().view(R, closed, hkv, bs, d).permute(0, 2, 1, 3, 4).reshape(R, hkv, closed * bs, d)
        dv = dv.float().view(R, closed, hkv, bs, d).permute(0, 2, 1, 3, 4).reshape(R, hkv, closed * bs, d)
        if not fmt.raw:
            dk = apply_rotary(dk, cos[None, : closed * bs], sin[None, : closed * bs])
        dk = torch.cat([dk, tail_k[:, :open_tokens].float().transpose(1, 2)], 2)
        dv = torch.cat([dv, tail_v[:, :open_tokens].float().transpose(1, 2)], 2)
        expected = torch.nn.functional.scaled_dot_product_attention(q4.float(), dk, dv, enable_gqa=True)[:, :, 0]
        error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
        read = R * hkv * closed * fmt.page_bytes + 2 * R * open_tokens * hkv * d * 2
        write({"method": name, "ms": round(ms, 4), "bytes": read, "gb_per_s": round(read / ms / 1e6, 1),
               "bytes_per_token": read // (R * T), "max_rel_error": round(error, 5),
               "vs_sdpa": round(rows[0]["ms"] / ms, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
