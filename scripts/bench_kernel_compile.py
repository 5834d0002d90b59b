"""What the numba CPU kernels cost a user the first time, and what a decode step costs after it.

    OMP_NUM_THREADS=1 python scripts/bench_kernel_compile.py                    # default bf16 / fp16, gear-2 bf16
    OMP_NUM_THREADS=1 python scripts/bench_kernel_compile.py --configs default:bfloat16 --new 64

Per configuration (a preset name or "default" = GearConfig(), with the model's dtype), three generations of a
random-weight Llama with Llama-3-8B attention shapes (32 query / 8 KV heads, head_dim 128; 2 layers, hidden 256),
a --T-token prompt, greedy, exactly --new tokens, backend "auto" (on CPU: the numba kernels where they serve the
configuration; the fused attention serves every one here):
  cold   a fresh process with an empty numba cache: every kernel it reaches is compiled (what `gear_hf.enable` then
         `generate` costs the first time on a machine);
  warm   the same generation again in that process (compiled code in memory): the decode step itself;
  disk   a second fresh process on the cache the first one wrote (what every later run costs: loading, no compile).
Reported: seconds per generation, the fused attention kernel's mean ms per call in the warm run, and the argument-type
signatures it compiled (numba compiles one per set of argument types). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DEFAULT_CONFIGS = ("default:bfloat16", "default:float16", "gear-2:bfloat16")


def _generate_in_this_process(config_name: str, dtype_name: str, T: int, new: int, runs: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import gear_hf
    from gear_hf.kernels.cpu import attend

    torch.set_num_threads(1)
    spec = LlamaConfig(vocab_size=128, hidden_size=256, head_dim=128, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=T + new + 8)
    spec._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(spec).to(getattr(torch, dtype_name)).eval()
    model.generation_config.eos_token_id = None
    config = gear_hf.GearConfig() if config_name == "default" else gear_hf.GearConfig.preset(config_name)
    kernel, calls = attend._attend, [0.0, 0]

    def timed(*args):
        start = time.perf_counter()
        result = kernel(*args)
        calls[0] += time.perf_counter() - start
        calls[1] += 1
        return result

    attend._attend = timed
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(1))
    seconds = []
    with gear_hf.enabled(model, config), torch.inference_mode():
        for _ in range(runs):
            calls[:] = [0.0, 0]
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
            seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "attend_ms": 1e3 * calls[0] / max(calls[1], 1), "calls": calls[1],
            "signatures": len(kernel.signatures)}


def _child(config: str, T: int, new: int, runs: int, cache: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, __file__, "--child", config, "--T", str(T), "--new", str(new),
                          "--runs", str(runs)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{config}: the generation failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="NAME:DTYPE, NAME a preset or "
                        "'default'")
    parser.add_argument("--T", type=int, default=2000, help="prompt tokens")
    parser.add_argument("--new", type=int, default=100, help="generated tokens")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, dtype = args.child.split(":")
        print(json.dumps(_generate_in_this_process(name, dtype, args.T, args.new, args.runs)))
        return
    print(f"T={args.T} prompt tokens, {args.new} new, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print("| config | cold s | warm s | disk s | attend ms/call (warm) | signatures compiled |")
    print("|---|--:|--:|--:|--:|--:|")
    for config in args.configs:
        if config.count(":") != 1 or config.split(":")[1] not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"--configs entry {config!r}: expected NAME:DTYPE, DTYPE one of float32, bfloat16, "
                             "float16 (e.g. default:bfloat16)")
        with tempfile.TemporaryDirectory() as cache:
            first = _child(config, args.T, args.new, 2, cache)
            disk = _child(config, args.T, args.new, 1, cache)
        print(f"| {config} | {first['seconds'][0]:.1f} | {first['seconds'][1]:.1f} | {disk['seconds'][0]:.1f} | "
              f"{first['attend_ms']:.2f} | {first['signatures']} |", flush=True)


if __name__ == "__main__":
    main()
