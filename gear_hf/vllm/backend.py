"""GearAttentionBackend: CPU_ATTN with GEAR-compressed KV pages.

Storage (per layer):
  pages   vLLM's KV cache, one page per (block, KV head) of PageFormat.page_bytes (declared by customize_spec as
          one state of block_size tokens): only closed (full) blocks live here, each compressed once, when its
          last token is written, and never rewritten (equal prefixes give equal pages, so prefix caching holds).
  tails   the open block of each running request in full precision: [max_num_seqs, bs, H, d] keys and values in
          the model dtype, allocated at the first forward (TailPool; its bytes count: `tail_bytes`).

One step of one layer (GearAttentionImpl.forward), following the plan the builder made once for all layers:
  1. stage the blocks written this step: the tail's earlier tokens (if any) + this step's tokens, [Q,bs,H,d]
  2. workspace = every block the batch reads, in CPU_ATTN's own layout: closed pages decoded (keys re-rotated
     when stored pre-RoPE) and staged blocks, written with CPU_ATTN's reshape_and_cache (its ISA's layout)
  3. CPU_ATTN's attention kernel over the workspace, with the block table mapped to workspace indices
  4. staged blocks that got full are compressed into their pages; the open ones go back to their tails
This is the reference path of DESIGN §2 (reconstruct, then the engine's own attention): the fp16 format is
bit-exact with stock CPU_ATTN, and every format is computed by gear_hf.compress, the torch oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    """One layer's open blocks in full precision: keys and values [slots, bs, H, d] in the model dtype."""

    def __init__(self, slots: int, block_size: int, heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.keys = torch.zeros(slots, block_size, heads, head_size, dtype=dtype)
        self.values = torch.zeros_like(self.keys)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class GearAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tail_pool: TailPool | None = None
        self.format: PageFormat | None = None
        config = get_current_vllm_config()
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.rotary = None
        gear = config_from_env()
        if gear.compresses and gear.pre_rope:
            self.rotary = KeyRotary.from_hf_config(config.model_config.hf_config, self.head_size)

    def _setup(self, kv_cache: torch.Tensor, dtype: torch.dtype, block_size: int) -> None:
        self.format = page_format(block_size, self.head_size, dtype)
        self.tail_pool = TailPool(self.max_num_seqs, block_size, self.num_kv_heads, self.head_size, dtype)
        logger.info_once("GEAR pages: %s, %d bytes per (block, KV head) (%.3f bits/element), block %d tokens, "
                         "pre-RoPE keys: %s; open-block tails %d bytes per layer", self.format.config.describe(),
                         self.format.page_bytes, self.format.bits_per_element(), block_size,
                         self.rotary is not None, self.tail_pool.nbytes)

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
        bs = plan.block_size
        if self.format is None:
            self._setup(kv_cache, key.dtype, bs)
        fmt, tails = self.format, self.tail_pool
        pages = kv_cache[:, :, 0, :].view(torch.uint8)  # [num_blocks, H, page_bytes]
        T = attn_metadata.num_actual_tokens
        H, d = self.num_kv_heads, self.head_size

        # 1. staged blocks [Q, bs, H, d]: the tail's earlier tokens, then this step's
        Q = plan.stage_blocks.numel()
        stage_k = key.new_zeros(Q, bs, H, d)
        stage_v = torch.zeros_like(stage_k)
        loaded = plan.stage_tail >= 0
        if loaded.any():
            stage_k[loaded] = tails.keys[plan.stage_tail[loaded]]
            stage_v[loaded] = tails.values[plan.stage_tail[loaded]]
        rows = plan.token_rows  # this step's tokens with a slot, [T'] indices into key[:T]
        stage_k[plan.token_stage, plan.token_offset] = key[:T][rows]
        stage_v[plan.token_stage, plan.token_offset] = value[:T][rows]

        # 2. workspace in CPU_ATTN's layout: decoded closed pages + staged blocks
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
        workspace = key.new_zeros(plan.workspace_blocks, H, 2 * bs, d)
        key_ws, value_ws = workspace.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(torch.cat(k_parts), torch.cat(v_parts), key_ws, value_ws,
                                       torch.cat(slots), layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)

        # 3. CPU_ATTN's kernel over the workspace
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)
        ops.cpu_attention_with_kv_cache(
            query=query[:T], key_cache=key_ws, value_cache=value_ws, output=output[:T],
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, scale=self.scale,
            causal=attn_metadata.causal, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window,
            block_table=plan.workspace_table, softcap=self.logits_soft_cap,
            scheduler_metadata=attn_metadata.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=attn_metadata.dynamic_causal, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)

        # 4. full blocks -> pages (compressed once); open blocks -> their tails
        closing = plan.stage_closes
        if closing.any():
            k_close = stage_k[closing].transpose(1, 2)  # [C,H,bs,d]
            if self.rotary is not None:
                k_close = self.rotary.unrotate(k_close, plan.stage_first_position[closing])
            pages[plan.stage_blocks[closing]] = fmt.encode(k_close, stage_v[closing].transpose(1, 2))
        keep = plan.stage_keep >= 0
        if keep.any():
            tails.keys[plan.stage_keep[keep]] = stage_k[keep]
            tails.values[plan.stage_keep[keep]] = stage_v[keep]
        return output
