"""Decode ms/step of gear_hf's presets vs DynamicCache on a padded and an unpadded batch (no weights needed).
Writes <out>/decode-padded.md (--out, default out/, untracked) and prints it.

    OMP_NUM_THREADS=1 python scripts/bench_decode_padded.py            # T=1000, 32 new tokens
    OMP_NUM_THREADS=1 python scripts/bench_decode_padded.py --T 2000 --methods kivi-2,gear-2,gear-4

A random-weight model of SmolLM2-135M's shapes (Llama, 30 layers, 9/3 heads, head_dim 64, fp32; speed does not
depend on the weights), greedy generation of --new tokens after a --T-token random prompt, at batch 1, 4 and 4
left-padded (row r padded by 37*r). Decode time: from the first generated token to the last, stamped by a logits
processor (called once per generated token), so the prefill forward is not in it (differencing two generate calls
would carry the noise of two prefills on a busy machine). --clock cpu (default) stamps the generating thread's CPU
time (time.thread_time: with one torch thread all the work runs there), which waiting for a core on a shared
machine does not inflate; --clock wall stamps wall time. Every method runs --repeats times in one process, the
methods interleaved (DynamicCache first), and the minimum is kept; the ratio is DynamicCache's ms/step over the
method's (higher is better, 1.0 = as fast), and the padded batch's ms/step over the unpadded one's of the same
size (the padded rows are longer, so DynamicCache's own figure is the baseline), and the share of decode
layer-steps each method's attention took on the fused path (every batch; `GearCache.step_paths`). Writes
<out>/decode-padded.md (<out>: --out, default out/, untracked) and prints it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import benchlib
import torch


def main(argv=None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor

    import gear_hf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=1000)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="kivi-2,gear-2")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    benchlib.add_out_argument(parser, "decode-padded.md")
    args = benchlib.parse_bench_args(parser, argv, "bench_decode_padded")
    if args.T <= 37 * 3:
        parser.error(f"--T {args.T}: the padded batch pads its last row by 111 tokens; give --T > 111")
    torch.set_grad_enabled(False)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    methods = ["dynamic", *args.methods.split(",")]
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    class Stamps(LogitsProcessor):
        """Records the time at each generated token (generate calls its logits processors once per token)."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(clock())
            return scores

    def decode_ms(ids, mask, method) -> float:
        stamp = Stamps()

        def generate():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new + 1,
                           min_new_tokens=args.new + 1, do_sample=False, pad_token_id=0, logits_processor=[stamp])

        if method == "dynamic":
            generate()
        else:
            with gear_hf.enabled(model, configs[method]):
                generate()
                paths[method].update(gear_hf.last_cache(model).step_paths)  # decode layer-steps per attention path
        return (stamp.times[-1] - stamp.times[0]) * 1000 / args.new  # the decode steps after the prompt's token

    configs = {m: benchlib.gear_config(m) for m in methods[1:]}  # (a bad name exits here, with the reason)
    paths = {m: Counter() for m in methods[1:]}
    cond = benchlib.Conditions(extra={"model": "SmolLM2-135M shapes, random weights", "dtype": "float32", "T": args.T,
                                      "new_tokens": args.new, "repeats": args.repeats, "clock": args.clock})
    benchlib.print_conditions(cond)
    warm = torch.randint(3, 49000, (1, args.T))
    warmups = {}
    for m in methods:  # untimed, so that no timed run includes kernel compilation (numba / Triton, first use)
        warmups[m] = benchlib.warm_up(model, warm, m).seconds
    if gear_hf.is_enabled(model):  # (warm_up leaves the last method enabled; decode_ms enables each one itself)
        gear_hf.disable(model)
    print("warm-up: " + ", ".join(f"{m} {s:.1f}s" for m, s in warmups.items()), flush=True)
    best = {}
    for batch, padded in ((1, False), (4, False), (4, True)):
        ids = torch.randint(3, 49000, (batch, args.T))
        mask = torch.ones_like(ids)
        if padded:
            for row in range(batch):
                mask[row, : row * 37] = 0
        runs = [{m: decode_ms(ids, mask, m) for m in methods} for _ in range(args.repeats)]  # methods interleaved
        best[batch, padded] = {m: min(run[m] for run in runs) for m in methods}
        print(f"batch {batch}{' padded' if padded else ''}: "
              + ", ".join(f"{m} {ms:.1f} ms/step" for m, ms in best[batch, padded].items()), flush=True)
    rows = ["| batch | " + " | ".join(f"{m} ms/step (x DynamicCache)" for m in methods) + " |",
            "|---|" + "--:|" * len(methods)]
    for (batch, padded), ms in best.items():
        rows.append(f"| {batch}{' padded' if padded else ''} | "
                    + " | ".join(f"{ms[m]:.1f} ({ms['dynamic'] / ms[m]:.2f}x)" for m in methods) + " |")
    rows.append("| 4 padded / 4 | " + " | ".join(f"{best[4, True][m] / best[4, False][m] - 1:+.1%}" for m in methods)
                + " |")
    rows.append("| fused share of decode layer-steps | – | " + " | ".join(
        f"{paths[m]['fused'] / max(1, sum(paths[m].values())):.0%}" for m in methods[1:]) + " |")
    body = (f"T={args.T} prompt tokens (the padded batch: row r with 37*r of them padding), {args.new} new tokens, "
            f"greedy; {args.clock} time; minimum of {args.repeats} interleaved runs, after one untimed warm-up generate "
            f"per method (seconds, kernel compilation included: "
            + ", ".join(f"{m} {s:.1f}" for m, s in warmups.items()) + ").\n\n" + "\n".join(rows))
    out = benchlib.Path(args.out) / "decode-padded.md"
    benchlib.write_summary(out, "Decode ms/step, padded and unpadded batches", cond.finish(), body)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
