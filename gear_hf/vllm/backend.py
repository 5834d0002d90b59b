"""GearAttentionBackend: CPU_ATTN with GEAR-compressed KV pages (the storage: `blocks`).

One step of one layer (GearAttentionImpl.forward), following the plan the builder made once for all layers:
  1. write this step's tokens: into their tail slots for the blocks that stay open; the blocks that close this step
     staged whole, [C,bs,H,d] (their tail's earlier tokens + this step's)
  2. attention, each request by one of two paths:
     paged      (compressed formats, requests of at most PAGED_QUERIES query tokens this step: decodes) gear_hf's
                numba kernel reads every closed block in place from its page through the plan's table (keys stored
                pre-RoPE rotated as they are read), open blocks from their tails and closing ones from their
                staging: no workspace, nothing decoded twice (`gear_hf.kernels.cpu.paged`)
     workspace  (prompt chunks; every request for the fp16 format and what the paged kernel does not cover:
                `_reads_pages`) the request's blocks decoded by the torch oracle into a workspace in CPU_ATTN's own
                layout, then CPU_ATTN's kernel over it with the block table mapped to workspace indices: bit-exact
                with stock for fp16, and the reference the paged kernel is tested against
  3. the blocks that closed are compressed into their pages (`PageFormat.encode`: by gear_hf's compression
     kernels where they serve the format, as its Transformers path compresses)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from gear_hf.kernels.cpu import paged

from .blocks import BlockWriter, PageBackend, TailPool, check_page_spec, key_rotary, page_format, sink_tokens
from .format import PageFormat
from .plan import StepPlan, TailBook, WorkspacePart

logger = init_logger("vllm.gear_hf")  # under "vllm": its handler prints it


class GearAttentionBackend(PageBackend, CPUAttentionBackend):
    """CPU_ATTN's kernels over GEAR pages (installed in CPU_ATTN's place by plugin.register)."""

    @staticmethod
    def get_impl_cls() -> type["GearAttentionImpl"]:
        return GearAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["GearMetadataBuilder"]:
        return GearMetadataBuilder


# Requests with more query tokens than this in a step (prefill chunks) attend through CPU_ATTN over a workspace of
# their blocks: its bf16 kernels take a long prompt's scores as matrix products, where the paged kernel (built for
# a few query tokens per request) takes them a tile of 16 at a time; the prompt's own blocks are exact this step,
# so the workspace mostly holds what it would anyway.
PAGED_QUERIES = 16


@dataclass
class GearMetadata(CPUAttentionMetadata):
    plan: StepPlan | None = None
    workspace: WorkspacePart | None = None  # the requests attended through CPU_ATTN (None: none)


class GearMetadataBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's metadata plus the step plan; owns the tail book (which block holds which tail slot), shared by
    every layer of the group."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_page_spec(kv_cache_spec)
        self.tails = TailBook(vllm_config.scheduler_config.max_num_seqs, sink_tokens(kv_cache_spec.block_size))
        fmt = page_format(kv_cache_spec.block_size, kv_cache_spec.head_size, kv_cache_spec.dtype)
        self.reads_in_place = fmt.not_read_in_place() is None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GearMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        plan = StepPlan.build(self.tails, self.block_size, m.query_start_loc_cpu[: m.num_reqs + 1],
                              m.seq_lens[: m.num_reqs].cpu(), m.block_table_tensor[: m.num_reqs].cpu(),
                              m.num_actual_tokens)
        counts = np.diff(plan.query_start)
        requests = [r for r in range(m.num_reqs) if counts[r] > PAGED_QUERIES or not self.reads_in_place]
        part = None
        if requests:
            part = plan.workspace_part(requests)
            part.scheduler_metadata = base.scheduler_metadata if len(requests) == m.num_reqs else \
                self._scheduler_metadata(part)
        return GearMetadata(**vars(base), plan=plan, workspace=part)

    def _scheduler_metadata(self, part: WorkspacePart):
        """CPU_ATTN's scheduler metadata for the workspace part's requests alone (as the base builder makes it)."""
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(part.requests), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=part.seq_lens, dtype=self.dtype, query_start_loc=part.query_start,
            causal=True, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype)


class GearAttentionImpl(BlockWriter, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tail_pool: TailPool | None = None
        self.sink_pool: TailPool | None = None
        self.format: PageFormat | None = None
        self.paged = False  # (set with the format: `_reads_pages`)
        self.page_layouts: tuple = ()  # (keys, values) `paged.page_layout`s of the format, when paged
        self.max_num_seqs = get_current_vllm_config().scheduler_config.max_num_seqs
        self.rotary = key_rotary(self.head_size)

    def _setup(self, kv_cache: torch.Tensor, dtype: torch.dtype, block_size: int) -> None:
        self.format = page_format(block_size, self.head_size, dtype)
        self.paged, why = self._reads_pages(self.format)
        if self.paged:  # (where each stream's fields lie in a page, as the kernel reads them: once per layer)
            self.page_layouts = tuple(
                paged.page_layout(spec, tuple((name, *where) for name, where in layout.items()), block_size,
                                  self.head_size) for spec, layout in zip(self.format.specs, self.format.layout))
        if not self.paged:
            logger.info_once("GEAR: attention through a decoded workspace and CPU_ATTN (%s)", why)
        self._pools(block_size, dtype, kv_cache.device)
        logger.info_once("GEAR pages: %s, %d bytes per (block, KV head) (%.3f bits/element), block %d tokens, "
                         "pre-RoPE keys: %s; open-block tails %d bytes per running request per layer (at most %d "
                         "requests)", self.format.config.describe(), self.format.page_bytes,
                         self.format.bits_per_element(), block_size, self.rotary is not None,
                         self.tail_pool.slot_bytes(), self.max_num_seqs)

    def _reads_pages(self, fmt: PageFormat) -> tuple[bool, str]:
        """(whether the paged kernel reads this format's pages in place, why not)."""
        why = fmt.not_read_in_place()
        if why is None and (self.alibi_slopes is not None or self.logits_soft_cap or self.sinks is not None):
            why = "ALiBi, logit soft-capping or attention sinks: not in the paged kernel"
        return why is None, why or ""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the GEAR backend")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        plan: StepPlan = attn_metadata.plan
        pages = self._layer_pages(kv_cache, key.dtype, plan.block_size)
        T = attn_metadata.num_actual_tokens
        close_k, close_v = self._write(plan, key[:T], value[:T])
        part = attn_metadata.workspace
        if not self.paged and (part is None or len(part.requests) < len(plan.seq_lens)):  # (ALiBi, sinks...)
            part = plan.workspace_part(list(range(len(plan.seq_lens))))
            part.scheduler_metadata = attn_metadata.scheduler_metadata
        if self.paged and (part is None or len(part.requests) < len(plan.seq_lens)):
            self._attend_pages(plan, query[:T], pages, close_k, close_v, output[:T],
                               skip=part.requests if part is not None else ())
        if part is not None:
            self._attend_workspace(layer, plan, part, query[:T], pages, close_k, close_v, output[:T])
        self._store(plan, pages, close_k, close_v)
        return output

    def _attend_pages(self, plan: StepPlan, query, pages, close_k, close_v, output, skip=()) -> None:
        """The paged kernel: closed blocks read in place from their pages, written ones exact from the tails and
        the closing blocks; the requests in `skip` are left alone (their rows of output untouched)."""
        T, Hq, d = query.shape
        q = (query.float() * self.scale).contiguous().numpy()
        empty = np.zeros((0, 0), dtype=np.float32)
        cos, sin = self.rotary.halves(int(plan.seq_lens.max())) if self.rotary is not None else (empty, empty)
        out = np.empty((T, Hq, d), dtype=np.float32)
        tails = self.tail_pool
        lens = plan.seq_lens
        if len(skip):
            lens = lens.copy()
            lens[list(skip)] = 0  # (a request of no tokens is not attended)
        sinks = () if self.sink_pool is None else (plan.sink_slot, *map(_exact, (self.sink_pool.keys,
                                                                                  self.sink_pool.values)))
        paged.paged_attention(q, plan.query_start, lens, plan.page_table, plan.block_size, cos, sin,
                              pages.numpy(), *self.page_layouts,
                              *map(_exact, (tails.keys, tails.values, close_k, close_v)),
                              plan.first_closing, out, *sinks)
        result = torch.from_numpy(out)
        if len(skip):
            attended = torch.ones(T, dtype=torch.bool)
            for r in skip:
                attended[int(plan.query_start[r]): int(plan.query_start[r + 1])] = False
            output.view(T, Hq, d)[attended] = result[attended].to(output.dtype)
        else:
            output.view(T, Hq, d).copy_(result)

    def _staged(self, plan: StepPlan, which: torch.Tensor, close_k, close_v):
        """Blocks `which` of those written this step, [Q', bs, H, d] keys and values: closing ones staged, open
        ones' tails."""
        closes, keep = plan.stage_closes[which], plan.stage_keep[which]
        stage_k = close_k.new_empty(which.numel(), *close_k.shape[1:])
        stage_v = torch.empty_like(stage_k)
        index, opened = plan.stage_close_index[which][closes], keep[~closes]
        stage_k[closes], stage_v[closes] = close_k[index], close_v[index]
        stage_k[~closes], stage_v[~closes] = self.tail_pool.keys[opened], self.tail_pool.values[opened]
        return stage_k, stage_v

    def _attend_workspace(self, layer, plan: StepPlan, part: WorkspacePart, query, pages, close_k, close_v,
                          output) -> None:
        """The reference path, for the part's requests: their blocks decoded into a workspace in CPU_ATTN's layout
        (pages by the torch oracle, keys re-rotated when stored pre-RoPE; written blocks exact), then CPU_ATTN's
        kernel over it."""
        fmt, bs, H, d = self.format, plan.block_size, self.num_kv_heads, self.head_size
        stage_k, stage_v = self._staged(plan, part.stage, close_k, close_v)
        Q = part.stage.numel()
        k_parts, v_parts = [stage_k.view(Q * bs, H, d)], [stage_v.view(Q * bs, H, d)]
        slots = [(part.stage_ws[:, None] * bs + torch.arange(bs)).view(-1)]
        P = part.read.numel()
        if P:
            k_read, v_read = fmt.decode(pages[plan.read_blocks[part.read]])  # [P,H,bs,d]
            if self.rotary is not None:
                k_read = self.rotary.rotate(k_read, plan.read_first_position[part.read])
            sinks = plan.read_sink[part.read]
            first = torch.nonzero(sinks >= 0).flatten()
            if first.numel():  # requests' first blocks: their first tokens exact (`blocks`: sinks)
                S = plan.sink_tokens
                k_read[first, :, :S] = self.sink_pool.keys[sinks[first]].transpose(1, 2)
                v_read[first, :, :S] = self.sink_pool.values[sinks[first]].transpose(1, 2)
            k_parts.insert(0, k_read.transpose(1, 2).reshape(P * bs, H, d))
            v_parts.insert(0, v_read.transpose(1, 2).reshape(P * bs, H, d))
            slots.insert(0, (part.read_ws[:, None] * bs + torch.arange(bs)).view(-1))
        workspace = stage_k.new_zeros(part.blocks, H, 2 * bs, d)
        key_ws, value_ws = workspace.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(torch.cat(k_parts), torch.cat(v_parts), key_ws, value_ws,
                                       torch.cat(slots), layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)
        whole = len(part.requests) == len(plan.seq_lens)  # (the part's rows are every row, in order)
        part_out = output if whole else output.new_empty(part.query_rows.numel(), *output.shape[1:])
        ops.cpu_attention_with_kv_cache(
            query=query if whole else query[part.query_rows], key_cache=key_ws, value_cache=value_ws,
            output=part_out, query_start_loc=part.query_start, seq_lens=part.seq_lens, scale=self.scale,
            causal=True, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=part.table,
            softcap=self.logits_soft_cap, scheduler_metadata=part.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        if not whole:
            output[part.query_rows] = part_out

def _exact(blocks: torch.Tensor) -> np.ndarray:
    """Full-precision blocks as the paged kernel reads them: bf16 as its bits, float32 as is."""
    return (blocks.view(torch.int16) if blocks.dtype == torch.bfloat16 else blocks).numpy()
