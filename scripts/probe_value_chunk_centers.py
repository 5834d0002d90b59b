"""Probe (issue 25, session 31): would the value HISTORY lose less centered per channel, as the value buffer is?
Values are quantized per token (after the rotation), so a per-channel offset constant over tokens (Qwen2's v_proj bias)
widens every token's range in the compressed chunks as it did in the buffer. Here the value stream's chunks (prompt and
decode) are compressed from x - c and read back + c, c [B,H,1,d] the mean of the prompt chunk's values per channel
(rounded to the model's dtype), fitted when the prompt chunk is compressed. Attention is linear in the values and its
weights sum to one, so a kernel could read every value centered and add c to its output once: no per-token cost.

A simulation on the torch path: c (d x 16 bits per head and row) is not counted in the bits (the value buffer's own
centers, d + 2 bytes, already are); no kernel reads it. Batch 1.

    python probe_value_chunk_centers.py --model qwen25 --text 30 [--choose] \
        --out ../results/tail/centered/value-history-probe/mean   # (--configs e96+k3+cv, the default: version 9's)
"""

from __future__ import annotations

import argparse
import sys
import time

import bench_tail
import benchlib
import torch

from gear_hf.cache.stream import Stream
from gear_hf.compress import compress, decompress
from gear_hf.storage import ChunkStore

CHOOSE = False  # --choose
PER_HEAD = False  # --per-head
_ORIGINAL = {"_leave": Stream._leave, "reconstruct": ChunkStore.reconstruct}


def _patch() -> None:
    def _leave(self, store, rows, starts, length, slots, batch, reserve, query_energy, limit=None):
        if self.kind == "value":
            store.probe_stream = self
            if not hasattr(store, "probe_alpha"):
                store.probe_alpha = {}  # chunk slot -> [H, n] per-token centering (1) or not (0), row 0
        return _ORIGINAL["_leave"](self, store, rows, starts, length, slots, batch, reserve, query_energy, limit)

    def compress_rows(self, x, rows, chunks, batch, reserve_chunks, channel_bits=None, limit=None):
        stream = getattr(self, "probe_stream", None)
        if stream is not None:
            if set(rows) != {0}:
                raise ValueError("the value-history centering probe runs batch 1")
            if getattr(stream, "probe_center", None) is None:
                stream.probe_center = x.float().mean((0, 2), keepdim=True).to(x.dtype)  # [1,H,1,d]
                if PER_HEAD:  # a head keeps its center only where the prompt's values read back closer with it
                    errors = []
                    for candidate in (x, x - stream.probe_center):
                        read = decompress(compress(candidate, self.spec), self.spec, x.shape[2], x.shape[3],
                                          torch.float32)
                        errors.append((read - candidate.float()).pow(2).sum((0, 2, 3)))  # [H]
                    keep = (errors[1] < errors[0]).to(x.dtype)[None, :, None, None]
                    stream.probe_center = stream.probe_center * keep
            centered = x - stream.probe_center.to(x.dtype)
            if CHOOSE:  # per token and head, whichever of x and x - c reads back closer (alpha 1: centered)
                errors = []
                for candidate in (x, centered):
                    read = decompress(compress(candidate, self.spec), self.spec, x.shape[2], x.shape[3], torch.float32)
                    errors.append((read - candidate.float()).pow(2).sum(-1))  # [J,H,n]
                alpha = (errors[1] < errors[0]).to(x.dtype)  # [J,H,n]
                centered = x - alpha[..., None] * stream.probe_center.to(x.dtype)
                for j, chunk in enumerate(chunks):
                    self.probe_alpha[chunk] = alpha[j]
            else:
                for chunk in chunks:
                    self.probe_alpha[chunk] = torch.ones(x.shape[1], x.shape[2], dtype=x.dtype)
            x = centered
        return _ORIGINAL_COMPRESS(self, x, rows, chunks, batch, reserve_chunks, channel_bits, limit)

    def reconstruct(self, chunks, out_dtype, out=None, rotary=None, scratch=None):
        result = _ORIGINAL["reconstruct"](self, chunks, out_dtype, out, rotary, scratch)
        stream = getattr(self, "probe_stream", None)
        if stream is not None and result.numel():
            n = self.chunk_len
            alpha = torch.zeros(result.shape[1], result.shape[2], dtype=result.dtype)
            for chunk in range(chunks):
                a = self.probe_alpha.get(chunk)
                if a is not None:
                    alpha[:, chunk * n : chunk * n + a.shape[1]] = a
            result.add_(alpha[None, :, :, None] * stream.probe_center.to(result.dtype))
        return result

    Stream._leave, ChunkStore.compress_rows, ChunkStore.reconstruct = _leave, compress_rows, reconstruct


_ORIGINAL_COMPRESS = ChunkStore.compress_rows


def _restore() -> None:
    Stream._leave, ChunkStore.reconstruct = _ORIGINAL["_leave"], _ORIGINAL["reconstruct"]
    ChunkStore.compress_rows = _ORIGINAL_COMPRESS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen25")
    parser.add_argument("--text", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--configs", default="e96+k3+cv")  # (config version 9's GearConfig(): chunks not centered)
    parser.add_argument("--out", default="../results/tail/centered/value-history-probe")
    parser.add_argument("--choose", action="store_true", help="center each token only where it reads back closer")
    parser.add_argument("--per-head", action="store_true", help="center only the heads whose prompt reads back closer")
    args = parser.parse_args(argv)
    global CHOOSE, PER_HEAD
    CHOOSE, PER_HEAD = args.choose, args.per_head

    import gear_hf
    from gear_hf.cache import GearCache

    model, ids, reference = bench_tail.teacher_forced(args.model, "bfloat16", args.text, args.prompt, args.steps)
    rows = []
    for name in args.configs.split(","):
        config = bench_tail.config_of(name).replace(backend="torch")
        for centered in (False, True):
            started = time.perf_counter()
            gear_hf.enable(model, config)
            cache = GearCache(model, config)
            if centered:
                _patch()
            try:
                logits, bits = bench_tail.run(model, ids, args.prompt, cache)
            finally:
                _restore()
                gear_hf.disable(model)
            rows.append({"config": name, "text": args.text, "history_centered": centered, "choose": CHOOSE,
                         "per_head": PER_HEAD, **bench_tail.agreement(reference, logits),
                         "mean_owned_not_counting_center": sum(bits) / len(bits),
                         "seconds": round(time.perf_counter() - started)})
            print(rows[-1], flush=True)
            suffix = ("-choose" if CHOOSE else "") + ("-per-head" if PER_HEAD else "")
            benchlib.write_csv(benchlib.Path(args.out) / f"{args.model}-t{args.text}{suffix}.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
