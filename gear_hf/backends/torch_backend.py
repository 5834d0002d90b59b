"""The torch backend: the oracle (`gear_hf.compress`), on any device; every other backend is checked against it."""

from __future__ import annotations

from ..compress import compress, decompress
from ..compress.rope import apply_rotary
from .base import Backend


class TorchBackend(Backend):
    name = "torch"
    ops = ("compress", "reconstruct")  # attention: the model's own function over the reconstruction

    def compress(self, spec, x, channel_bits):
        return compress(x, spec, channel_bits=channel_bits)

    def reconstruct(self, store, chunks, out_dtype, out=None, rotary=None, scratch=None):
        run = store.run(chunks)
        if rotary is None:
            return decompress(run, store.spec, store.chunk_len, store.head_dim, out_dtype, chunks=chunks, out=out)
        x = decompress(run, store.spec, store.chunk_len, store.head_dim, out_dtype, chunks=chunks, out=scratch)
        return apply_rotary(x, *rotary, out=out)

    def rotate(self, x, cos, sin, out, scratch=None):
        return apply_rotary(x, cos, sin, out=out, scratch=scratch)
