"""Host side of attention over paged GEAR storage (`paged_kernel`): where a page's fields lie, checks, the launch.

A page is one vLLM block of one KV head, [blocks, H, page_bytes] uint8: one compressed chunk of `block_size` tokens
of keys then one of values, each field (`gear_hf.compress` CompressedChunk fields) at a fixed byte offset
(`gear_hf.vllm.format.PageFormat.layout`), or for the raw format the keys and values themselves. The kernel gets a
typed pointer to each field of page 0 and moves it by whole pages; `page_stream` turns one stream's fields into those
offsets and the tile functions' constexprs once per format.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...compress.quant import MAX_CHANNEL_BITS, codes_per_unit, pack_unit
from .. import interpreting
from .ops import _libdevice
from .paged_kernel import _paged_attention_kernel
from .sizing import block_tokens, hadamard_table

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
LOG2E = 1.4426950408889634
QUERY_ROWS = 16  # query rows (tokens x GQA group) per program
# (kernel parameter, CompressedChunk field) of each stream, in the kernel's order
_KEY_FIELDS = (("kc", "codes"), ("kw", "channel_bits"), ("ks", "scale"), ("km", "minimum"), ("ksv", "sparse_values"),
               ("ksi", "sparse_index"), ("ka", "lowrank_a"), ("kb", "lowrank_b"), ("kas", "lowrank_a_scale"),
               ("kbs", "lowrank_b_scale"))
_VALUE_FIELDS = (("vc", "codes"), ("vs", "scale"), ("vm", "minimum"), ("vsv", "sparse_values"),
                 ("vsi", "sparse_index"), ("va", "lowrank_a"), ("vb", "lowrank_b"), ("vas", "lowrank_a_scale"),
                 ("vbs", "lowrank_b_scale"))
_NO_STREAM = {"BITS": 0, "UNIT": 1, "GROUP": 1, "R": 0, "STATS_ROW": False}
_NO_KEYS = {**_NO_STREAM, "K": 0, "PLANES": False, "ROW": 1}
_NO_VALUES = {**_NO_STREAM, "K2": 0, "CODES_W": 1, "STATS_W": 1, "BY_CHANNEL": False}


class PageStream(NamedTuple):
    """One stream (keys or values) of a page as the kernel reads it."""

    fields: dict  # CompressedChunk field -> (byte offset in a page, torch dtype, shape)
    constexprs: dict  # the kernel's K_* / V_* constexprs without their prefix
    rotated: bool  # stored Walsh–Hadamard-rotated


def _words(offset: int, what: str) -> None:
    if offset % 4:
        raise NotImplementedError(f"paged Triton kernel: {what} at byte offset {offset} of a page is read as 32-bit "
                                  "words and must be 4-byte aligned")


@functools.lru_cache(maxsize=64)
def page_stream(spec, fields: tuple, n: int, d: int, keys: bool) -> PageStream:
    """A stream of pages holding one chunk of n tokens of `spec` each, head_dim d; fields ((name, byte offset, torch
    dtype, shape), ...) of every CompressedChunk field (`PageFormat.layout`). Raises NotImplementedError for what
    the kernel does not read: keys not stored per channel, value outliers of values stored per channel, 8-bit key
    statistics, misaligned word fields, blocks of tokens that do not split into whole packing units."""
    where = {name: (offset, dtype, tuple(shape)) for name, offset, dtype, shape in fields}
    bn = block_tokens(n)
    group = spec.group_for(n, d)
    rank = where["lowrank_a"][2][-1]
    if spec.axis == "channel":  # codes packed along tokens, a row of statistics per token group
        unit = codes_per_unit(spec.bits, spec.allocated)
        if bn % unit or group % unit:
            raise NotImplementedError(f"paged Triton kernel: steps of {bn} tokens / group {group} do not align with "
                                      f"packing units of {unit} codes")
        if where["scale"][1] == torch.uint8:
            raise NotImplementedError("paged Triton kernel: 8-bit statistics of a stream stored per channel")
        if spec.bits != 3 and not spec.allocated:
            _words(where["codes"][0], "codes")
        if group % bn == 0:
            _words(where["scale"][0], "scale"), _words(where["minimum"][0], "minimum")
        grouped = {"BITS": MAX_CHANNEL_BITS if spec.allocated else spec.bits, "UNIT": unit, "GROUP": group,
                   "R": rank, "STATS_ROW": group % bn == 0}
        if keys:
            constexprs = {**grouped, "K": where["sparse_values"][2][0], "PLANES": spec.allocated,
                          "ROW": where["codes"][2][-1] if spec.allocated else d}
        else:
            if where["sparse_values"][2][0] and where["sparse_values"][2][-1]:
                raise NotImplementedError("paged Triton kernel: outliers of values stored per channel")
            constexprs = {**grouped, "K2": 0, "CODES_W": where["codes"][2][-1], "STATS_W": where["scale"][2][-1],
                          "BY_CHANNEL": True}
    elif keys:
        raise NotImplementedError("paged Triton kernel: keys must be stored per channel (key_axis='channel')")
    else:
        if spec.bits != 3:
            _words(where["codes"][0], "codes")
        constexprs = {"BITS": spec.bits, "UNIT": pack_unit(spec.bits)[0], "GROUP": min(group, d), "R": rank,
                      "STATS_ROW": False, "K2": where["sparse_values"][2][-1], "CODES_W": where["codes"][2][-1],
                      "STATS_W": where["scale"][2][-1], "BY_CHANNEL": False}
    return PageStream(where, constexprs, bool(spec.rotate))


def _field_pointer(pages: torch.Tensor, offset: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """pages (flat uint8) from byte `offset` on, viewed in `dtype`: the field of page 0 (pages itself for an empty
    field, never read)."""
    if nbytes == 0:
        return pages
    size = dtype.itemsize
    return pages[offset: offset + (pages.numel() - offset) // size * size].view(dtype)


def _stream_args(pages: torch.Tensor, stream: PageStream | None, names: tuple, prefix: str) -> tuple[dict, dict]:
    if stream is None:
        return {param: pages for param, _ in names}, {f"{prefix}_{k}": v for k, v in
                                                       (_NO_KEYS if prefix == "K" else _NO_VALUES).items()}
    args = {}
    for param, name in names:
        offset, dtype, shape = stream.fields[name]
        nbytes = dtype.itemsize
        for extent in shape:
            nbytes *= extent
        args[param] = _field_pointer(pages, offset, dtype, nbytes)
    return args, {f"{prefix}_{k}": v for k, v in stream.constexprs.items()}


_HADAMARD: dict = {}


def paged_attention(query: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
                    block_size: int, max_queries: int, pages: torch.Tensor, keys: PageStream | None,
                    values: PageStream | None, tail_k: torch.Tensor, tail_v: torch.Tensor, close_k: torch.Tensor,
                    close_v: torch.Tensor, first_closing: int, out: torch.Tensor, *, scale: float,
                    inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
                    sink_slot: torch.Tensor | None = None, sink_k: torch.Tensor | None = None,
                    sink_v: torch.Tensor | None = None) -> torch.Tensor:
    """Fill out [T, Hq, d] with the attention of query [T, Hq, d] over paged storage.

    starts int32 [R+1]: request r's query tokens are rows starts[r] .. starts[r+1]-1, the last of its lens[r] tokens
    (int32 [R]; 0: the request is skipped, its rows of out left as they are); max_queries: the most query tokens of a
    request; table int32 [R, >=blocks]: block j of request r is page table[r, j] >= 0 of pages [blocks, H,
    page_bytes] uint8, else -1 - s: tail slot s of tail_k/tail_v [S, bs, H, d], or for s >= first_closing closing
    block s - first_closing of close_k/close_v [C, bs, H, d] (keys after RoPE, the model dtype). keys/values: the
    streams' `page_stream`s, or None for the raw format (pages hold [K bs*d | V bs*d] in the model dtype).
    scale: the softmax scale; inv_freq [d/2]: the pages' keys are stored before RoPE and rotated at their positions
    (0, 1, ... within the request) with attention_scaling; None: stored after RoPE. sink_slot int32 [R]: request
    r's first n tokens are read from slot sink_slot[r] of sink_k/sink_v [slots, n, H, d] (the model dtype), not
    from its block 0's page (-1: from the page); None: no sinks."""
    if query.device.type != "cuda" and not interpreting():
        raise RuntimeError("gear_hf paged attention needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "gear_hf.kernels modules are imported (CPU interpreter)")
    T, Hq, d = query.shape
    R = lens.shape[0]
    H = tail_k.shape[2]
    if d < 32 or d & (d - 1) or Hq % H:
        raise NotImplementedError(f"paged Triton kernel: head_dim {d} must be a power of two >= 32 and {Hq} query "
                                  f"heads a multiple of {H} KV heads")
    if query.dtype not in _TL or tail_k.dtype != query.dtype or close_k.dtype != query.dtype:
        raise TypeError(f"paged Triton kernel: query, tails and closing blocks in one of fp16/bf16/fp32, got "
                        f"{query.dtype}, {tail_k.dtype}, {close_k.dtype}")
    if block_size % 16 or tuple(tail_k.shape[1:]) != (block_size, H, d) or tuple(close_k.shape[1:]) != \
            (block_size, H, d):
        raise ValueError(f"paged Triton kernel: blocks of {block_size} tokens (a multiple of 16); tails "
                         f"{tuple(tail_k.shape)} and closing {tuple(close_k.shape)} must be [*, {block_size}, {H}, "
                         f"{d}]")
    for name, t in (("starts", starts), ("lens", lens), ("table", table)):
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"paged Triton kernel: {name} must be int32 on {query.device}, got {t.dtype} on "
                             f"{t.device}")
    if starts.shape != (R + 1,) or table.dim() != 2 or table.shape[0] != R:
        raise ValueError(f"paged Triton kernel: starts [{R + 1}] and table [{R}, blocks], got {tuple(starts.shape)} "
                         f"and {tuple(table.shape)}")
    if pages.dtype != torch.uint8 or pages.dim() != 3 or pages.shape[1] != H or not pages.is_contiguous():
        raise ValueError(f"paged Triton kernel: pages must be contiguous uint8 [blocks, {H}, page_bytes], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    for name, t in (("query", query), ("out", out)):
        if t.shape != (T, Hq, d) or t.stride(-1) != 1:
            raise ValueError(f"paged Triton kernel: {name} must be [{T}, {Hq}, {d}] with a contiguous last dim, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    raw = keys is None
    if raw != (values is None):
        raise ValueError("paged Triton kernel: keys and values are both compressed streams or both raw (None)")
    if sink_slot is None:
        sink_slot, sink_k, sink_v = torch.full((R,), -1, dtype=torch.int32, device=query.device), tail_k, tail_v
        sinks = 0
    else:
        sinks = sink_k.shape[1]
        if sink_slot.shape != (R,) or sink_slot.dtype != torch.int32 or sink_slot.device != query.device or \
                sink_k.dtype != query.dtype or tuple(sink_k.shape[2:]) != (H, d) or not 0 < sinks <= 16 or \
                sink_v.shape != sink_k.shape:
            raise ValueError(f"paged Triton kernel: sink_slot must be int32 [{R}] on {query.device} and sink_k/sink_v "
                             f"{query.dtype} [slots, 1..16, {H}, {d}], got {sink_slot.dtype} "
                             f"{tuple(sink_slot.shape)}, {sink_k.dtype} {tuple(sink_k.shape)}")
    if R == 0 or T == 0:
        return out
    page_bytes = pages.shape[2]
    flat = pages.view(-1)
    # (no tail slot or no closing block: any pointer of the model dtype stands in, the table names none)
    tail_k, tail_v, close_k, close_v, sink_k, sink_v = (
        t if t.numel() else query for t in (tail_k, tail_v, close_k, close_v, sink_k, sink_v))
    if raw:
        k_args = {param: flat for param, _ in _KEY_FIELDS}
        k_args["kc"] = _field_pointer(flat, 0, query.dtype, 1)
        k_const = {f"K_{k}": v for k, v in _NO_KEYS.items()}
        v_args, v_const = _stream_args(flat, None, _VALUE_FIELDS, "V")
    else:
        k_args, k_const = _stream_args(flat, keys, _KEY_FIELDS, "K")
        v_args, v_const = _stream_args(flat, values, _VALUE_FIELDS, "V")
    G, half = Hq // H, d // 2
    dot_dt = tl.float32 if (query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and interpreting())) \
        else _TL[query.dtype]
    rope = inv_freq is not None and not raw
    freq = inv_freq.to(device=query.device, dtype=torch.float32).contiguous() if rope else flat
    if rope and freq.numel() != half:
        raise ValueError(f"paged Triton kernel: inv_freq has {freq.numel()} entries, expected head_dim/2 = {half}")
    rot_k, rot_v = (False, False) if raw else (keys.rotated, values.rotated)
    hadamard = flat
    if rot_k or rot_v:
        key = (half, dot_dt, query.device)
        if key not in _HADAMARD:
            _HADAMARD[key] = hadamard_table(half, dot_dt, query.device)
        hadamard = _HADAMARD[key]
    grid = (R * H, triton.cdiv(max_queries * G, QUERY_ROWS))
    with torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext():
        _paged_attention_kernel[grid](
            query, query.stride(0), query.stride(1), starts, lens, table, table.stride(0),
            tail_k, tail_v, close_k, close_v, first_closing, sink_slot, sink_k, sink_v, sinks, freq,
            float(attention_scaling), hadamard,
            out, out.stride(0), out.stride(1), float(scale) * LOG2E, H, page_bytes,
            *(k_args[param] for param, _ in _KEY_FIELDS), *(v_args[param] for param, _ in _VALUE_FIELDS),
            G=G, D=d, HALF=half, BS=block_size, BN=block_tokens(block_size), DT=dot_dt,
            FAST=_libdevice is not None and not interpreting(), RAW=raw, ROPE=rope, ROT_K=rot_k, ROT_V=rot_v,
            **k_const, **v_const, num_warps=8 if dot_dt == tl.float32 else 4, num_stages=1)
    return out
