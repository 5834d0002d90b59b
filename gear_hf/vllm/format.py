"""The page format: one vLLM block of one KV head as a fixed number of bytes, GEAR-compressed.

A block's keys [bs, d] and values [bs, d] are one chunk each for gear_hf.compress (the torch oracle): keys grouped
per channel over the block's tokens (group = min(key group, block size)), values per token, outliers and the
low-rank term per block. Every field of the two `CompressedChunk`s has a fixed shape for a given (spec, bs, d), so
a page is their bytes one after the other: [K fields | V fields], each field flattened per (block, head). The
layout is what the specs' terms declare (`gear_hf.compress.terms.chunk_fields`), as gear_hf's own storage has it.

method "fp16" stores the raw keys and values ([K bs*d | V bs*d] in the model dtype): no compression, the same page
path, bit-exact.

How GearConfig maps onto a block (the block plays the role of one decode chunk):
  bits, axes, outlier_ratio, power_iters, rotation, factor_bits, range_search  as given
  rank                         rank_decode (one block is one chunk of block_size tokens)
  groups                       min(group, block_size) along tokens, min(group, head_size) along channels
  key_bit_allocation="query"   widths per key channel chosen from the block's own key ranges (query weights are not
                               available when a block is written: allocate_channel_bits with equal weights)
  buffer_size, sink_tokens, prompt_group_size: not used (the open block is the full-precision buffer)
  pre_rope                     keys are un-rotated with their positions before compressing (backend.py)
"""

from __future__ import annotations

import json
import os

import torch

from gear_hf.compress import ChunkSpec, CompressedChunk, compress, decompress, side_dtype
from gear_hf.compress.allocation import allocate_channel_bits
from gear_hf.compress.terms import chunk_fields
from gear_hf.config import GearConfig

from .plugin import CONFIG_ENV

PAGE_ALIGN = 4  # bytes: the page is viewed in the model dtype by vLLM (2 or 4 bytes)


def config_from_env(text: str | None = None) -> GearConfig:
    """The GearConfig named by GEAR_HF_VLLM_CONFIG (JSON): {"preset": "gear-2", ...fields}, {"recommended":
    "accurate", ...} or plain GearConfig fields; unset or empty: GearConfig()."""
    text = os.environ.get(CONFIG_ENV, "") if text is None else text
    if not text.strip():
        return GearConfig()
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{CONFIG_ENV}={text!r} is not JSON ({error}); e.g. '{{\"preset\": \"gear-2\"}}'") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{CONFIG_ENV}={text!r} must be a JSON object, e.g. '{{\"preset\": \"gear-2\"}}'")
    fields = dict(fields)
    if "preset" in fields and "recommended" in fields:
        raise ValueError(f"{CONFIG_ENV}: give 'preset' or 'recommended', not both")
    if "preset" in fields:
        return GearConfig.preset(fields.pop("preset"), **fields)
    if "recommended" in fields:
        return GearConfig.recommended(name=fields.pop("recommended"), **fields)
    return GearConfig(**fields)


def chunk_specs(config: GearConfig, block_size: int, head_size: int) -> tuple[ChunkSpec, ChunkSpec]:
    """(keys, values) ChunkSpecs of one block."""
    if config.coarse_groups:
        key_group, value_group = 0, 0
    else:
        # a group never spans more than the block (along tokens) or the head (along channels)
        key_group = min(config.key_group, block_size if config.key_axis == "channel" else head_size)
        value_group = min(config.value_group, block_size if config.value_axis == "channel" else head_size)
    for name, axis, group in (("key", config.key_axis, key_group), ("value", config.value_axis, value_group)):
        length, what = (block_size, "block size") if axis == "channel" else (head_size, "head size")
        if group and length % group:
            raise ValueError(f"GearConfig {name} group {group} does not divide the {what} {length}; pick a "
                             f"{name}_group_size that divides it")
    ratio = config.outlier_ratio if config.uses_outliers else 0.0
    rank = config.rank_decode if config.uses_lowrank else 0
    allocated = config.key_bit_allocation == "query"
    key = ChunkSpec(bits=config.key_bits, axis=config.key_axis, group=key_group, outlier_ratio=ratio, rank=rank,
                    power_iters=config.power_iters, rotate=config.rotation in ("keys", "both"),
                    factor_bits=config.factor_bits, range_search=config.range_search in ("keys", "both"),
                    allocated=allocated, extra_terms=tuple(config.extra_terms))
    value = ChunkSpec(bits=config.value_bits, axis=config.value_axis, group=value_group, outlier_ratio=ratio,
                      rank=rank, power_iters=config.power_iters, rotate=config.rotation in ("values", "both"),
                      factor_bits=config.factor_bits, range_search=config.range_search in ("values", "both"),
                      extra_terms=tuple(config.extra_terms))
    return key, value


class PageFormat:
    """Encode/decode blocks of keys and values [N, H, bs, d] to/from pages [N, H, page_bytes] uint8."""

    def __init__(self, config: GearConfig, block_size: int, head_size: int, dtype: torch.dtype) -> None:
        self.config, self.block_size, self.head_size, self.dtype = config, block_size, head_size, dtype
        self.raw = not config.compresses
        if self.raw:
            self.specs = None
            self.fields = ()
            content = 2 * block_size * head_size * dtype.itemsize
        else:
            self.specs = chunk_specs(config, block_size, head_size)
            # the fields the specs' terms declare (gear_hf.compress.terms), per (block, KV head)
            self.fields = tuple(chunk_fields(spec, block_size, head_size, side_dtype(dtype)) for spec in self.specs)
            content = sum(f.nbytes() for stream in self.fields for f in stream)
        self.content_bytes = content
        self.page_bytes = -(-content // PAGE_ALIGN) * PAGE_ALIGN  # per (block, KV head)

    def bits_per_element(self) -> float:
        """Bits a stored element costs in a closed block (keys and values together, padding included)."""
        return 8 * self.page_bytes / (2 * self.block_size * self.head_size)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """keys/values [N,H,bs,d] (model dtype) -> pages [N,H,page_bytes] uint8."""
        N, H = keys.shape[:2]
        page = torch.zeros(N, H, self.page_bytes, dtype=torch.uint8)
        if self.raw:
            flat = torch.cat([keys.reshape(N, H, -1), values.reshape(N, H, -1)], dim=-1)
            page[..., : self.content_bytes] = flat.contiguous().view(torch.uint8)
            return page
        offset = 0
        for x, spec, fields in zip((keys, values), self.specs, self.fields):
            bits = None
            if spec.allocated:
                weight = torch.ones(N, H, x.shape[-1], dtype=torch.float64)
                bits = allocate_channel_bits(weight, x.float(), spec.group_for(*x.shape[-2:]), spec.bits)
            chunk = compress(x.contiguous(), spec, channel_bits=bits)
            for f in fields:
                t = getattr(chunk, f.name).contiguous()
                page[..., offset: offset + f.nbytes()] = t.view(N, H, -1).view(torch.uint8)
                offset += f.nbytes()
        return page

    def decode(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [N,H,>=page_bytes] uint8 -> keys, values [N,H,bs,d] in the model dtype."""
        N, H = page.shape[:2]
        bs, d = self.block_size, self.head_size
        if self.raw:
            half = bs * d * self.dtype.itemsize
            raw = page[..., : 2 * half].contiguous()
            k = raw[..., :half].contiguous().view(self.dtype).view(N, H, bs, d)
            v = raw[..., half:].contiguous().view(self.dtype).view(N, H, bs, d)
            return k, v
        out, offset = [], 0
        for spec, fields in zip(self.specs, self.fields):
            parts = {}
            for f in fields:
                chunk_bytes = page[..., offset: offset + f.nbytes()].contiguous()
                parts[f.name] = chunk_bytes.view(f.dtype).view(N, H, *f.shape)
                offset += f.nbytes()
            out.append(decompress(CompressedChunk(**parts), spec, bs, d, self.dtype))
        return out[0], out[1]
