"""What one chunk of one stream stores: `ChunkSpec` (how it is compressed) and `CompressedChunk` (its tensors).

A chunk's stored tensors are named fields that the terms of its format declare (`gear_hf.compress.terms`); the
storage, the memory report and the kernels' views are all generated from those declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant

FACTOR_BITS = (8, 16)


def side_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """16-bit dtype of the side information: fp16 for fp16 models (their range), bf16 otherwise (fp32's range)."""
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


@dataclass(frozen=True)
class ChunkSpec:
    """How one stream (keys or values) of one chunk is compressed."""

    bits: float  # the code width; with allocated=True the mean over channels (a multiple of 1/8)
    axis: str  # "channel": groups run along tokens; "token": groups run along channels
    group: int  # group length; 0 = one group per whole vector (KCVT)
    outlier_ratio: float  # 0 = no sparse term
    rank: int  # 0 = no low-rank term
    power_iters: int = 3
    rotate: bool = False  # Walsh–Hadamard rotation along head_dim before compressing
    factor_bits: int = 16  # 16: factors in the side dtype; 8: int8 + a 16-bit scale per column
    range_search: bool = False  # each group's range searched for the least squared error (quant.quantize)
    allocated: bool = False  # widths per channel (compress's channel_bits, allocation.py), stored as bit planes
    extra_terms: tuple[str, ...] = ()  # registered terms beyond the built-in ones (compress.terms), by name
    stats: str = "16"  # the groups' scale and minimum: "16" in the side dtype, "8" as two uint8 codes (quant.stats8)

    def __post_init__(self) -> None:
        if self.allocated:
            if self.axis != "channel" or self.outlier_ratio or self.rotate:
                raise ValueError("ChunkSpec.allocated (bits per channel) needs axis='channel', no outliers and no "
                                 f"rotation; got axis={self.axis!r}, outlier_ratio={self.outlier_ratio}, "
                                 f"rotate={self.rotate}")
        else:
            quant.pack_unit(self.bits)  # raises on unsupported bits
        if self.stats not in quant.STATS:
            raise ValueError(f"ChunkSpec.stats={self.stats!r}; allowed: {' | '.join(quant.STATS)}")
        if self.stats == "8" and (self.axis != "token" or self.range_search or self.allocated):
            raise ValueError("ChunkSpec.stats='8' (8-bit statistics) needs axis='token' (a group's range then holds 0 "
                             f"or lies near it), min/max ranges and one width; got axis={self.axis!r}, range_search="
                             f"{self.range_search}, allocated={self.allocated}")
        if self.factor_bits not in FACTOR_BITS:
            raise ValueError(f"ChunkSpec.factor_bits={self.factor_bits!r}; allowed: 8 or 16")

    def group_for(self, n: int, d: int) -> int:
        if self.group:
            return self.group
        return n if self.axis == "channel" else d

    @property
    def pack_dim(self) -> int:
        return -2 if self.axis == "channel" else -1

    @property
    def terms(self) -> tuple:
        """The terms this chunk stores, in encoding order (`gear_hf.compress.terms`)."""
        from .terms import terms_of  # (the registry imports this module)

        return terms_of(self)


class CompressedChunk:
    """One compressed chunk (or a run of chunks one after the other along dim 2): its stored tensors by field
    name, each [B, H, extent, ...], read as attributes (`chunk.codes`). Which fields exist, and their shapes, the
    format's terms declare (`gear_hf.compress.terms`; the built-in ones: codes, channel_bits, scale, minimum,
    sparse_values, sparse_index, lowrank_a, lowrank_b, lowrank_a_scale, lowrank_b_scale)."""

    def __init__(self, fields: dict[str, torch.Tensor] | None = None, **named: torch.Tensor) -> None:
        self.fields = {**(fields or {}), **named}

    def __getattr__(self, name: str) -> torch.Tensor:
        fields = self.__dict__.get("fields")  # (absent while copy/pickle rebuilds the object)
        if fields is not None and name in fields:
            return fields[name]
        raise AttributeError(f"CompressedChunk has no field {name!r}; fields: {sorted(fields or ())}")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(t.shape)}" for k, t in self.fields.items())
        return f"CompressedChunk({shapes})"


def check_channel_bits(spec: ChunkSpec, channel_bits: torch.Tensor | None) -> None:
    """channel_bits come with a spec whose widths are allocated per channel, and only with one."""
    if spec.allocated != (channel_bits is not None):
        raise ValueError("channel_bits are given for a spec with bits allocated per channel (allocated=True), and "
                         f"only then: allocated={spec.allocated}, channel_bits given: {channel_bits is not None}")
