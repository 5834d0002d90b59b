"""Which part of a coded buffer costs next-token KL: the newest tokens read from it, or the chunks compressed from its
codes (session 22, results/tail/qwen-gap/recent/). A diagnostic, not a format: nothing it hands the attention is
counted in any bits.

The cache is a real GearCache on the torch path (everything stored and compressed as usual) whose reads hand the
attention the EXACT keys of the newest --exact-keys tokens and the exact values of the newest --exact-values tokens
(the rest as the cache holds them). The newest N tokens are the newest N whatever holds them: under "steady" (a
64-token key buffer) 64 exact keys make every buffered key exact AND, while the buffer holds fewer than 64, the
newest decode chunk's newest keys (session 26: that part is most of what it changes). "b" as the count of exact keys
makes exactly the key buffer's tokens exact (its chunks still compressed from its 8-bit rotated codes; compare
s+kbuf16: both exact). 128 exact values: the value buffer's reads (newest + held chunk, int4) exact while the held
chunk is still compressed from its 4-bit codes (compare s+vbuf8r). --chunk-bits reads the newest --chunks decode
chunks of keys at other widths instead (a per-channel min/max quantization of the exact keys, one group per chunk:
the stored format with more bits). Teacher forced one token per step as bench_tail.

    python qwen_gap_recent.py --model qwen25 --text 1 --config steady --pairs 0:0,64:0,0:128,8:8 \
        --out ../results/tail/qwen-gap/recent
    python qwen_gap_recent.py --model qwen25 --text 0 --chunk-bits +1 --pairs 0:0,b:0 --out ...
"""

from __future__ import annotations

import argparse
import sys
import time

import bench_tail
import benchlib
import torch

from gear_hf.cache import GearCache


class RecentExact(GearCache):
    """A GearCache whose reads hand the attention the exact newest `exact_keys` keys / `exact_values` values."""

    def __init__(self, model, gear_config, exact_keys, exact_values, layers=None, chunk_bits: str = "",
                 chunks: int = 1) -> None:
        super().__init__(model, gear_config)
        self.exact_keys, self.exact_values = exact_keys, exact_values
        # chunk_bits (--chunk-bits): the newest `chunks` decode chunks of keys read at this many bits instead
        self.chunk_bits, self.chunks = chunk_bits, chunks
        self.exact_layers = layers  # None: every layer
        self._exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def read(self, layer_idx, key_states, value_states):
        keys, values = super().read(layer_idx, key_states, value_states)
        if self.exact_layers is not None and layer_idx not in self.exact_layers:
            return keys, values
        if layer_idx in self._exact:
            k, v = self._exact[layer_idx]
            key_states, value_states = torch.cat([k, key_states], 2), torch.cat([v, value_states], 2)
        self._exact[layer_idx] = (key_states, value_states)
        keys, values = keys.clone(), values.clone()
        for out, exact, n in ((keys, key_states, self.exact_keys), (values, value_states, self.exact_values)):
            n = min(self.layout.plan.attend.buffer[0] if n == "b" else n, out.shape[2])  # "b": the buffer's tokens
            if n:
                out[:, :, -n:] = exact[:, :, -n:].to(out.dtype)
        if self.chunk_bits:
            self._requantize_newest_chunks(keys, key_states, self.layers[layer_idx].streams[0].channel_bits)
        return keys, values

    def _requantize_newest_chunks(self, keys, exact, channel_bits) -> None:
        """keys [1,H,T,d] (before RoPE, sink/prompt/chunks/buffer order): the newest `chunks` decode chunks replaced
        by a per-channel min/max quantization of the exact keys at `chunk_bits`, one group per chunk (the stored
        format's axis and grouping, more bits)."""
        counts, n = self.layout.plan.attend, self.gear_config.buffer_size
        if len(counts.buffer) != 1:
            raise ValueError("the newest-chunk probe runs batch 1")
        if not counts.chunks[0]:  # (nor widths allocated yet)
            return
        width = torch.tensor(float(self.chunk_bits))
        if self.chunk_bits.startswith("+"):  # each channel's allocated width (key_bit_allocation="query") + this
            if channel_bits is None:
                raise ValueError(f"--chunk-bits {self.chunk_bits}: the config allocates no key widths (needs "
                                 "key_bit_allocation='query'); give a number of bits instead")
            width = channel_bits[0].float()[None, :, None, :] + int(self.chunk_bits)  # [1,H,1,d]
        end = keys.shape[2] - counts.buffer[0]
        for c in range(min(self.chunks, counts.chunks[0])):
            lo, hi = end - (c + 1) * n, end - c * n
            x = exact[:, :, lo:hi].float()  # [1,H,n,d]
            low, high = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
            scale = ((high - low) / (2 ** width - 1)).clamp_min(1e-8)
            keys[:, :, lo:hi] = (torch.round((x - low) / scale) * scale + low).to(keys.dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen25")
    parser.add_argument("--text", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--config", default="steady")
    parser.add_argument("--pairs", default="0:0,64:0,0:128", help="exact keys:exact values, comma separated "
                        "(b: the tokens in the buffer)")
    parser.add_argument("--layers", default="", help="comma list of layers the exact reads apply to (default: all)")
    parser.add_argument("--chunk-bits", default="", help="read the newest --chunks decode chunks of keys at this "
                        "many bits (per channel, one group per chunk; '+1': each channel's allocated width + 1; "
                        "empty: as stored)")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--out", default="../results/tail/qwen-gap/recent")
    args = parser.parse_args(argv)

    import gear_hf

    model, ids, reference = bench_tail.teacher_forced(args.model, "bfloat16", args.text, args.prompt, args.steps)
    config = bench_tail.config_of(args.config).replace(backend="torch")
    layers = {int(x) for x in args.layers.split(",")} if args.layers else None
    tag = f"-layers{args.layers.replace(',', '_')}" if args.layers else ""
    if args.chunk_bits:
        tag += f"-newest{args.chunks}chunks{args.chunk_bits.replace('+', 'plus')}bit"
    rows = []
    for pair in args.pairs.split(","):
        nk, nv = (x if x == "b" else int(x) for x in pair.split(":"))
        started = time.perf_counter()
        gear_hf.enable(model, config)
        logits, bits = bench_tail.run(model, ids, args.prompt, RecentExact(model, config, nk, nv, layers,
                                                                            args.chunk_bits, args.chunks))
        gear_hf.disable(model)
        rows.append({"config": args.config, "text": args.text, "layers": args.layers or "all", "exact_keys": nk, "exact_values": nv,
                     "newest_key_chunks": args.chunks if args.chunk_bits else 0, "their_bits": args.chunk_bits,
                     **bench_tail.agreement(reference, logits),
                     "mean_owned_not_counting_exact": sum(bits) / len(bits),
                     "seconds": round(time.perf_counter() - started)})
        print(rows[-1], flush=True)
        benchlib.write_csv(benchlib.Path(args.out) / f"{args.model}-t{args.text}-{args.config}{tag}.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
