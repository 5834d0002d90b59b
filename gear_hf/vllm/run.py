"""One greedy vLLM run in its own process, stock or through the GEAR plugin: the unit the tests and
scripts/bench_vllm.py compare.

    python -m gear_hf.vllm.run --model DIR --prompts prompts.json --max-tokens 32 --out result.json \
        [--gear '{"preset": "gear-2"}'] [--blocks 8] [--kv-space-gib 1] [--max-num-seqs 4]
        [--max-num-batched-tokens 96] [--prefix-caching] [--warm-up] [--tensor-parallel-size 2] [--triton]

prompts.json: a list of token-id lists. result.json: {"tokens": [[...], ...], "num_blocks", "preemptions",
"block_size", "seconds" (the whole run), "generate_seconds" (the timed generate), "tail_bytes" and "sink_bytes"
(GEAR's open-block tails and exact sink tokens over every layer, as grown by the end)}. --gear sets GEAR_HF_VLLM=1 and
GEAR_HF_VLLM_CONFIG for vLLM's processes; without it the plugin stays off (stock CPU_ATTN). The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so its block count can be read back. --triton (with --gear, one
rank): the GPU backend (`triton_backend`) in CPU_ATTN's place, its kernel in Triton's CPU interpreter: slow, for
testing the GPU backend's engine path on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .plugin import CONFIG_ENV, ENABLE_ENV


def run_in_subprocess(model: str | Path, prompts: list[list[int]], max_tokens: int, work_dir: str | Path,
                      gear: str | None = None, blocks: int | None = None, kv_space_gib: float = 1,
                      max_num_seqs: int = 4, max_model_len: int = 1024, dtype: str = "bfloat16",
                      threads: int = 2, timeout: float = 900, tag: str = "run",
                      max_num_batched_tokens: int | None = None, prefix_caching: bool = False,
                      warm_up: bool = False, tensor_parallel: int = 1, triton: bool = False) -> dict:
    """Run `main` in a fresh Python process (vLLM spawns workers and reads its plugins' settings at start)."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    prompt_file, out_file = work / f"{tag}.prompts.json", work / f"{tag}.result.json"
    prompt_file.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "gear_hf.vllm.run", "--model", str(model), "--prompts", str(prompt_file),
           "--max-tokens", str(max_tokens), "--out", str(out_file), "--kv-space-gib", str(kv_space_gib),
           "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len), "--dtype", dtype]
    if gear is not None:
        cmd += ["--gear", gear]
    if blocks is not None:
        cmd += ["--blocks", str(blocks)]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if prefix_caching:
        cmd += ["--prefix-caching"]
    if warm_up:
        cmd += ["--warm-up"]
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
    if triton:
        cmd += ["--triton"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    if tensor_parallel > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        # vLLM binds each CPU rank to a NUMA node of its own by default (one here): give each rank its cores
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        share = max(1, len(cores) // tensor_parallel)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cores[i * share:(i + 1) * share] or cores[-1:])) for i in range(tensor_parallel))
    log = work / f"{tag}.log"
    with open(log, "w") as handle:
        done = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"vLLM run {tag} failed (exit {done.returncode}); log {log}:\n{tail}")
    return json.loads(out_file.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gear", default=None, help="GEAR config JSON; absent: stock vLLM")
    parser.add_argument("--blocks", type=int, default=None, help="num_gpu_blocks_override (forces preemption)")
    parser.add_argument("--kv-space-gib", type=float, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="small: chunked prefill")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks (processes on CPU), each storing its KV heads' pages")
    parser.add_argument("--warm-up", action="store_true", help="a short generate of the first prompt before the "
                        "timed one (prefix caching then reuses its blocks: leave it off to time prefills)")
    parser.add_argument("--triton", action="store_true", help="the GPU backend in CPU_ATTN's place, under Triton's "
                        "CPU interpreter (slow; needs --gear and one rank)")
    args = parser.parse_args(argv)
    if args.triton and (args.gear is None or args.tensor_parallel_size != 1):
        parser.error("--triton runs the GEAR Triton backend in this process: give --gear and one rank")

    if args.tensor_parallel_size == 1:  # (several ranks need their worker processes)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_space_gib:g}"
    if args.gear is not None:
        os.environ[ENABLE_ENV], os.environ[CONFIG_ENV] = "1", args.gear
    else:
        os.environ.pop(ENABLE_ENV, None)
    if args.triton:
        os.environ["TRITON_INTERPRET"] = "1"  # (before any Triton kernel is defined)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.triton:  # the plugins once (vLLM loads them only once a process), then CPU_ATTN replaced again
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from .plugin import TRITON_BACKEND_PATH

        load_general_plugins()
        register_backend(AttentionBackendEnum.CPU_ATTN, TRITON_BACKEND_PATH)

    start = time.time()
    extra = {} if args.blocks is None else {"num_gpu_blocks_override": args.blocks}
    if args.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model, enforce_eager=True, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0, enable_prefix_caching=args.prefix_caching,
              disable_log_stats=False, tensor_parallel_size=args.tensor_parallel_size, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(args.prompts).read_text())]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.warm_up:  # one request through prefill and a few decode steps: kernels compiled before the timing
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    timed = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_seconds = time.perf_counter() - timed
    cache = llm.llm_engine.vllm_config.cache_config
    preemptions = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            preemptions = int(metric.value)
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context.values()
    impls = [layer.impl for layer in layers if getattr(getattr(layer, "impl", None), "tail_pool", None)]
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "num_blocks": cache.num_gpu_blocks,
              "tail_bytes": sum(impl.tail_pool.nbytes for impl in impls),  # the open-block tails held (GEAR)
              "sink_bytes": sum(impl.sink_pool.nbytes for impl in impls if impl.sink_pool is not None),
              "block_size": cache.block_size, "preemptions": preemptions, "seconds": round(time.time() - start, 1),
              "generate_seconds": round(generate_seconds, 3), "gear": args.gear}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
