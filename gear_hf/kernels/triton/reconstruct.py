"""Host side of the reconstruction kernel: `reconstruct_run` checks a run's fields, names its constexprs and
launches `_reconstruct_kernel` once for the whole run (every row, head, chunk and block).

It takes tensors and a `views.ChunkRunView` (no store, no cache); derived state (the key outliers sorted by token)
and the Hadamard table come from the caller, who owns them (the store's `derived`, the cache's tables).
"""

from __future__ import annotations

import contextlib

import torch
import triton.language as tl

from ...compress.quant import MAX_CHANNEL_BITS, codes_per_unit, pack_unit
from .. import interpreting
from ..views import OUTLIER_TILE, ChunkRunView, key_outlier_count
from .args import _check, _check_words
from .reconstruct_kernel import _reconstruct_kernel
from .sizing import hadamard_table

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
BLOCK_TOKENS = 64  # tokens per tile (a power of two >= 16: the one-hot and low-rank dots)
TILES_PER_PROGRAM = 4  # tiles one program decodes in turn (the chunk's factors and tables read once for them)


def reconstruct_run(run: ChunkRunView, chunks: int, out: torch.Tensor, rotary=None, derived: dict | None = None,
                    tables=None, block_n: int = BLOCK_TOKENS, _plan: list | None = None) -> torch.Tensor:
    """The first `chunks` chunks of `run` decompressed into out [B,H,chunks*chunk_len,d] (any strides with a
    contiguous last dim; its dtype is the result's), keys rotated when rotary = (cos, sin) [B|1,1,chunks*n,d]
    (the model's tables at the run's columns). derived: `views.prepare_derived` of a run with outliers per
    channel (else derived here, a per-call cost); tables: (key, build) -> the table build() makes, kept by the
    caller. _plan: record the launch instead of running it (compile_check)."""
    if _plan is None and out.device.type != "cuda" and not interpreting():
        raise RuntimeError("the reconstruction kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "gear_hf.kernels modules are imported (CPU interpreter)")
    spec, n = run.spec, run.chunk_len
    B, H = run.codes.shape[:2]
    d = out.shape[-1]
    if tuple(out.shape) != (B, H, chunks * n, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [B,H,chunks*n,d] = {(B, H, chunks * n, d)} with a contiguous last dim, got "
                         f"{tuple(out.shape)}")
    if out.dtype not in _TL:
        raise TypeError(f"reconstruction kernel: output dtype {out.dtype} (fp16, bf16 or fp32)")
    if d < 32 or d & (d - 1):
        raise NotImplementedError(f"reconstruction kernel: head_dim {d} must be a power of two >= 32")
    half = d // 2
    dot_dt = tl.float32 if (out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and interpreting())) \
        else _TL[out.dtype]
    f = {name: _check(getattr(run, name), f"run.{name}") for name in ChunkRunView.FIELDS}
    by_channel = spec.axis == "channel"
    unit = codes_per_unit(spec.bits, spec.allocated)
    if n % unit:
        raise NotImplementedError(f"reconstruction kernel: {n} tokens per chunk is not a whole number of packing "
                                  f"units of {unit} codes")
    _check_words(f["codes"], "run.codes")  # (every layout is read as 32-bit words)
    rank = f["lowrank_a"].shape[-1]
    if rank > 16:
        raise NotImplementedError(f"reconstruction kernel: low-rank rank {rank} > 16")
    int8 = f["lowrank_a"].dtype == torch.int8
    k_channel = key_outlier_count(run) if by_channel else 0
    placeholder = out
    if k_channel:  # (added in the stored basis, before the rotation is undone, as the oracle adds them)
        derived = derived if derived and "key_outlier_where" in derived else _prepare(run, chunks)
        where, value, tile = derived["key_outlier_where"], derived["key_outlier_value"], derived["key_outlier_tile"]
    else:
        where = value = tile = placeholder
    widths = _check(run.channel_bits, "run.channel_bits") if spec.allocated else placeholder
    group = spec.group_for(n, d)
    constexprs = dict(
        D=d, HALF=half, BN=block_n, TILES=TILES_PER_PROGRAM, DT=dot_dt, BY_CHANNEL=by_channel,
        BITS=MAX_CHANNEL_BITS if spec.allocated else spec.bits, UNIT=unit if by_channel else pack_unit(spec.bits)[0],
        GROUP=group, STATS_ROW=by_channel and group % block_n == 0 and n % block_n == 0, PLANES=spec.allocated,
        ROW=f["codes"].shape[-1], STATS_W=f["scale"].shape[-1],
        K2=0 if by_channel else f["sparse_values"].shape[-1], CH_SPARSE=k_channel > 0, SEG=k_channel * d,
        R=rank, ROT=bool(spec.rotate), ROPE=rotary is not None,
        # bf16 model and tables: RoPE in bf16 arithmetic, as the reference path (2: emulated, the interpreter)
        ROPE_BF16=(2 if interpreting() else 1) if rotary is not None and out.dtype == torch.bfloat16
        and rotary[0].dtype == torch.bfloat16 else 0)
    if rotary is not None:
        cos, sin = rotary
        if cos.shape[-1] != d or cos.stride(-1) != 1 or sin.stride() != cos.stride() or cos.shape[-2] != chunks * n:
            raise ValueError(f"rotary cos/sin must be [B|1,1,{chunks * n},{d}] with a contiguous last dim, got "
                             f"{tuple(cos.shape)}")
        if cos.element_size() == 2 and (cos.data_ptr() % 4 or sin.data_ptr() % 4 or cos.stride(-2) % 2):
            raise ValueError(f"16-bit rotary cos/sin are read as 32-bit words: their rows must start on 4-byte "
                             f"boundaries, got addresses {cos.data_ptr():#x}/{sin.data_ptr():#x}, row stride "
                             f"{cos.stride(-2)}")
        rotary_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(-2))
    else:
        cos = sin = placeholder
        rotary_strides = (0, 0)
    build = lambda: hadamard_table(half, dot_dt, out.device)  # noqa: E731
    had = placeholder if not spec.rotate else \
        tables(("hadamard", half, str(dot_dt), str(out.device)), build) if tables is not None else build()
    args = (out, out.stride(0), out.stride(1), out.stride(2), cos, sin, *rotary_strides,
            f["codes"], f["scale"], f["minimum"], f["codes"].stride(1), f["scale"].stride(1),
            f["sparse_values"], f["sparse_index"], f["sparse_values"].stride(1),
            where, value, tile, where.stride(1) if k_channel else 0, tile.stride(1) if k_channel else 0,
            -(-n // OUTLIER_TILE),
            f["lowrank_a"], f["lowrank_b"], f["lowrank_a"].stride(1), f["lowrank_b"].stride(1),
            f["lowrank_a_scale"] if int8 else placeholder, f["lowrank_b_scale"] if int8 else placeholder,
            f["lowrank_a_scale"].stride(1) if int8 else 0,
            widths, widths.stride(1) if spec.allocated else 0, had, H, n)
    grid = (B * H, chunks, -(-n // (block_n * TILES_PER_PROGRAM)))
    options = {"num_warps": 4, "num_stages": 1}
    if _plan is not None:
        _plan.append((_reconstruct_kernel, grid, args, {**constexprs, **options}))
        return out
    with torch.cuda.device(out.device) if out.device.type == "cuda" else contextlib.nullcontext():
        _reconstruct_kernel[grid](*args, **constexprs, **options)
    return out


def _prepare(run: ChunkRunView, chunks: int) -> dict:
    from ..views import prepare_derived

    return prepare_derived(run, chunks)
