"""GearTritonBackend: GEAR pages on the GPU through gear_hf's Triton kernel, vLLM's `AttentionBackendEnum.CUSTOM`
(plugin.register registers it; `--attention-backend CUSTOM` selects it).

Storage and writes are the CPU backend's (`blocks`). One step of one layer (GearTritonImpl.forward), following the
plan the builder made once for all layers:
  1. this step's tokens into their tail slots; the blocks that close this step staged whole, [C,bs,H,d]
  2. attention of every request, decodes and prompt chunks alike, by `gear_hf.kernels.triton.paged`: closed blocks
     read in place from their pages through the plan's table (keys stored pre-RoPE rotated as they are read), open
     blocks from their tails, closing ones from the staging; the fp16 format's raw pages through the same kernel
  3. the blocks that closed are compressed into their pages on the device (`PageFormat.encode`)
The plan is built on the host from vLLM's CPU copies (the block table is copied once per step, for all layers);
the builder does not support CUDA graphs (the writes index by the plan), so vLLM runs attention eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from .blocks import BlockWriter, PageBackend, TailPool, check_page_spec, key_rotary, page_format, sink_tokens
from .plan import StepPlan, TailBook

logger = init_logger("vllm.gear_hf")


class GearTritonBackend(PageBackend, AttentionBackend):
    """GEAR pages read in place by a Triton kernel (GPU; the CPU interpreter under TRITON_INTERPRET=1)."""

    accept_output_buffer: bool = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["GearTritonImpl"]:
        return GearTritonImpl

    @staticmethod
    def get_builder_cls() -> type["GearTritonMetadataBuilder"]:
        return GearTritonMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(16)]  # (the kernel's blocks are vLLM's: one page per block)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)  # a layer's pages contiguous, [blocks, H, 1, page_bytes]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 32 and head_size & (head_size - 1) == 0


@dataclass
class GearTritonMetadata:
    num_actual_tokens: int
    plan: StepPlan
    starts: torch.Tensor  # int32 [R+1] on the device: request r's query rows
    lens: torch.Tensor  # int32 [R]: its tokens
    table: torch.Tensor  # int32 [R, blocks]: the plan's page table
    max_queries: int
    sink_slot: torch.Tensor  # int32 [R]: the plan's sink slots

    @classmethod
    def of(cls, plan: StepPlan, num_actual_tokens: int, device: torch.device) -> "GearTritonMetadata":
        def to_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

        counts = np.diff(plan.query_start)
        return cls(num_actual_tokens, plan, to_device(plan.query_start), to_device(plan.seq_lens),
                   to_device(plan.page_table), int(counts.max()) if counts.size else 0, to_device(plan.sink_slot))


class GearTritonMetadataBuilder(AttentionMetadataBuilder[GearTritonMetadata]):
    """The step plan and its device copies, once per step for every layer of the group; owns the tail book."""

    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_page_spec(kv_cache_spec)
        self.block_size = kv_cache_spec.block_size
        self.tails = TailBook(vllm_config.scheduler_config.max_num_seqs, sink_tokens(kv_cache_spec.block_size))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GearTritonMetadata:
        m = common_attn_metadata
        plan = StepPlan.build(self.tails, self.block_size, m.query_start_loc_cpu[: m.num_reqs + 1],
                              m.seq_lens[: m.num_reqs].cpu(), m.block_table_tensor[: m.num_reqs].cpu(),
                              m.num_actual_tokens)
        return GearTritonMetadata.of(plan, m.num_actual_tokens, m.query_start_loc.device)


class GearTritonImpl(BlockWriter, AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unused) -> None:
        refused = {"ALiBi": alibi_slopes is not None, "sliding window": sliding_window not in (None, -1),
                   f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto",
                   "logits soft-capping": bool(logits_soft_cap), "attention sinks": sinks is not None,
                   f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
                   "KV cache sharing between layers": kv_sharing_target_layer_name is not None}
        if any(refused.values()):
            raise NotImplementedError(f"GEAR Triton backend: {', '.join(k for k, v in refused.items() if v)} not "
                                      "supported (GEAR pages hold one decoder layer's causal keys and values; "
                                      "kv_cache_dtype must be 'auto')")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.tail_pool: TailPool | None = None
        self.sink_pool: TailPool | None = None
        self.format = None
        self.inv_freq: torch.Tensor | None = None  # the rotary's, on the pages' device (pre-RoPE pages)
        self.streams: tuple = ()  # (keys, values) `paged.page_stream`s of the format; (None, None) for raw pages
        self.max_num_seqs = get_current_vllm_config().scheduler_config.max_num_seqs
        self.rotary = key_rotary(head_size)

    def _setup(self, kv_cache: torch.Tensor, dtype: torch.dtype, block_size: int) -> None:
        from gear_hf.kernels.triton import paged

        self.format = page_format(block_size, self.head_size, dtype)
        if self.format.raw:
            self.streams = (None, None)
        else:
            self.streams = tuple(
                paged.page_stream(spec, tuple((name, *where) for name, where in layout.items()), block_size,
                                  self.head_size, keys)
                for spec, layout, keys in zip(self.format.specs, self.format.layout, (True, False)))
        self._pools(block_size, dtype, kv_cache.device)
        # (moved to the device once, not at every layer-step)
        self.inv_freq = None if self.rotary is None else self.rotary.inv_freq.to(kv_cache.device)
        logger.info_once("GEAR pages (Triton): %s, %d bytes per (block, KV head) (%.3f bits/element), block %d "
                         "tokens, pre-RoPE keys: %s", self.format.config.describe(), self.format.page_bytes,
                         self.format.bits_per_element(), block_size, self.rotary is not None)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        from gear_hf.kernels.triton import paged

        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the GEAR backend")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        meta: GearTritonMetadata = attn_metadata
        plan = meta.plan
        pages = self._layer_pages(kv_cache, key.dtype, plan.block_size)
        T = meta.num_actual_tokens
        close_k, close_v = self._write(plan, key[:T], value[:T])
        Hq, d = self.num_heads, self.head_size
        scaling = self.rotary.attention_scaling if self.rotary else 1.0
        sinks = {} if self.sink_pool is None else dict(sink_slot=meta.sink_slot, sink_k=self.sink_pool.keys,
                                                         sink_v=self.sink_pool.values)
        paged.paged_attention(query[:T].view(T, Hq, d), meta.starts, meta.lens, meta.table, plan.block_size,
                              meta.max_queries, pages, *self.streams, self.tail_pool.keys, self.tail_pool.values,
                              close_k, close_v, plan.first_closing, output[:T].view(T, Hq, d), scale=self.scale,
                              inv_freq=self.inv_freq, attention_scaling=scaling, **sinks)
        self._store(plan, pages, close_k, close_v)
        return output
