"""Host side of the fused decode attention: checks, tiling, split count, workspaces and the two launches.

`decode_attention` takes one layer's storage as views (`gear_hf.kernels.views`: tensors, no cache object); the
arguments of each compressed run come from one builder per stream kind (`args.key_run_args`,
`args.value_run_args`), named as the kernel's parameters and put in its order by `_positional`.
"""

from __future__ import annotations

import contextlib

import torch
import triton.language as tl

from .. import interpreting
from ..views import DecodeLayout, StreamView, key_outlier_count
from .args import _check, _check_words, _rotated, key_run_args, staged_args, tail_args, value_run_args
from .decode_kernel import _combine_kernel, _decode_attention_kernel
from .ops import _libdevice
from .sizing import _RESIDENT, BLOCK_TOKENS, _num_splits, _resident_programs, block_tokens, hadamard_table
from .tc_kernel import _tc_decode_kernel

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
LOG2E = 1.4426950408889634
M_TILE = 16  # query rows per program (G*q rows are split into tiles of 16: no spills at G*q = 32..128)


def _launch(kernel, grid, args, kwargs, plan: list | None):
    """Run kernel[grid](*args, **kwargs) and return the compiled kernel, or only record the launch in `plan`
    (scripts/dev/compile_check.py) and return None."""
    if plan is None:
        return kernel[grid](*args, **kwargs)
    plan.append((kernel, grid, args, kwargs))
    return None


def _positional(kernel, named: dict, constexprs: dict) -> tuple:
    """The kernel's runtime arguments in the order of its parameters, from `named` (every one named exactly once;
    the constexprs are passed by keyword)."""
    code = kernel.fn.__code__
    order = [name for name in code.co_varnames[: code.co_argcount] if name not in constexprs]
    missing, extra = sorted(set(order) - set(named)), sorted(set(named) - set(order))
    if missing or extra:
        raise TypeError(f"{kernel.fn.__name__}: arguments missing {missing}, unknown {extra}")
    return tuple(named[name] for name in order)


def _tc_block(keys: StreamView, values: StreamView) -> int:
    """The tensor-core kernel's default block: 64 tokens for runs without outliers or low-rank terms (compile report,
    sm_90, head_dim 128, 4 warps, 0 spills: GearConfig() 140 instructions/token/kv-head against 157 at 32, kivi-2 104
    / 109, compact 131 / 145), else 32 (gear-2 spills 174 ops at 64, gear-l-2 24)."""
    for key_run in (keys.prompt, keys.decode):
        if key_run is not None and (key_outlier_count(key_run) or key_run.lowrank_a.shape[-1]):
            return 32
    for value_run in (values.prompt, values.decode):  # (values.decode: None when each row's one chunk is held)
        if value_run is not None and (value_run.sparse_values.shape[-1] or value_run.lowrank_a.shape[-1]):
            return 32
    return 64


def decode_attention(query: torch.Tensor, keys: StreamView, values: StreamView, layout: DecodeLayout, *,
                     scaling: float, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                     sliding_window: int | None = None, out: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, workspace=None, tables=None, tensor_core: bool = False,
                     fold_values: bool = True, rope_on_query: bool = False, scratch=None,
                     _plan: list | None = None) -> torch.Tensor:
    """Attention of `query` [B,Hq,q,d] (already rotated) over one layer's compressed keys/values.

    keys/values: where the layer's tokens live (`views.StreamView`; a buffer held per token, `StreamView.tail`, is
    read as stored: 8-bit codes or 4-bit ones, rotated or not, this step's staged tokens exact from `buffer`);
    layout: per-row lengths and positions (`views.DecodeLayout`). Returns out [B, q, Hq, d] in query's dtype (HF's
    attention-function layout).
    Tuning: num_splits (flash-decoding splits; default sized to whole waves), block_n (tokens per block),
    num_warps, num_stages. workspace: (device, numel) -> a float32 buffer of >= numel elements the caller keeps
    (the cache shares one across its layers), else one is allocated for the call; tables: (key, build) -> the
    table build() makes, kept by the caller, else built for the call. tensor_core: run the tensor-core kernel
    (`tc_kernel`; `gear_hf.kernels.tensor_core_reason` says when it serves: 16-bit queries) instead of the register
    kernel; fold_values: (tensor_core) fold per-token value statistics into the probabilities where the format
    allows (False: only for compile_check's comparison); rope_on_query: (tensor_core, compile_check's comparison
    only) rotate the query back per token instead of the key tile; scratch: (device, numel) -> a zeroed float32
    buffer of >= numel elements the caller keeps (the tensor-core kernel scatters outliers into it and leaves it
    zeroed), else one is allocated for the call. _plan: record the launches in this list instead of running
    them (compile_check).
    """
    if _plan is None and query.device.type != "cuda" and not interpreting():
        raise RuntimeError("gear_hf fused attention needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "gear_hf.kernels modules are imported (CPU interpreter)")
    B, Hq, QL, D = query.shape
    if D < 32 or D & (D - 1):
        raise NotImplementedError(f"fused kernel: head_dim {D} must be a power of two >= 32")
    buf_k = _check_words(_check(keys.buffer, "buffer keys"), "buffer keys")
    buf_v = _check_words(_check(values.buffer, "buffer values"), "buffer values")
    Hkv = buf_k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split into {Hkv} KV heads")
    G = Hq // Hkv
    M = G * QL
    m_tiles = -(-M // M_TILE)
    HALF = D // 2
    dtype = query.dtype
    if dtype not in _TL:
        raise TypeError(f"fused kernel: query dtype {dtype} (fp16, bf16 or fp32)")
    if tuple(layout.rows.shape) != (B, 4) or tuple(layout.limits.shape) != (B, QL):
        raise ValueError(f"layout.rows must be [B, 4] = {(B, 4)} and layout.limits [B, q] = {(B, QL)}, got "
                         f"{tuple(layout.rows.shape)} and {tuple(layout.limits.shape)}")
    for name in ("rows", "limits", "positions"):
        t = getattr(layout, name)
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"layout.{name} must be int32 on {query.device}, got {t.dtype} on {t.device}")
    if tensor_core and dtype == torch.float32:
        raise NotImplementedError("tensor-core kernel: float32 queries (tensor cores take fp16/bf16 operands); use "
                                  "the register kernel (tensor_core=False)")
    dot_dt = tl.float32 if (dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())) else _TL[dtype]
    fast = _libdevice is not None and not interpreting()  # hardware sin/cos (the interpreter has none)
    if query.stride(-1) != 1:
        query = query.contiguous()

    has_sink = keys.sink is not None and layout.max_sink > 0
    if has_sink:
        _check_words(_check(keys.sink, "sink keys"), "sink keys")
        _check_words(_check(values.sink, "sink values"), "sink values")
    center = values.center  # (values handed centered: each row's output takes its KV head's center)
    if center is not None and not values.exact_centered:
        raise ValueError("values with exact_centered=False: this kernel reads the sink and the buffer's exact tokens "
                         "centered (StreamView.exact_centered must be True)")
    if center is not None and (tuple(center.shape) != (B, Hkv, D) or center.dtype != torch.float32
                               or center.stride(-1) != 1 or center.device != query.device):
        raise ValueError(f"values.center must be float32 [B, H, d] = {(B, Hkv, D)} with a contiguous last dim on "
                         f"{query.device}, got {center.dtype} {tuple(center.shape)} on {center.device}")
    if keys.held_chunk:
        raise ValueError("keys with a held chunk: the kernel reads a held chunk of values only (keys held too are "
                         "handed as stored, no held chunk: `FusedPath.kernel_views`)")
    value_chunks_lag = 1 if values.held_chunk else 0  # (a row's newest chunk of values is in its value buffer)
    decode_chunks = layout.max_decode_chunks if keys.decode is not None else 0
    if (keys.prompt is None) != (values.prompt is None) or \
            (values.decode is not None) != (decode_chunks > value_chunks_lag):
        raise ValueError("keys and values disagree on which chunk runs exist")
    NB = layout.buffer_size
    if block_n is None:
        block_n = block_tokens(NB, _tc_block(keys, values) if tensor_core else BLOCK_TOKENS)
    if block_n < 16 or block_n & (block_n - 1) or (decode_chunks and NB % block_n):
        raise NotImplementedError(f"fused kernel: a block of {block_n} tokens must be a power of two >= 16 "
                                  f"dividing buffer_size={NB}")
    prompt_chunks = 1 if (keys.prompt is not None and layout.max_prompt > 0) else 0
    # the compressed runs: the prompt chunk ("p") and the decode chunks ("d") of keys and values
    runs = {"p": (key_run_args(keys.prompt, prompt_chunks, query, D, "P_K", block_n),
                  value_run_args(values.prompt, prompt_chunks, query, D, "P_V", block_n)),
            "d": (key_run_args(keys.decode, decode_chunks, query, D, "D_K", block_n),
                  value_run_args(values.decode, decode_chunks - value_chunks_lag, query, D, "D_V", block_n))}
    used = [(keys.prompt, values.prompt)] if prompt_chunks else []
    used += [(keys.decode, values.decode)] if decode_chunks else []  # (values.decode None: held, not compressed)
    if tensor_core:  # bit planes of allocated widths: read as aligned 32-bit words (tc_tiles._tc_plane_words)
        for key_args, _ in runs.values():
            if key_args.constexprs["PLANES"]:
                _check_words(key_args.codes, "allocated key codes")
    rot_k = _rotated([k for k, _ in used], "keys")
    rot_v = _rotated([v for _, v in used], "values")
    # a buffer held per token (StreamView.tail) is read as stored (the values' centers in the basis they are attended
    # in); a full-precision one in rows of D elements
    tails = {"k": tail_args(keys, query, B, Hkv, D, "keys"),
             "v": tail_args(values, query, B, Hkv, D, "values", rotated_basis=rot_v)}
    s_buf = {stream: 0 if tails[stream].constexprs["BITS"] else buf.stride(1) for stream, buf in (("k", buf_k),
                                                                                                ("v", buf_v))}
    if decode_chunks and keys.decode.chunk_len != NB:
        raise ValueError(f"decode chunks hold {keys.decode.chunk_len} tokens but layout.buffer_size is {NB}")
    run_args, run_constexprs = {}, {}
    for run, (key_args, value_args) in runs.items():
        for args, constexprs in (key_args.kernel_args(run), value_args.kernel_args(run)):
            run_args.update(args)
            run_constexprs.update(constexprs)
    for stream, args in tails.items():
        args, constexprs = args.kernel_args(stream)
        run_args.update(args)
        run_constexprs.update(constexprs)
    run_args.update(staged_args(tails["k"], tails["v"], values.held_chunk))

    max_blocks = (-(-layout.max_sink // block_n) + -(-layout.max_prompt // block_n)
                  + layout.max_decode_chunks * (NB // block_n) + -(-layout.max_buffer // block_n))
    freq = inv_freq if inv_freq.dtype == torch.float32 and inv_freq.device == query.device else \
        inv_freq.to(device=query.device, dtype=torch.float32)
    freq = freq.contiguous()
    if freq.numel() != HALF:
        raise ValueError(f"inv_freq has {freq.numel()} entries, expected head_dim/2 = {HALF}")

    with torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext():
        programs = B * Hkv * m_tiles
        if num_warps is None:
            # Default launch: 4 warps, no software pipelining. Why: on the H200 (results/gpu, the earlier kernel)
            # 4 warps / 1 stage was 2.8x faster than 8 warps / 3 stages; and the compile report (sm_90, head_dim
            # 128, 32-token blocks) counts fewer main-loop instructions per token at 4 warps (the 16-row query tile
            # splits badly over 8 warps) with 0 spills for gear 2/4, kivi, gear-l and GearConfig() (gear-3: 40 B of
            # stack). 64-token blocks count fewer still but spill with outliers or rotation. Not yet timed on a GPU
            # for this kernel.
            # float32 dots (a float32 model) are FMA loops that need 8 warps' registers to stay unspilled.
            num_warps = 8 if dot_dt == tl.float32 else 4
        if num_stages is None:
            num_stages = 1
        kernel = _tc_decode_kernel if tensor_core else _decode_attention_kernel
        resident_key = (kernel.fn.__name__, query.device.index, num_warps, block_n, dtype, run_constexprs["P_K_BITS"],
                        run_constexprs["P_V_BITS"], run_constexprs["D_K_BITS"], run_constexprs["D_V_BITS"],
                        run_constexprs["T_K_BITS"], run_constexprs["T_V_BITS"])
        nsplit = num_splits or _num_splits(max_blocks, programs, query.device, _RESIDENT.get(resident_key, 1))
        nsplit = max(1, min(int(nsplit), 64))
        n_acc = programs * nsplit * M_TILE * D
        numel = n_acc + programs * nsplit * 2 * M_TILE
        ws = workspace(query.device, numel) if workspace is not None else \
            torch.empty(numel, dtype=torch.float32, device=query.device)
        acc_ws, ml_ws = ws[:n_acc], ws[n_acc:]
        if out is None:
            out = torch.empty(B, QL, Hq, D, dtype=dtype, device=query.device)
        elif tuple(out.shape) != (B, QL, Hq, D) or out.stride(-1) != 1:
            raise ValueError(f"out must be [B, q, Hq, d] = {(B, QL, Hq, D)} with a contiguous last dim")
        window = int(sliding_window or 0)
        build = lambda: hadamard_table(HALF, dot_dt, query.device)  # noqa: E731
        rot_tail = run_constexprs["T_K_ROT"] or run_constexprs["T_V_ROT"]  # (a coded tail of rotated vectors)
        had = query if not (rot_k or rot_v or rot_tail) else \
            tables(("hadamard", HALF, str(dot_dt), str(query.device)), build) if tables is not None else build()
        options = {"num_warps": num_warps, "num_stages": num_stages}
        constexprs = dict(G=G, QL=QL, D=D, HALF=HALF, BN=block_n, NB=NB, DT=dot_dt, FAST=fast, HAS_SINK=has_sink,
                          ROT_K=rot_k, ROT_V=rot_v, HELD_V=bool(values.held_chunk), **run_constexprs)
        if tensor_core:
            constexprs["FOLD_V"] = fold_values
            constexprs["ROPE_Q"] = rope_on_query
            # outlier scratch: [2, BN, D] float32 per program and split (keys, values), only for formats with outliers
            sparse = any(run_constexprs[f"{r}_K_SPARSE"] or run_constexprs[f"{r}_V_K2"] for r in "PD")
            n_scratch = programs * nsplit * 2 * block_n * D if sparse else 1
            scr = scratch(query.device, n_scratch) if scratch is not None else \
                torch.zeros(n_scratch, dtype=torch.float32, device=query.device)
        named = dict(q_ptr=query, sqb=query.stride(0), sqh=query.stride(1), sqq=query.stride(2),
                     lim_ptr=layout.limits, rows_ptr=layout.rows, pos_ptr=layout.positions,
                     spos=layout.positions.stride(0), freq_ptr=freq, attn_scale=float(attention_scaling),
                     sm_scale=float(scaling) * LOG2E, window=window,
                     sink_k=keys.sink if has_sink else query, sink_v=values.sink if has_sink else query,
                     s_sink_h=keys.sink.stride(1) if has_sink else 0, buf_k=buf_k, buf_v=buf_v,
                     s_buf_kh=s_buf["k"], s_buf_vh=s_buf["v"], **run_args, had_ptr=had, acc_ptr=acc_ws, ml_ptr=ml_ws,
                     H_KV=Hkv, M_TILES=m_tiles, NSPLIT=nsplit)
        if tensor_core:
            named["scr_ptr"] = scr
        compiled = _launch(kernel, (programs, nsplit), _positional(kernel, named, constexprs),
                           {**constexprs, **options}, _plan)
        if compiled is not None and resident_key not in _RESIDENT and query.device.type == "cuda":
            _RESIDENT[resident_key] = _resident_programs(compiled, num_warps)
        _launch(_combine_kernel, (B * Hkv, M), (acc_ws, ml_ws, out, out.stride(0), out.stride(1), out.stride(2),
                                                Hkv, m_tiles, nsplit, had, query if center is None else center,
                                                0 if center is None else center.stride(0),
                                                0 if center is None else center.stride(1)),
                dict(G=G, QL=QL, D=D, ROT_V=rot_v, CENTER=center is not None, num_warps=4), _plan)
    return out

