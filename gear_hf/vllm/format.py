"""The page format: one vLLM block of one KV head as a fixed number of bytes, GEAR-compressed.

A block's keys [bs, d] and values [bs, d] are one chunk each, compressed as gear_hf's Transformers path compresses
(`backends.resolve`: numba's kernels on the CPU, else gear_hf.compress, the torch oracle), in the format
gear_hf's Transformers path gives a decode chunk of `block_config(config)` (gear_hf.format.layer_formats: the same
ChunkSpecs, the same fields its terms declare, `gear_hf.compress.terms`). Every field has a fixed shape for a given
(spec, bs, d), so a page is the two chunks' fields one after the other: [K fields | V fields], each flattened per
(block, head) at an offset aligned to its element size.

method "fp16" stores the raw keys and values ([K bs*d | V bs*d] in the model dtype): no compression, the same page
path, bit-exact.

How GearConfig maps onto a block (block_config: the block is one decode chunk, buffer_size = block_size):
  bits, axes, outlier_ratio, power_iters, rotation, factor_bits, range_search  as given
  rank                         rank_decode (one block is one chunk of block_size tokens)
  groups                       min(group, block_size) along tokens, min(group, head_size) along channels
  key_bit_allocation="query"   widths per key channel chosen from the block's own key ranges (query weights are not
                               available when a block is written: allocate_channel_bits with equal weights)
  sink_tokens                  a request's first S tokens kept exact beside its first block's page, which holds
                               copies of token S there (`blocks`: the backends, not the page format)
  prompt_group_size, rank_prefill: not used (the open block is the full-precision buffer; no prompt chunk:
                               `transformers_config` gives gear_hf's Transformers path the same)
  key_buffer, value_buffer, their centering, value_chunks_centered: not used (the open block is the engine's, in the
                               model dtype: no per-token buffer format, so no per-row centers to code blocks by)
  pre_rope                     keys are un-rotated with their positions before compressing (`blocks`)
"""

from __future__ import annotations

import json
import math
import os

import torch

from gear_hf.backends import resolve
from gear_hf.compress import ChunkSpec, CompressedChunk, decompress
from gear_hf.compress.allocation import allocate_channel_bits
from gear_hf.config import GearConfig
from gear_hf.format import layer_formats

from .plugin import CONFIG_ENV

PAGE_ALIGN = 4  # bytes: the page is viewed in the model dtype by vLLM (2 or 4 bytes)


def config_from_env(text: str | None = None) -> GearConfig:
    """The GearConfig named by GEAR_HF_VLLM_CONFIG (JSON): {"preset": "gear-2", ...fields}, {"recommended":
    "smallest", ...} or plain GearConfig fields; unset or empty: GearConfig()."""
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


def block_config(config: GearConfig, block_size: int, head_size: int) -> GearConfig:
    """The GearConfig whose decode chunk is one vLLM block of one KV head: buffer_size = block_size, groups capped
    at the block (along tokens) or the head (along channels), no sinks, and no values or keys held a chunk longer
    (hold="none": the plugin compresses a block's keys and values together when the
    block closes; the open block is the engine's buffer). Its decode chunks' specs (`gear_hf.format.layer_formats`)
    are the page's: the plugin builds no spec of its own."""
    if not config.compresses:
        return config
    changes: dict = dict(buffer_size=block_size, sink_tokens=0, hold="none")
    for name, axis, group in (("key", config.key_axis, config.key_group),
                              ("value", config.value_axis, config.value_group)):
        length, what = (block_size, "block size") if axis == "channel" else (head_size, "head size")
        if config.coarse_groups:  # one group per whole channel / token vector: the group size only sets granules
            changes[f"{name}_group_size"] = math.gcd(group, length)
            continue
        capped = min(group, length)  # a group never spans more than the block or the head
        if length % capped:
            raise ValueError(f"GearConfig {name} group {capped} does not divide the {what} {length}; pick a "
                             f"{name}_group_size that divides it")
        changes[f"{name}_group_size"] = capped
    return config.replace(**changes)


def chunk_specs(config: GearConfig, block_size: int, head_size: int) -> tuple[ChunkSpec, ChunkSpec]:
    """(keys, values) ChunkSpecs of one block: the decode specs of `block_config`."""
    keys, values = layer_formats(block_config(config, block_size, head_size))
    return keys.decode, values.decode


def transformers_config(config: GearConfig, block_size: int, head_size: int, longest_prompt: int) -> GearConfig:
    """The GearConfig under which gear_hf's Transformers path stores what the plugin stores, for prompts of up to
    `longest_prompt` tokens: `block_config` (decode chunks = blocks, rank_decode, the same groups, no sinks) with
    prompt groups longer than any prompt. The prompt chunk holds whole prompt groups only (the rest of the prompt
    goes to decode chunks: GearConfig.prompt_group_size), so there is none: the prompt is compressed in chunks of
    block_size tokens from token 0, aligned with vLLM's blocks, each when it is full, as the plugin closes them.
    Still different: key_bit_allocation="query" chooses key widths from the queries seen (Transformers) but
    from the block's own key ranges (vLLM: no queries when a block is written)."""
    block = block_config(config, block_size, head_size)
    if not config.compresses:
        return block
    if config.coarse_groups or "channel" not in (config.key_axis, config.value_axis):
        raise ValueError(f"{config.describe()}: prompt groups apply to no stream (coarse groups, or none grouped "
                         "along tokens), so gear_hf's Transformers path always compresses the prompt as one chunk; "
                         "it has no equivalent of the plugin's blocks for this format")
    granule = block.chunk_granule
    prompt_group = (longest_prompt // granule + 1) * granule  # > longest_prompt, a whole number of granules
    return block.replace(prompt_group_size=prompt_group, rank_prefill=block.rank_decode)


class PageFormat:
    """Encode/decode blocks of keys and values [N, H, bs, d] to/from pages [N, H, page_bytes] uint8."""

    def __init__(self, config: GearConfig, block_size: int, head_size: int, dtype: torch.dtype) -> None:
        self.config, self.block_size, self.head_size, self.dtype = config, block_size, head_size, dtype
        self.raw = not config.compresses
        if self.raw:
            self.specs = None
            self.fields = ()
            self.layout = []
            content = 2 * block_size * head_size * dtype.itemsize
        else:
            # gear_hf's own stream formats of the block config: their decode chunk is the page's
            self.block = block_config(config, block_size, head_size)
            formats = layer_formats(self.block)
            self.specs = tuple(f.decode for f in formats)
            # the fields the specs' terms declare (gear_hf.compress.terms), per (block, KV head)
            self.fields = tuple(f.fields(f.decode, block_size, head_size, dtype) for f in formats)
            content = 0
            self.layout = []  # per stream: field name -> (byte offset in a page, dtype, shape), each aligned
            for stream in self.fields:
                placed = {}
                for f in stream:
                    content = -(-content // f.dtype.itemsize) * f.dtype.itemsize
                    placed[f.name] = (content, f.dtype, tuple(f.shape))
                    content += f.nbytes()
                self.layout.append(placed)
        self.content_bytes = content
        self.page_bytes = -(-content // PAGE_ALIGN) * PAGE_ALIGN  # per (block, KV head)
        self._compressors: dict = {}  # device -> the backend that compresses blocks there (`_compressor`)

    def not_read_in_place(self) -> str | None:
        """Why the paged kernel (`gear_hf.kernels.cpu.paged`) cannot read these pages in place, None when it can."""
        if self.raw:
            return "the fp16 format: CPU_ATTN itself, bit-exact with stock"
        try:
            from gear_hf.kernels.cpu.paged import pages_supported
        except ImportError as error:
            return f"the paged kernel needs numba ({error})"
        dtypes = {dtype for layout in self.layout for _, dtype, _ in layout.values()}
        if not all(pages_supported(spec, dtypes, self.head_size) for spec in self.specs):
            return f"fields of {sorted(map(str, dtypes))} or widths the paged kernel does not read"
        return None

    def bits_per_element(self) -> float:
        """Bits a stored element costs in a closed block (keys and values together, padding included)."""
        return 8 * self.page_bytes / (2 * self.block_size * self.head_size)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """keys/values [N,H,bs,d] (model dtype) -> pages [N,H,page_bytes] uint8."""
        N, H = keys.shape[:2]
        page = torch.zeros(N, H, self.page_bytes, dtype=torch.uint8, device=keys.device)
        if self.raw:
            flat = torch.cat([keys.reshape(N, H, -1), values.reshape(N, H, -1)], dim=-1)
            page[..., : self.content_bytes] = flat.contiguous().view(torch.uint8)
            return page
        for x, spec, fields, layout in zip((keys, values), self.specs, self.fields, self.layout):
            bits = None
            if spec.allocated:
                weight = torch.ones(N, H, x.shape[-1], dtype=torch.float64, device=x.device)
                bits = allocate_channel_bits(weight, x.float(), spec.group_for(*x.shape[-2:]), spec.bits)
            chunk = self._compressor(x.device).compress(spec, x.contiguous(), bits)
            for f in fields:
                t = getattr(chunk, f.name).contiguous()
                offset = layout[f.name][0]
                page[..., offset: offset + f.nbytes()] = t.view(N, H, -1).view(torch.uint8)
        return page

    def _compressor(self, device: torch.device):
        """The backend that compresses blocks on `device`: gear_hf's choice for the block config (`backends.resolve`:
        numba's kernels on the CPU where they serve it, bit for bit the oracle's backbone and its low-rank factors to
        float32 rounding; else the torch oracle)."""
        if device not in self._compressors:
            self._compressors[device] = resolve(self.block, self.head_size, self.dtype, device).compress
        return self._compressors[device]

    def decode(self, page: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [N,H,>=page_bytes] uint8 -> keys, values [N,H,bs,d] in `dtype` (default: the model dtype; the raw
        format always returns the model dtype)."""
        N, H = page.shape[:2]
        bs, d = self.block_size, self.head_size
        if self.raw:
            half = bs * d * self.dtype.itemsize
            raw = page[..., : 2 * half].contiguous()
            k = raw[..., :half].contiguous().view(self.dtype).view(N, H, bs, d)
            v = raw[..., half:].contiguous().view(self.dtype).view(N, H, bs, d)
            return k, v
        out = []
        for spec, fields, layout in zip(self.specs, self.fields, self.layout):
            parts = {}
            for f in fields:
                offset = layout[f.name][0]
                chunk_bytes = page[..., offset: offset + f.nbytes()].contiguous()
                parts[f.name] = chunk_bytes.view(f.dtype).view(N, H, *f.shape)
            out.append(decompress(CompressedChunk(**parts), spec, bs, d, dtype or self.dtype))
        return out[0], out[1]
