"""GearAttentionBackend: CPU_ATTN with GEAR-compressed KV pages.

Storage (per layer):
  pages   vLLM's KV cache, one page per (block, KV head) of PageFormat.page_bytes (declared by customize_spec as
          one state of block_size tokens): only closed (full) blocks live here, each compressed once, when its
          last token is written, and never rewritten (equal prefixes give equal pages, so prefix caching holds).
  tails   the open block of each running request in full precision: [slots, bs, H, d] keys and values in the model
          dtype, one slot per request running at once (at most max_num_seqs), grown as they come (TailPool).

One step of one layer (GearAttentionImpl.forward), following the plan the builder made once for all layers:
  1. stage the blocks written this step: the tail's earlier tokens (if any) + this step's tokens, [Q,bs,H,d]
  2. attention, by one of two paths:
     paged      (compressed formats) gear_hf's numba kernel reads every closed block in place from its page through
                the plan's table (keys stored pre-RoPE rotated as they are read) and the staged blocks in full
                precision: no workspace, nothing decoded twice (`gear_hf.kernels.cpu.paged`)
     workspace  (the fp16 format, and what the paged kernel does not cover: `_reads_pages`) every block the batch
                reads decoded by the torch oracle into a workspace in CPU_ATTN's own layout, then CPU_ATTN's
                kernel over it with the block table mapped to workspace indices: bit-exact with stock for fp16,
                and the reference the paged kernel is tested against
  3. staged blocks that got full are compressed into their pages; the open ones go back to their tails
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from gear_hf.kernels.cpu import paged

from .format import PageFormat, config_from_env
from .plan import StepPlan, TailBook
from .rotary import KeyRotary

logger = init_logger("vllm.gear_hf")  # under "vllm": its handler prints it


def page_format(block_size: int, head_size: int, dtype: torch.dtype) -> PageFormat:
    return PageFormat(config_from_env(), block_size, head_size, dtype)


class GearAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN's kernels over GEAR pages (installed in CPU_ATTN's place by plugin.register)."""

    # the KV update needs the plan and the staged blocks: forward does both
    forward_includes_kv_cache_update: bool = True
    supported_kv_cache_dtypes = ["auto"]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One state per (block, KV head): the block's compressed bytes."""
        if spec.state_content_bytes is not None:
            return spec
        fmt = page_format(spec.block_size, spec.head_size, spec.dtype)
        return replace(spec, state_content_bytes=fmt.page_bytes, tokens_per_state=spec.block_size)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type["GearAttentionImpl"]:
        return GearAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["GearMetadataBuilder"]:
        return GearMetadataBuilder


@dataclass
class GearMetadata(CPUAttentionMetadata):
    plan: StepPlan | None = None


class GearMetadataBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's metadata plus the step plan; owns the tail book (which block holds which tail slot), shared by
    every layer of the group."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.tokens_per_state != kv_cache_spec.block_size:
            raise ValueError(f"GEAR pages hold one state per block; the spec has block_size="
                             f"{kv_cache_spec.block_size}, tokens_per_state={kv_cache_spec.tokens_per_state} "
                             "(was the block size changed after customize_spec?)")
        self.tails = TailBook(vllm_config.scheduler_config.max_num_seqs)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GearMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        plan = StepPlan.build(self.tails, self.block_size, m.query_start_loc_cpu[: m.num_reqs + 1],
                              m.seq_lens[: m.num_reqs].cpu(), m.block_table_tensor[: m.num_reqs].cpu(),
                              m.num_actual_tokens)
        return GearMetadata(**vars(base), plan=plan)


class TailPool:
    """One layer's open blocks in full precision: keys and values [slots, bs, H, d] in the model dtype, as many slots
    as the most requests that held an open block at once (`TailBook` hands out the lowest free slot), grown when a
    step needs more (`reserve`): a server whose max_num_seqs is far above what runs pays for what runs."""

    GROWTH = 4  # slots added at a time (fewer reallocations)

    def __init__(self, limit: int, block_size: int, heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.limit = limit
        self.keys = torch.zeros(0, block_size, heads, head_size, dtype=dtype)
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
        return 2 * self.keys[:1].numel() * self.keys.element_size() if self.keys.shape[0] else \
            2 * self.keys.shape[1] * self.keys.shape[2] * self.keys.shape[3] * self.keys.element_size()


class GearAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tail_pool: TailPool | None = None
        self.format: PageFormat | None = None
        self.paged = False  # (set with the format: `_reads_pages`)
        config = get_current_vllm_config()
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.rotary = None
        gear = config_from_env()
        if gear.compresses and gear.pre_rope:
            self.rotary = KeyRotary.from_hf_config(config.model_config.hf_config, self.head_size)

    def _setup(self, kv_cache: torch.Tensor, dtype: torch.dtype, block_size: int) -> None:
        self.format = page_format(block_size, self.head_size, dtype)
        self.paged, why = self._reads_pages(self.format)
        if not self.paged:
            logger.info_once("GEAR: attention through a decoded workspace and CPU_ATTN (%s)", why)
        self.tail_pool = TailPool(self.max_num_seqs, block_size, self.num_kv_heads, self.head_size, dtype)
        logger.info_once("GEAR pages: %s, %d bytes per (block, KV head) (%.3f bits/element), block %d tokens, "
                         "pre-RoPE keys: %s; open-block tails %d bytes per running request per layer (at most %d "
                         "requests)", self.format.config.describe(), self.format.page_bytes,
                         self.format.bits_per_element(), block_size, self.rotary is not None,
                         self.tail_pool.slot_bytes(), self.max_num_seqs)

    def _reads_pages(self, fmt: PageFormat) -> tuple[bool, str]:
        """(whether the paged kernel reads this format's pages in place, why not)."""
        if fmt.raw:
            return False, "the fp16 format: CPU_ATTN itself, bit-exact with stock"
        if self.alibi_slopes is not None or self.logits_soft_cap or self.sinks is not None:
            return False, "ALiBi, logit soft-capping or attention sinks: not in the paged kernel"
        dtypes = {dtype for layout in fmt.layout for _, dtype, _ in layout.values()}
        if not all(paged.pages_supported(spec, dtypes) for spec in fmt.specs):
            return False, f"fields of {sorted(map(str, dtypes))} or widths the paged kernel does not read"
        return True, ""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the GEAR backend")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        plan: StepPlan = attn_metadata.plan
        num_blocks, heads, states, _ = kv_cache.shape
        if states != 1 or heads != self.num_kv_heads:
            raise ValueError(f"GEAR pages must be [blocks, {self.num_kv_heads} KV heads, 1 state, bytes]; got "
                             f"{tuple(kv_cache.shape)}")
        if self.format is None:
            self._setup(kv_cache, key.dtype, plan.block_size)
        pages = kv_cache[:, :, 0, :].view(torch.uint8)  # [num_blocks, H, page_bytes]
        T = attn_metadata.num_actual_tokens
        close_k, close_v = self._write(plan, key[:T], value[:T])
        if self.paged:
            self._attend_pages(plan, query[:T], pages, close_k, close_v, output[:T])
        else:
            self._attend_workspace(layer, plan, query[:T], pages, close_k, close_v, attn_metadata, output[:T])
        self._store(plan, pages, close_k, close_v)
        return output

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

    def _attend_pages(self, plan: StepPlan, query, pages, close_k, close_v, output) -> None:
        """The paged kernel: closed blocks read in place from their pages, written ones exact from the tails and
        the closing blocks."""
        T, Hq, d = query.shape
        q = (query.float() * self.scale).contiguous().numpy()
        empty = np.zeros((0, 0), dtype=np.float32)
        cos, sin = self.rotary.halves(int(plan.seq_lens.max())) if self.rotary is not None else (empty, empty)
        keys, values = (paged.page_layout(spec, tuple((name, *where) for name, where in layout.items()),
                                          plan.block_size, d)
                        for spec, layout in zip(self.format.specs, self.format.layout))
        out = np.empty((T, Hq, d), dtype=np.float32)
        tails = self.tail_pool
        paged.paged_attention(q, plan.query_start, plan.seq_lens, plan.page_table, plan.block_size, cos, sin,
                              pages.numpy(), keys, values, *map(_exact, (tails.keys, tails.values, close_k, close_v)),
                              plan.first_closing, out)
        output.view(T, Hq, d).copy_(torch.from_numpy(out))

    def _staged(self, plan: StepPlan, close_k, close_v):
        """Every block written this step, [Q, bs, H, d] keys and values: closing ones staged, open ones' tails."""
        closes, keep = plan.stage_closes, plan.stage_keep
        stage_k = close_k.new_empty(plan.stage_blocks.numel(), *close_k.shape[1:])
        stage_v = torch.empty_like(stage_k)
        index, opened = plan.stage_close_index[closes], keep[~closes]
        stage_k[closes], stage_v[closes] = close_k[index], close_v[index]
        stage_k[~closes], stage_v[~closes] = self.tail_pool.keys[opened], self.tail_pool.values[opened]
        return stage_k, stage_v

    def _attend_workspace(self, layer, plan: StepPlan, query, pages, close_k, close_v, attn_metadata,
                          output) -> None:
        """The reference path: every block the batch reads decoded into a workspace in CPU_ATTN's layout (pages by
        the torch oracle, keys re-rotated when stored pre-RoPE), then CPU_ATTN's kernel over it."""
        fmt, bs, H, d = self.format, plan.block_size, self.num_kv_heads, self.head_size
        stage_k, stage_v = self._staged(plan, close_k, close_v)
        Q = plan.stage_blocks.numel()
        k_parts, v_parts = [stage_k.view(Q * bs, H, d)], [stage_v.view(Q * bs, H, d)]
        slots = [(plan.stage_ws[:, None] * bs + torch.arange(bs)).view(-1)]
        P = plan.read_blocks.numel()
        if P:
            k_read, v_read = fmt.decode(pages[plan.read_blocks])  # [P,H,bs,d]
            if self.rotary is not None:
                k_read = self.rotary.rotate(k_read, plan.read_first_position)
            k_parts.insert(0, k_read.transpose(1, 2).reshape(P * bs, H, d))
            v_parts.insert(0, v_read.transpose(1, 2).reshape(P * bs, H, d))
            slots.insert(0, (plan.read_ws[:, None] * bs + torch.arange(bs)).view(-1))
        workspace = stage_k.new_zeros(plan.workspace_blocks, H, 2 * bs, d)
        key_ws, value_ws = workspace.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(torch.cat(k_parts), torch.cat(v_parts), key_ws, value_ws,
                                       torch.cat(slots), layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_ws, value_cache=value_ws, output=output,
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, scale=self.scale,
            causal=attn_metadata.causal, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window,
            block_table=plan.workspace_table, softcap=self.logits_soft_cap,
            scheduler_metadata=attn_metadata.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=attn_metadata.dynamic_causal, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)

    def _store(self, plan: StepPlan, pages, close_k, close_v) -> None:
        """Blocks that closed this step -> their pages (compressed once; the open ones are in their tails)."""
        closing = plan.stage_closes
        if closing.any():
            k_close = close_k.transpose(1, 2)  # [C,H,bs,d]
            if self.rotary is not None:
                k_close = self.rotary.unrotate(k_close, plan.stage_first_position[closing])
            pages[plan.stage_blocks[closing]] = self.format.encode(k_close, close_v.transpose(1, 2))


def _exact(blocks: torch.Tensor) -> np.ndarray:
    """Full-precision blocks as the paged kernel reads them: bf16 as its bits, float32 as is."""
    return (blocks.view(torch.int16) if blocks.dtype == torch.bfloat16 else blocks).numpy()
