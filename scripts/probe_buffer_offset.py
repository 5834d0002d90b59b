"""Probe (issue 25, Qwen2.5's KL gap): would the coded buffer lose less if each channel's offset were taken out before a
token is encoded? Qwen2.5's keys (and values) carry a per-channel bias: constant over tokens, large on a few
channels, so one range per token over the (rotated) head vector is set by it. Here each coded buffer store subtracts a
per-(head, channel) offset before encoding and adds it back when decoding: the mean of the first tokens it encodes
(the prompt's tail that stays buffered), rounded to the model's dtype. Batch 1 only (one offset per head).

A simulation on the torch path: the offset (d x 16 bits per head and stream, ~0.015 bit/element at T=1k) is not
counted in the bits, no kernel reads it.

    python probe_buffer_offset.py --model qwen25 --text 1 --configs steady --streams none,keys,values,both \
        --out ../results/tail/qwen-gap/offset
"""

from __future__ import annotations

import argparse
import sys
import time

import bench_tail
import benchlib
import torch

from gear_hf.coded_store import CodedTokenStore
from gear_hf.compress import compress

NORMALIZE = False  # --normalize
_ORIGINAL = {name: getattr(CodedTokenStore, name) for name in ("encode", "_decode", "end_step")}


def _patch(streams: set[str]) -> None:
    """Offsets on the coded buffers of `streams` ("keys", "values"); the store tells which it is by its spec."""
    def wanted(store):
        return getattr(store, "stream", None) in streams

    def end_step(self, kept=None):
        if wanted(self) and getattr(self, "offset", None) is None and self.staged is not None:
            exact, written = self.staged
            if exact.shape[0] != 1:
                raise ValueError("the offset probe runs batch 1")
            columns = written[0].nonzero().flatten()
            if columns.numel():
                first = exact[0][:, columns].float()  # [H,n,d]
                self.offset = first.mean(1).to(exact.dtype)[None, :, None]  # [1,H,1,d]
                if NORMALIZE:  # each channel also divided by its spread over those tokens (a power of two)
                    spread = (first - self.offset[0].float()).abs().amax(1).clamp_min(1e-6)  # [H,d]
                    self.spread = torch.exp2(torch.ceil(torch.log2(spread)))[None, :, None].to(exact.dtype)
        return _ORIGINAL["end_step"](self, kept)

    def encode(self, x):
        offset = getattr(self, "offset", None)
        if offset is not None:
            x = x - offset.to(x.dtype)
            if getattr(self, "spread", None) is not None:
                x = x / self.spread.to(x.dtype)
        return compress(x, self.spec)

    def _decode(self, chunk, n, dtype, out=None, rows=None):
        decoded = _ORIGINAL["_decode"](self, chunk, n, dtype, rows=rows)
        offset = getattr(self, "offset", None)
        if offset is not None and n:
            if getattr(self, "spread", None) is not None:
                decoded = decoded * self.spread.to(decoded.dtype)
            decoded = decoded + offset.to(decoded.dtype)
        return decoded if out is None else out.copy_(decoded)

    CodedTokenStore.end_step, CodedTokenStore.encode, CodedTokenStore._decode = end_step, encode, _decode


def _restore() -> None:
    for name, fn in _ORIGINAL.items():
        setattr(CodedTokenStore, name, fn)


def _label_streams(cache) -> None:
    for layer in cache.layers:
        for name, stream in zip(("keys", "values"), layer.streams):
            stream.buffer.stream = name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen25")
    parser.add_argument("--text", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--configs", default="steady")
    parser.add_argument("--streams", default="none,keys,values,both")
    parser.add_argument("--normalize", action="store_true", help="also divide each channel by its spread")
    parser.add_argument("--out", default="../results/tail/qwen-gap/offset")
    args = parser.parse_args(argv)
    global NORMALIZE
    NORMALIZE = args.normalize

    import gear_hf
    from gear_hf.cache import GearCache

    model, ids, reference = bench_tail.teacher_forced(args.model, "bfloat16", args.text, args.prompt, args.steps)
    rows = []
    for name in args.configs.split(","):
        config = bench_tail.config_of(name).replace(backend="torch")
        for which in args.streams.split(","):
            streams = {"none": set(), "keys": {"keys"}, "values": {"values"}, "both": {"keys", "values"}}[which]
            started = time.perf_counter()
            gear_hf.enable(model, config)
            cache = GearCache(model, config)
            _patch(streams)
            original_reserve = CodedTokenStore.reserve

            def reserve(self, like, capacity, _cache=cache):
                _label_streams(_cache)
                return original_reserve(self, like, capacity)

            CodedTokenStore.reserve = reserve
            try:
                logits, bits = bench_tail.run(model, ids, args.prompt, cache)
            finally:
                CodedTokenStore.reserve = original_reserve
                _restore()
                gear_hf.disable(model)
            rows.append({"config": name, "text": args.text, "offset_on": which, "normalized": args.normalize,
                         **bench_tail.agreement(reference, logits),
                         "mean_owned_not_counting_offset": sum(bits) / len(bits),
                         "seconds": round(time.perf_counter() - started)})
            print(rows[-1], flush=True)
            benchlib.write_csv(benchlib.Path(args.out) / f"{args.model}-t{args.text}{'-norm' if args.normalize else ''}.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
