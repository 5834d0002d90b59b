"""Bytes a sliding-window layer holds as the sequence grows past its window (windows stay bounded).
Prints a table; writes nothing.

    python scripts/bench_sliding_memory.py                  # window 512, gear-2, Mistral-7B head shapes
    python scripts/bench_sliding_memory.py --window 256 --method kivi-4

One sliding layer (8 KV heads, head_dim 128, bf16, 2 left-padded rows) is fed a 96-token prompt and then one
token per step up to 4 x window, through `GearCache.store_and_read` (what the patched attention calls). At
T = window, 2 x window and 4 x window it reports what the layer holds (memory_report: held bytes without the
cache-wide position bookkeeping) and allocates, and what it has released. Synthetic keys/values: the bytes do
not depend on their values. Prints a Markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    from transformers import MistralConfig

    import gear_hf
    from gear_hf.cache import GearCache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--method", default="gear-2", help="a preset name (default gear-2)")
    args, _ = parser.parse_known_args(argv)  # `make bench` passes every benchmark the same options
    torch.set_grad_enabled(False)
    heads, d, prompt, rows = 8, 128, 96, 2
    config = MistralConfig(num_hidden_layers=1, hidden_size=heads * d * 4, num_attention_heads=heads * 4,
                           num_key_value_heads=heads, sliding_window=args.window)
    cache = GearCache(config, gear_hf.GearConfig.preset(args.method))
    total = 4 * args.window
    mask = torch.ones(rows, total, dtype=torch.long)
    mask[1, :17] = 0
    g = torch.Generator().manual_seed(0)

    def step(start, q):
        k = torch.randn(rows, heads, q, d, generator=g).bfloat16()
        v = torch.randn(rows, heads, q, d, generator=g).bfloat16()
        cache.observe_attention_mask(mask[:, : start + q])
        cache.store_and_read(0, k, v)

    print(f"one sliding layer, window {args.window}, {args.method}, {rows} rows (one left-padded), H={heads}, d={d}, bf16")
    print("| T | held bytes (layer) | allocated (layer) | released prompt / chunks |")
    print("|--:|--:|--:|--:|")
    step(0, prompt)
    marks, first = {args.window, 2 * args.window, total}, None
    for t in range(prompt, total):
        step(t, 1)
        if t + 1 in marks:
            report = cache.memory_report()
            positions = 4 * (cache.positions.numel() + cache.rect_to_local.numel())
            held = report["held_bytes"] - report["positions"]
            allocated = report["owned_bytes"] - positions
            first = first or held
            layer = cache.layers[0]
            print(f"| {t + 1} | {held:,} ({held / first:.3f}x) | {allocated:,} | {layer.released.prompt} / "
                  f"{layer.released.chunks} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
