"""vLLM engines, stock CPU_ATTN against the GEAR plugin (each run in its own process: gear_hf.vllm.run).

* fp16 format: the same greedy tokens as stock on tiny random Llama and Qwen2 models, four concurrent requests of
  different lengths (one shorter than a block, others spanning 2-3 blocks of 128), with a KV cache of 5 blocks, so
  that vLLM preempts (recomputes) a request; the tail bookkeeping, the page round trip and the workspace remapping
  are all on that path. Llama also with prefix caching (the longest prompt starts with another's first block),
  Qwen2 with chunked prefill (96 tokens a step: prompts cross steps mid-block, through the tails).
* gear-2: runs, allocates more blocks for the same VLLM_CPU_KVCACHE_SPACE, and repeats itself exactly.
* tensor_parallel_size=2: the fp16 format gives stock's tokens at the same parallelism; GearConfig() runs.
* the GPU backend (`triton_backend`, in CPU_ATTN's place with its kernel in Triton's interpreter: run.py --triton),
  float32: the fp16 format gives stock's tokens with preemption, GearConfig() the CPU backend's tokens.
"""

from __future__ import annotations

import json
import random

import pytest

LENGTHS = (5, 130, 40, 260)
STEPS = 100


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in LENGTHS]
    prompts[3][:128] = prompts[1][:128]  # a shared first block (for prefix caching)
    return prompts


def _run(tmp_path, model, tag, steps=STEPS, **kwargs):
    from gear_hf.vllm.run import run_in_subprocess

    kwargs.setdefault("max_model_len", 512)
    return run_in_subprocess(model, _prompts(), steps, tmp_path, tag=tag, threads=2, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("arch, options", [("llama", dict(prefix_caching=True)),
                                           ("qwen2", dict(max_num_batched_tokens=96))])
def test_fp16_format_is_token_identical_to_stock_with_preemption(tiny_dirs, tmp_path, arch, options):
    stock = _run(tmp_path, tiny_dirs[arch], "stock", blocks=5, **options)
    gear = _run(tmp_path, tiny_dirs[arch], "gear", blocks=5, gear=json.dumps({"method": "fp16"}), **options)
    assert "GEAR pages: fp16" in (tmp_path / "gear.log").read_text()
    assert "GEAR pages" not in (tmp_path / "stock.log").read_text()  # the plugin stays off without GEAR_HF_VLLM
    assert stock["preemptions"] >= 1 and gear["preemptions"] == stock["preemptions"]
    assert [len(t) for t in gear["tokens"]] == [STEPS] * len(LENGTHS)
    assert gear["tokens"] == stock["tokens"]


@pytest.mark.slow
def test_gear2_holds_more_blocks_and_is_deterministic(tiny_dirs, tmp_path):
    gear = json.dumps({"preset": "gear-2"})
    stock = _run(tmp_path, tiny_dirs["llama"], "stock", kv_space_gib=1)
    first = _run(tmp_path, tiny_dirs["llama"], "gear_a", gear=gear, kv_space_gib=1)
    second = _run(tmp_path, tiny_dirs["llama"], "gear_b", gear=gear, kv_space_gib=1)
    assert first["num_blocks"] > 4 * stock["num_blocks"]
    assert first["tokens"] == second["tokens"]
    # compressed, the random model's tokens diverge from stock somewhere (else nothing was compressed)
    assert first["tokens"] != stock["tokens"]


@pytest.mark.slow
def test_tensor_parallel_ranks_store_their_own_heads(tiny_dirs, tmp_path):
    """tensor_parallel_size=2 (two CPU worker processes, one KV head each): the fp16 format gives stock's tokens at
    the same parallelism (stock's own tokens differ between 1 and 2 ranks: the row-parallel sums are added in
    another order), and GearConfig()'s pages, read by the paged kernel in each rank, run to the end."""
    stock = _run(tmp_path, tiny_dirs["llama"], "stock_tp2", tensor_parallel=2)
    fp16 = _run(tmp_path, tiny_dirs["llama"], "fp16_tp2", tensor_parallel=2, gear=json.dumps({"method": "fp16"}))
    default = _run(tmp_path, tiny_dirs["llama"], "default_tp2", tensor_parallel=2, gear="{}")
    assert fp16["tokens"] == stock["tokens"]
    assert "GEAR pages: fp16" in (tmp_path / "fp16_tp2.log").read_text()
    assert [len(t) for t in default["tokens"]] == [STEPS] * len(LENGTHS)
    assert default["num_blocks"] > 4 * stock["num_blocks"]


@pytest.mark.slow
def test_triton_backend_engine_path_gives_the_cpu_backends_tokens(tiny_dirs, tmp_path):
    """The GPU backend through a whole engine (plan, writes, Triton kernel for prefill chunks and decodes, pages
    stored), in float32 where both attentions are exact to float32 rounding (in bf16 a random model's greedy tokens
    follow the attention's arithmetic: stock vLLM and plain Transformers differ there too)."""
    run = dict(dtype="float32", blocks=5)  # (STEPS: requests grow into blocks held by others: preemption)
    stock = _run(tmp_path, tiny_dirs["llama"], "stock32", **run)
    fp16 = _run(tmp_path, tiny_dirs["llama"], "triton_fp16", gear=json.dumps({"method": "fp16"}), triton=True, **run)
    assert "GEAR pages (Triton): fp16" in (tmp_path / "triton_fp16.log").read_text()
    assert stock["preemptions"] >= 1 and fp16["preemptions"] == stock["preemptions"]
    assert fp16["tokens"] == stock["tokens"]
    cpu = _run(tmp_path, tiny_dirs["llama"], "cpu_default", steps=24, dtype="float32", gear="{}")
    triton = _run(tmp_path, tiny_dirs["llama"], "triton_default", steps=24, dtype="float32", gear="{}", triton=True)
    assert [len(t) for t in triton["tokens"]] == [24] * len(LENGTHS)
    assert triton["tokens"] == cpu["tokens"]
