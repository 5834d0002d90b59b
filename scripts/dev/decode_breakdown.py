"""Where a decode step's time goes: a gear_hf configuration (--config, default GearConfig()) against DynamicCache,
microseconds per layer and step.

    OMP_NUM_THREADS=1 python scripts/dev/decode_breakdown.py --dtype float32 --T 1000
    OMP_NUM_THREADS=1 python scripts/dev/decode_breakdown.py --config kivi-2 --dtype bfloat16 --batch 4 --padded

SmolLM2 real weights, --batch rows of --T tokens (--padded: row b left-padded by 37*b columns), --new greedy tokens,
1 torch thread, each cache twice (alternating; the first of each warms up). The cache's entry points (store, fused attention and its parts, compress_pending, and the coded buffer's steps inside them), the attention kernel and
the model's layers are wrapped with timers that count decode steps only (from the first logits on); a nested entry is
indented under the one that calls it. Timers add a few microseconds per call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402
import torch  # noqa: E402
import transformers.models.llama.modeling_llama as llama  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402

import gear_hf  # noqa: E402
from gear_hf import attention  # noqa: E402
from gear_hf.cache.channel_centers import ChannelCenters  # noqa: E402
from gear_hf.cache.coded_store import CodedTokenStore  # noqa: E402
from gear_hf.cache.gear_cache import GearCache  # noqa: E402
from gear_hf.cache.held import HeldChunkPlans  # noqa: E402
from gear_hf.cache.layout import RowLayout  # noqa: E402
from gear_hf.cache.stream import Stream  # noqa: E402
from gear_hf.kernels import cpu  # noqa: E402
from gear_hf.kernels.cpu import attend  # noqa: E402
from gear_hf.measure import StepClock  # noqa: E402

# (owner, attribute, label), in call order; a label's indent shows the entry that calls it
TIMED = [(attention, "cache_step", "cache_step"), (attention, "apply_rotary", "  apply_rotary (query)"),
         (GearCache, "store", "  store"), (Stream, "append", "    Stream.append"),
         (CodedTokenStore, "reserve", "      CodedTokenStore.reserve (the buffer grown)"),
         (CodedTokenStore, "write_run", "      CodedTokenStore.write_run (staged)"),
         (HeldChunkPlans, "_capacities", "      _capacities (held chunk)"), (GearCache, "use_fused", "  use_fused"),
         (GearCache, "fused_attention", "  fused_attention"), (GearCache, "kernel_views", "    kernel_views"),
         (Stream, "kernel_view", "      Stream.kernel_view"), (CodedTokenStore, "kernel_tail", "        kernel_tail"),
         (ChannelCenters, "normalized", "        ChannelCenters.normalized"),
         (RowLayout, "kernel_inputs", "      RowLayout.kernel_inputs"),
         (cpu, "decode_attention", "    decode_attention"), (attend, "_stream_runs", "      _stream_runs"),
         (attend, "_tail_args", "      _tail_args"), (attend, "_attend", "      _attend (the kernel)"),
         (GearCache, "compress_pending", "  compress_pending"), (Stream, "flush", "    Stream.flush"),
         (CodedTokenStore, "end_step", "      CodedTokenStore.end_step (encode)"),
         (HeldChunkPlans, "_own_flush", "      _own_flush (held chunk)"),
         (llama.LlamaAttention, "forward", "attention (stock)"), (llama.LlamaMLP, "forward", "MLP")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--T", type=int, default=1000)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--config", default="balanced",
                        help="a recommended name or a preset (GearConfig.recommended / preset); default: GearConfig()")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--padded", action="store_true", help="left-pad row b by 37*b columns (masked out)")
    args = parser.parse_args(argv)
    try:
        config = gear_hf.GearConfig.preset(args.config)
    except ValueError as not_preset:
        try:
            config = gear_hf.GearConfig.recommended(name=args.config)
        except ValueError as not_recommended:
            parser.error(f"--config: {not_preset}; {not_recommended}")
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model, tokenizer = benchlib.load_model("smollm2", args.dtype)
    model.generation_config.eos_token_id = None
    ids = benchlib.fixed_length_batch(tokenizer, [p.prompt for p in benchlib.gsm8k_prompts(args.batch)], args.T,
                                      args.batch)
    mask = torch.ones_like(ids)
    if args.padded:
        for row in range(args.batch):
            ids[row, : 37 * row], mask[row, : 37 * row] = 0, 0
    seconds, calls, timing = collections.defaultdict(float), collections.defaultdict(int), [False]

    def timer(function, label):
        @functools.wraps(function)  # (keeps the signature: gear_hf reads the attention forward's parameters)
        def timed(*a, **k):
            if not timing[0]:
                return function(*a, **k)
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
        return timed

    for owner, name, label in TIMED:
        setattr(owner, name, timer(getattr(owner, name), label))

    class DecodeOnly(StepClock):
        def __call__(self, input_ids, scores):
            timing[0] = True
            return super().__call__(input_ids, scores)

    layers = model.config.num_hidden_layers
    for method in ("gear", "dynamic", "gear", "dynamic"):
        seconds.clear(), calls.clear()
        timing[0] = False
        if method == "gear":
            gear_hf.enable(model, config)
        elif gear_hf.is_enabled(model):
            gear_hf.disable(model)
        clock = DecodeOnly()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                       min_new_tokens=args.new, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
        steps = len(clock.times) - 1
        print(f"{args.config if method == 'gear' else method}: median decode step {1e3 * statistics.median(clock.step_seconds()):.1f} ms "
              f"({steps} steps, SmolLM2 {args.dtype}, T={args.T}, batch {args.batch}{' padded' if args.padded else ''}, "
              "1 thread)")
        for label in [label for _, _, label in TIMED if label in seconds]:
            print(f"  {label:46s} {1e6 * seconds[label] / steps / layers:8.1f} us per layer and step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
