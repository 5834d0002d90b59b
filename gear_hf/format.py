"""`StreamFormat`: what one stream (a layer's keys or its values) stores, built once from a `GearConfig`.

A stream stores one prompt chunk per row and decode chunks of `buffer_size` tokens, and its newest tokens in a buffer
(full precision, or a per-token `tail` format: `GearConfig.key_buffer` / `value_buffer`); each has a `ChunkSpec`, whose
terms (`gear_hf.compress.terms`: backbone, outliers, low-rank, rotation, and any registered extra term) declare
the fields the storage allocates, the memory report counts and the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compress import ChunkSpec, side_dtype
from .compress.terms import Field, active_terms, chunk_fields
from .config.advanced import release_after


@dataclass(frozen=True)
class StreamFormat:
    stream: str  # "key" or "value"
    prompt: ChunkSpec  # the prompt chunk (rank_prefill, prompt groups)
    decode: ChunkSpec  # each decode chunk (rank_decode)
    chunk_len: int  # tokens per decode chunk (buffer_size)
    tail: ChunkSpec | None = None  # how the buffer stores each token (per token), None: in the model's dtype
    # the row's newest decode chunk stays at the buffer's front, in the tail format, until `release_after` newer
    # tokens are buffered after it (GearConfig.value_buffer_size / key_buffer_size, held_for; chunk_len: until the next
    # chunk flushes): while it is held the row's decode chunks lag the layout's by one
    held_chunk: bool = False
    release_after: int = 0
    centered: bool = False  # the tail codes each token centered per channel (keys: and scaled; `channel_centers`)
    chunks_centered: bool = False  # (values, a centered tail) the chunks are coded by the tail's centers too

    @property
    def specs(self) -> tuple[ChunkSpec, ChunkSpec]:
        return self.prompt, self.decode

    @property
    def terms(self) -> tuple[str, ...]:
        """The terms that store something in some chunk, e.g. ('backbone', 'lowrank')."""
        names = active_terms(self.prompt) + active_terms(self.decode)
        return tuple(dict.fromkeys(names))

    def fields(self, spec: ChunkSpec, n: int, head_dim: int, model_dtype: torch.dtype) -> tuple[Field, ...]:
        """The fields one chunk of n tokens of `spec` (self.prompt or self.decode) stores."""
        return chunk_fields(spec, n, head_dim, side_dtype(model_dtype))


def stream_specs(cfg, stream: str) -> tuple[ChunkSpec, ChunkSpec]:
    """(prompt chunk spec, decode chunk spec) of a GearConfig for stream "key" or "value"."""
    bits, axis = (cfg.key_bits, cfg.key_axis) if stream == "key" else (cfg.value_bits, cfg.value_axis)
    decode_group = cfg.key_group if stream == "key" else cfg.value_group
    groups = (0, 0) if cfg.coarse_groups else (cfg.prompt_group(stream), decode_group)
    ratio = cfg.outlier_ratio if cfg.uses_outliers else 0.0
    ranks = (cfg.rank_prefill, cfg.rank_decode) if cfg.uses_lowrank else (0, 0)
    rotate = cfg.rotation in ("both", stream + "s") and cfg.compresses  # (fp16 stores no chunk: checks skipped)
    range_search = cfg.range_search in ("both", stream + "s")
    allocated = stream == "key" and cfg.key_bit_allocation == "query"
    stats = cfg.value_statistics if stream == "value" else "16"
    return tuple(ChunkSpec(bits, axis, group, ratio, rank, cfg.power_iters, rotate, cfg.factor_bits,
                           range_search, allocated, tuple(cfg.extra_terms), stats)
                 for group, rank in zip(groups, ranks))


# keys or values in the buffer at key_buffer / value_buffer="int8": 8 bits per token (one group: the whole head
# vector), 16-bit scale/minimum
INT8_TOKENS = ChunkSpec(bits=8, axis="token", group=0, outlier_ratio=0.0, rank=0)
# ... at "int4": 4 bits per token after the Walsh–Hadamard rotation along head_dim (which spreads a key's outlier
# channels over the whole vector before one min/max range is taken), 16-bit scale/minimum
INT4_TOKENS = ChunkSpec(bits=4, axis="token", group=0, outlier_ratio=0.0, rank=0, rotate=True)
# ... at "int8-rotated": 8 bits per token after the rotation. A key vector with a few large channels (Qwen2.5's, from
# its key bias) sets one token's whole range: unrotated, the other channels get a step hundreds of times their size
# (next-token KL 0.077 against 0.007 rotated on Qwen2.5 at T~1.1k: results/tail/ "Rotated 8-bit keys")
INT8_ROTATED_TOKENS = ChunkSpec(bits=8, axis="token", group=0, outlier_ratio=0.0, rank=0, rotate=True)
TAIL_SPECS = {"int8": INT8_TOKENS, "int8-rotated": INT8_ROTATED_TOKENS, "int4": INT4_TOKENS}  # "final": the chunk's


def stream_format(cfg, stream: str) -> StreamFormat:
    prompt, decode = stream_specs(cfg, stream)
    # (fp16 keeps every token as the model made it, whatever the buffer settings)
    choice = (cfg.key_buffer if stream == "key" else cfg.value_buffer) if cfg.compresses else "full"
    tail = decode if choice == "final" else TAIL_SPECS.get(choice)  # (None: "full")
    held_size = cfg.key_buffer_size if stream == "key" else cfg.value_buffer_size
    held = held_size is not None and cfg.compresses
    centered = (cfg.key_buffer_centered if stream == "key" else cfg.value_buffer_centered) and choice in TAIL_SPECS
    chunks_centered = centered and stream == "value" and cfg.value_chunks_centered
    return StreamFormat(stream, prompt, decode, cfg.buffer_size, tail, held, release_after(cfg) if held else 0,
                        centered, chunks_centered)


def layer_formats(cfg) -> tuple[StreamFormat, StreamFormat]:
    """(keys' format, values' format) of a GearConfig."""
    return stream_format(cfg, "key"), stream_format(cfg, "value")
