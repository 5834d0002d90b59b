"""Bits per element a GearCache owns at every decode step (held + buffer + spare capacity + workspaces), for the
recommended configurations and kivi-4, from a T-token prompt onwards (random data, no model). Prints a Markdown
table; writes nothing.

    OMP_NUM_THREADS=1 python scripts/bench_footprint.py                       # head_dim 64 and 128, T 1024 -> 4096
    python scripts/bench_footprint.py --head-dims 64 --until 1120 --configs accurate,kivi-4
    python scripts/bench_footprint.py --configs accurate --buffers full/full,int8/int8 --layers model

One bf16 layer (the KV heads of SmolLM2: 3 for d=64; Llama-3-8B's 8 for d=128) is given a prompt of --prompt tokens,
then one token per step up to --until, through `GearCache.store` + `compress_pending` (what the patched attention
calls, without the attention: the bytes do not depend on the values, so keys and values are random). At every step
from T = prompt it reads `memory_report()`: bits/element owned (held + spare capacity + workspaces; the kernels'
state is not built without an attention read, see scripts/bench_memory_peak.py for a whole generate), and held.
Reports, per configuration: the mean and the largest owned bits over those steps, the mean held, and the largest
(spare + workspaces) / held from T=512 on (a second, 512-token prompt run). Prints a Markdown table.
--buffers runs each configuration with these key/value buffer formats (GearConfig.key_buffer/value_buffer);
--layers model builds the layers of the model the head_dim stands for (30 on d=64, 32 on d=128: the positions,
kept once for all layers, weigh as in a generate) instead of one layer (which carries them alone).
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    from gear_hf import GearConfig
    from gear_hf.config import RECOMMENDED
    from gear_hf.measure import FOOTPRINT_LAYERS, owned_bits_over_decode

    names = [n for n, _, _, _ in RECOMMENDED]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--until", type=int, default=4096)
    parser.add_argument("--configs", default=",".join(names), help=f"RECOMMENDED names ({', '.join(names)})")
    parser.add_argument("--buffers", default="", help="key/value buffer formats, e.g. full/full,int8/int4 (default: "
                                                      "each configuration's own)")
    parser.add_argument("--layers", default="1", help="layers of the cache: a number, or 'model' (FOOTPRINT_LAYERS)")
    args, _ = parser.parse_known_args(argv)  # `make bench` passes every benchmark the same options
    torch.set_grad_enabled(False)
    chosen = [c for c in args.configs.split(",") if c]
    for c in chosen:
        if c not in names:
            parser.error(f"--configs: {c!r} is not a RECOMMENDED name; allowed: {', '.join(names)}")
    buffers = [tuple(b.split("/")) for b in args.buffers.split(",") if b] or [None]
    if any(b is not None and len(b) != 2 for b in buffers):
        parser.error(f"--buffers: {args.buffers!r}: give key/value pairs such as full/full,int8/int4")
    if args.layers != "model" and not args.layers.isdigit():
        parser.error(f"--layers: {args.layers!r} is not a number or 'model'")
    print(f"bf16, layers {args.layers}, prompt {args.prompt}, one token per step to T={args.until}; owned = held + spare + "
          "workspaces (no attention read: no kernel state)")
    print("| config | buffers | head_dim | layers | table bits | mean owned | max owned | mean held | max (owned-held)/held from T=512 |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        layers = FOOTPRINT_LAYERS.get(head_dim, 1) if args.layers == "model" else int(args.layers)
        for name in chosen:
            table_bits = next(b for n, b, _, _ in RECOMMENDED if n == name)
            for buffer in buffers:
                config = GearConfig.recommended(name=name)
                if buffer is not None:
                    config = config.replace(key_buffer=buffer[0], value_buffer=buffer[1])
                run = owned_bits_over_decode(config, head_dim, args.prompt, args.until, layers=layers)
                short = owned_bits_over_decode(config, head_dim, 512, min(args.until, 1536), layers=layers)
                print(f"| {name} | {config.key_buffer}/{config.value_buffer} | {head_dim} | {layers} | "
                      f"{table_bits:.2f} | {run['mean_owned']:.3f} | {run['max_owned']:.3f} | "
                      f"{run['mean_held']:.3f} | {100 * short['max_slack']:.1f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
