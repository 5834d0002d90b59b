"""A probe, not a format: would a cheaper key buffer keep GearConfig()'s KL? (issue 25, "<= 3.6 bits at every step")

GearConfig() holds its newest keys at 8 bits per token (+ a 16-bit scale and minimum: 8.5 bits/element on d=64);
that buffer is what lifts it to 3.83 bits at a full buffer. Before building a cheaper key tail into every backend,
this measures what its rounding would cost where it is consumed: the next-token KL vs DynamicCache on real weights.

How (a SIMULATION of the candidate tail's error, labelled as such; nothing here is stored at fewer bits): the config
runs on the torch backend, whose buffer is encoded by `CodedTokenStore.encode` (the oracle). The probe wraps that
encode for the key buffer: each key vector is first rounded as the candidate format would round it (quantized and
dequantized in float32), then stored in the real 8-bit buffer, whose own rounding is ~16x finer than a 4-bit one's.
So the buffered keys carry the candidate's error when attended and when their chunk is compressed from them, as a real
candidate buffer would. The bits a candidate would own are computed, not measured: the report's bits minus
(8 - b) bits for every buffered key element (its scale and minimum stay 16-bit; per-channel scales of the "n"
variants, 16 bits x head_dim per row and head, are not counted: < 0.001 bit here).

Candidates (per key vector of head_dim channels, before RoPE, as the buffer stores them):
  int8        the real buffer (the baseline of this run: same backend, same texts)
  kB          B bits per token, min/max range (B = 4, 5, 6)
  kBn         B bits per token after dividing each channel by a per-(row, head) channel scale: the channel's
              absolute maximum over the first keys the buffer encodes (the prompt's leftover tokens), clamped at
              1e-3 of the largest (keys' outlier channels are fixed per channel: KIVI); multiplied back after
  kBnr        kBn with the normalised vector rotated by the Walsh–Hadamard matrix before rounding

    GEAR_HF_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/probe_key_tail.py \
        --texts 0 1 200 --candidates int8,k4n,k5n,k6
"""

from __future__ import annotations

import sys
import time

import benchlib
import torch
from bench_tail import run
from benchlib import probe


def _round_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., d] quantized per vector (min/max range, 2^bits levels) and dequantized, float32."""
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
    return torch.round((x - lo) / scale).clamp(0, 2**bits - 1) * scale + lo


def candidate(name: str):
    """A function (store, x [N,H,1,d] keys) -> x rounded as candidate `name` would round it."""
    if name == "int8":
        return None
    bits = int(name[1])
    normalise, rotate = "n" in name[2:], name.endswith("r")
    scales: dict[int, torch.Tensor] = {}

    def rounded(store, x: torch.Tensor) -> torch.Tensor:
        from gear_hf.compress.rotation import rotate as hadamard  # (its own inverse)

        y = x.float()
        if normalise:
            if id(store) not in scales:  # the first keys this store encodes: [N, H, 1, d] -> [H, d]
                s = y.abs().amax(dim=(0, 2))
                scales[id(store)] = s.clamp_min(1e-3 * s.amax(-1, keepdim=True))[None, :, None, :]
            y = y / scales[id(store)]
        if rotate:
            y = hadamard(y)
        y = _round_per_token(y, bits)
        if rotate:
            y = hadamard(y)
        if normalise:
            y = y * scales[id(store)]
        return y.to(x.dtype)

    rounded.bits = bits
    return rounded


def main(argv=None) -> int:
    args, names = probe.parse_probe_args(__doc__, "int8,k4n,k5n,k6", "probe-key-tail", argv)
    from gear_hf import GearConfig
    from gear_hf.coded_store import CodedTokenStore
    from gear_hf.format import INT8_TOKENS

    for n in names:
        if n != "int8" and not (len(n) >= 2 and n[0] == "k" and n[1] in "2345678" and n[2:] in ("", "n", "nr", "r")):
            raise SystemExit(f"--candidates: {n!r} is not int8 or kB[n][r] with B in 2..8 (e.g. k4n, k5nr, k6)")
    cond, model, tokenizer = probe.start(args, "candidate key rounding applied before the real 8-bit buffer")
    config = GearConfig(backend="torch")  # the oracle encodes the buffer (the probe wraps its encode)
    encode = CodedTokenStore.encode
    rows = []
    for text, ids, reference in probe.texts_with_reference(run, model, tokenizer, args):
        for name in names:
            started = time.perf_counter()
            rounding = candidate(name)

            def probed(store, x, rounding=rounding):
                if rounding is not None and store.spec == INT8_TOKENS:  # the key buffer (values are int4)
                    x = rounding(store, x)
                return encode(store, x)

            key_tail = []  # (key-buffer elements, key + value elements held) after each decode step
            CodedTokenStore.encode = probed
            try:
                logits, bits = probe.run_enabled(run, model, ids, args.prompt, config, lambda c, report:
                                                 key_tail.append((buffered_key_elements(c), report["elements"])))
            finally:
                CodedTokenStore.encode = encode
            # what a candidate of b bits would own: the key buffer's elements at b instead of 8 bits
            b = rounding.bits if rounding is not None else 8
            owned = [bits_i - (8 - b) * n / elements for bits_i, (n, elements) in zip(bits, key_tail)]
            rows.append(probe.result_row(text, name, rounding is not None, owned, reference, logits, started))
            print(rows[-1], flush=True)
            benchlib.write_csv(benchlib.Path(args.out) / "probe.csv", rows)
    description = (
        "SmolLM2-135M-Instruct bf16, GearConfig(backend='torch'); per text (GSM8K test problem N's 8-shot CoT prompt "
        f"+ worked answer, its last {args.prompt + args.steps} tokens): {args.prompt} at prefill, {args.steps} "
        "teacher-forced one per step. KL(DynamicCache || config) of the next-token distribution. **Simulated**: "
        "every candidate but int8 rounds the buffered keys as it would, then stores them in the real 8-bit buffer; "
        "its bits are the report's minus (8 - b) per buffered key element (computed, not held).")
    probe.finish(args, cond, rows, "Probe: a cheaper key buffer (simulated rounding)", description, "key buffer")
    return 0


def buffered_key_elements(cache) -> int:
    """The 8-bit key buffer's codes (one byte an element) across layers, read from the cache's own stores."""
    return sum(layer.key_stream.buffer.fields["codes"].numel() for layer in cache.layers
               if hasattr(layer, "key_stream") and layer.key_stream.buffer.fields)


if __name__ == "__main__":
    sys.exit(main())
