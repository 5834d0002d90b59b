"""What both GEAR attention backends (CPU: `backend`, GPU: `triton_backend`) do around their attention: a layer's
page format, the spec that declares it to vLLM, the open blocks' tail pool, writing a step's tokens where the
attention reads them and compressing the blocks that close into their pages. Device-neutral torch.

Storage (per layer):
  pages   vLLM's KV cache, one page per (block, KV head) of PageFormat.page_bytes (declared by `page_spec` as one
          state of block_size tokens): only closed (full) blocks live here, each compressed once, when its last token
          is written, and never rewritten (equal prefixes give equal pages, so prefix caching holds).
  tails   the open block of each running request in full precision: [slots, bs, H, d] keys and values in the model
          dtype, one slot per request running at once (at most max_num_seqs), grown as they come (TailPool).
  sinks   the format's sink_tokens S (GearConfig(): 4): a request's first S tokens in full precision once its
          first block is a page, [slots, S, H, d] (a TailPool of S-token slots, one per closed first block:
          `plan.TailBook` keeps which); the page stores that block with those rows replaced by copies of token S
          (so they stretch no quantization range) and the attention reads them from here instead.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import AttentionSpec

from .format import PageFormat, config_from_env
from .plan import StepPlan
from .rotary import KeyRotary


class PageBackend:
    """What both GEAR attention backends declare to vLLM (mixed in before vLLM's backend class): one state of page
    bytes per (block, KV head), causal decoder attention without a sliding window, the KV cache dtype the model's,
    and a forward that writes the KV cache itself (the writes need the plan and the staged blocks)."""

    forward_includes_kv_cache_update: bool = True
    supported_kv_cache_dtypes = ["auto"]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return page_spec(spec)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def page_format(block_size: int, head_size: int, dtype: torch.dtype) -> PageFormat:
    return PageFormat(config_from_env(), block_size, head_size, dtype)


def page_spec(spec: AttentionSpec) -> AttentionSpec:
    """The attention spec with one state per (block, KV head): the block's compressed bytes."""
    if spec.state_content_bytes is not None:
        return spec
    fmt = page_format(spec.block_size, spec.head_size, spec.dtype)
    return replace(spec, state_content_bytes=fmt.page_bytes, tokens_per_state=spec.block_size)


def sink_tokens(block_size: int) -> int:
    """The tokens a request keeps exact at its start (the format's sink_tokens; 0 for the fp16 format)."""
    config = config_from_env()
    count = config.sink_tokens if config.compresses else 0
    if count > min(16, block_size - 1):
        raise ValueError(f"GEAR pages keep sink_tokens={count} tokens exact in a request's first block; allowed: 0 "
                         f"to {min(16, block_size - 1)} (at most 16, and fewer than the block's {block_size} tokens)")
    return count


def check_page_spec(spec: AttentionSpec) -> None:
    if spec.tokens_per_state != spec.block_size:
        raise ValueError(f"GEAR pages hold one state per block; the spec has block_size={spec.block_size}, "
                         f"tokens_per_state={spec.tokens_per_state} (was the block size changed after "
                         "customize_spec?)")


def key_rotary(head_size: int) -> KeyRotary | None:
    """The rotary of keys stored before RoPE (the format's pre_rope), from the model vLLM loads; None otherwise."""
    gear = config_from_env()
    if not (gear.compresses and gear.pre_rope):
        return None
    return KeyRotary.from_hf_config(get_current_vllm_config().model_config.hf_config, head_size)


class TailPool:
    """One layer's open blocks in full precision: keys and values [slots, bs, H, d] in the model dtype, as many slots
    as the most requests that held an open block at once (`TailBook` hands out the lowest free slot), grown when a
    step needs more (`reserve`): a server whose max_num_seqs is far above what runs pays for what runs."""

    GROWTH = 4  # slots added at a time (fewer reallocations)

    def __init__(self, limit: int, block_size: int, heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.limit = limit
        self.keys = torch.zeros(0, block_size, heads, head_size, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    def reserve(self, slots: int) -> None:
        """At least `slots` slots (the tokens of those held are kept)."""
        held = self.keys.shape[0]
        if slots <= held:
            return
        grown = min(max(slots, held + self.GROWTH), self.limit)
        extra = self.keys.new_zeros(grown - held, *self.keys.shape[1:])
        self.keys, self.values = torch.cat([self.keys, extra]), torch.cat([self.values, extra])

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def slot_bytes(self) -> int:
        """Bytes one slot (one running request's open block) holds, keys and values."""
        return 2 * math.prod(self.keys.shape[1:]) * self.keys.element_size()


class BlockWriter:
    """A backend impl's storage steps (mixin): needs format (PageFormat, None until `_setup`), rotary (KeyRotary or
    None), num_kv_heads, head_size and max_num_seqs; `_pools` makes tail_pool and sink_pool."""

    def _pools(self, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tail_pool = TailPool(self.max_num_seqs, block_size, self.num_kv_heads, self.head_size, dtype, device)
        count = sink_tokens(block_size)
        self.sink_pool = TailPool(sys.maxsize, count, self.num_kv_heads, self.head_size, dtype, device) \
            if count else None

    def _layer_pages(self, kv_cache: torch.Tensor, dtype: torch.dtype, block_size: int) -> torch.Tensor:
        """The layer's pages [blocks, H, page_bytes] uint8 of vLLM's KV cache [blocks, H, 1 state, bytes in its
        dtype]; the impl's `_setup` (format, pools) at the layer's first step."""
        _, heads, states, _ = kv_cache.shape
        if states != 1 or heads != self.num_kv_heads:
            raise ValueError(f"GEAR pages must be [blocks, {self.num_kv_heads} KV heads, 1 state, bytes]; got "
                             f"{tuple(kv_cache.shape)}")
        if self.format is None:
            self._setup(kv_cache, dtype, block_size)
        pages = kv_cache[:, :, 0, :].view(torch.uint8)
        if not pages.is_contiguous():
            raise ValueError(f"GEAR pages must be contiguous per layer (KV cache layout LBHNC); got strides "
                             f"{tuple(pages.stride())} for {tuple(pages.shape)}")
        return pages

    def _write(self, plan: StepPlan, key: torch.Tensor, value: torch.Tensor):
        """This step's tokens put where the attention reads them: the blocks that close this step staged whole,
        [C, bs, H, d] (their tail's earlier tokens, then this step's; returned), the others' tokens into their tail
        slots (in place). Closing blocks are staged first: a slot one of them frees may take a new block's tokens."""
        tails = self.tail_pool
        tails.reserve(plan.tail_slots)
        C = int(plan.stage_closes.sum())
        close_k = key.new_empty(C, plan.block_size, self.num_kv_heads, self.head_size)
        close_v = torch.empty_like(close_k)
        index, slot = plan.close_loads
        if index.numel():
            close_k[index] = tails.keys[slot]
            close_v[index] = tails.values[slot]
        for (rows, where, offset), store_k, store_v in ((plan.close_tokens, close_k, close_v),
                                                          (plan.tail_tokens, tails.keys, tails.values)):
            if rows.numel():
                store_k[where, offset] = key[rows]
                store_v[where, offset] = value[rows]
        return close_k, close_v

    def _store(self, plan: StepPlan, pages, close_k, close_v) -> None:
        """Blocks that closed this step -> their pages (compressed once; the open ones are in their tails)."""
        closing = plan.stage_closes
        if closing.any():
            k_close, v_close = close_k.transpose(1, 2), close_v.transpose(1, 2)  # [C,H,bs,d]
            if self.rotary is not None:
                k_close = self.rotary.unrotate(k_close, plan.stage_first_position[closing])
            first = torch.nonzero(plan.stage_sink[closing] >= 0).flatten()  # first blocks: their sinks kept exact
            if first.numel():
                S, slots = plan.sink_tokens, plan.stage_sink[closing][first]
                self.sink_pool.reserve(plan.sink_slots)
                self.sink_pool.keys[slots] = close_k[first, :S]
                self.sink_pool.values[slots] = close_v[first, :S]
                k_close, v_close = k_close.clone(), v_close.clone()
                k_close[first, :, :S] = k_close[first, :, S:S + 1]
                v_close[first, :, :S] = v_close[first, :, S:S + 1]
            pages[plan.stage_blocks[closing]] = self.format.encode(k_close, v_close)
