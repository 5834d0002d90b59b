"""What torch.compile of the model's forward costs and buys on CPU, side by side with eager, in one process (first
generate seconds, decode CPU ms/step, graph breaks). Prints a Markdown table; writes nothing.

    OMP_NUM_THREADS=1 python scripts/bench_compile.py                          # eager + inductor backends
    OMP_NUM_THREADS=1 python scripts/bench_compile.py --backends eager --new 8

A SmolLM2-135M-shaped Llama with random weights (30 layers, 9 heads / 3 KV heads, head_dim 64; no weights needed),
float32, one row, a --T-token prompt, greedy, exactly --new tokens. Per cache (DynamicCache, gear_hf fp16 preset,
GearConfig()) and per mode (eager, then `model.forward = torch.compile(model.forward, backend=...)`): the first
generate (compiled: includes dynamo tracing and the backend's compilation), then decode tokens/s (wall) and CPU
ms/step (time.process_time; what other jobs on a shared machine do not inflate) of a second, warm generate (steps
after the first logits; the prompt step excluded); "vs eager" compares CPU ms/step. The compiled runs must give the eager run's
tokens. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import gear_hf

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class StepClock(LogitsProcessor):
    """Wall and process CPU timestamps of each step's logits: the decode clock starts at the prompt step's logits.
    CPU time (one thread) is what a shared machine's other jobs do not inflate."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())
        return scores

    def decode_tokens_per_s(self) -> float:
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def decode_cpu_ms_per_step(self) -> float:
        return 1000.0 * (self.cpu_times[-1] - self.cpu_times[0]) / (len(self.cpu_times) - 1)


def generate(model, ids, new: int):
    clock = StepClock()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([clock]))
    return out, time.perf_counter() - start, clock


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--new", type=int, default=16, help="new tokens (default 16)")
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor"])
    parser.add_argument("--caches", nargs="+", default=["dynamic", "fp16", "default"])
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), T={args.T}, {args.new} new tokens")
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (1, args.T), generator=torch.Generator().manual_seed(0))
    rows = []
    for cache in args.caches:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
        model.generation_config.eos_token_id = None
        if cache != "dynamic":
            gear_hf.enable(model, gear_hf.GearConfig.preset("fp16") if cache == "fp16" else gear_hf.GearConfig())
        eager_forward = model.forward
        first_tokens, first_s, _ = generate(model, ids, args.new)  # numba kernels load (or compile) once here
        tokens, _, eager_clock = generate(model, ids, args.new)
        eager_ms = eager_clock.decode_cpu_ms_per_step()
        rows.append((cache, "eager (no compile)", first_s, eager_clock.decode_tokens_per_s(), eager_ms, 1.0, True))
        for backend in args.backends:
            torch._dynamo.reset()
            model.forward = torch.compile(eager_forward, backend=backend, fullgraph=False)
            compiled_tokens, compile_s, _ = generate(model, ids, args.new)
            compiled_tokens, _, clock = generate(model, ids, args.new)
            ms = clock.decode_cpu_ms_per_step()
            rows.append((cache, f"compile {backend}", compile_s, clock.decode_tokens_per_s(), ms, eager_ms / ms,
                         torch.equal(compiled_tokens, tokens)))
            print(rows[-1], flush=True)
        model.forward = eager_forward
    print("\n| cache | mode | first generate s | decode tok/s (wall) | decode CPU ms/step | speed vs eager (CPU) "
          "| same tokens |")
    print("|---|---|---|---|---|---|---|")
    for cache, mode, first_s, tps, ms, ratio, same in rows:
        print(f"| {cache} | {mode} | {first_s:.1f} | {tps:.1f} | {ms:.1f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
