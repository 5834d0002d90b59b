"""The fused kernel's arguments of one layer's compressed runs, built in one place per stream kind.

`key_run_args` and `value_run_args` check a `ChunkRunView` (the prompt chunk or the decode chunks of one stream)
and turn it into a named structure of pointers, head strides and constexprs; its `kernel_args(run)` names them as
`_decode_attention_kernel`'s parameters of that run ("p": the prompt chunk, "d": the decode chunks; e.g. the prompt
keys' codes are `pkc`, their head stride `s_pkc`, their bits `P_K_BITS`). A run not in use gets placeholders (the
`dummy` tensor, zero strides) and constexprs that switch it off. `tail_args` does the same for a buffer held per token
(`views.CodedTailView`: "k"/"v", e.g. the key codes `tkc`, `T_K_BITS`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...compress.quant import MAX_CHANNEL_BITS, codes_per_unit, pack_unit
from ..views import (
    MAX_FUSED_RANK,
    OUTLIER_TILE,
    ChunkRunView,
    StreamView,
    affine_in_basis,
    key_outlier_count,
    prepare_derived,
)


def _check(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (GEAR storage always is)")
    return t


def _check_words(t: torch.Tensor, name: str) -> torch.Tensor:
    """Tensors the kernel reads as 32-bit words (2/4/8-bit codes: rows of d*bits/8 or d bytes; 16-bit sink and
    buffer tokens and key statistics: rows of d elements) hold whole words per row, so they must start on a
    4-byte boundary (torch allocations always do)."""
    if t.data_ptr() % 4:
        raise ValueError(f"{name} must start on a 4-byte boundary (read as 32-bit words), got address "
                         f"{t.data_ptr():#x}")
    return t


def _rank(run: ChunkRunView, prefix: str) -> int:
    r = run.lowrank_a.shape[-1]
    if r > MAX_FUSED_RANK:
        raise NotImplementedError(f"fused kernel: {prefix} low-rank rank {r} > {MAX_FUSED_RANK} (the torch path "
                                  "reads it)")
    return r


_NO_KEYS = {"BITS": 0, "UNIT": 1, "GROUP": 1, "R": 0, "SPARSE": False, "STATS_ROW": False, "PLANES": False, "ROW": 1}
_NO_VALUES = {"BITS": 0, "UNIT": 1, "GROUP": 1, "R": 0, "K2": 0, "CODES_W": 1, "STATS_W": 1, "BY_CHANNEL": False,
              "STATS_ROW": False}



def _param(name: str) -> str:
    """A kernel parameter's name: those that would shadow a builtin or a triton name carry a trailing underscore."""
    return {"pow": "pow_", "dot": "dot_"}.get(name, name)


class KeyRunArgs(NamedTuple):
    """A key run as the kernel reads it (tensors, their head strides dim 1, constexprs without the run's prefix)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    lowrank_a: torch.Tensor
    lowrank_b: torch.Tensor
    outlier_where: torch.Tensor  # key outliers sorted by token (views.prepare_derived), else placeholders
    outlier_value: torch.Tensor
    outlier_tile: torch.Tensor
    a_scale: torch.Tensor  # int8 factors: per-column scales of A and B, else placeholders
    b_scale: torch.Tensor
    widths: torch.Tensor  # key widths per channel [B,H,chunks,D] (PLANES), else a placeholder
    s_codes: int
    s_scale: int  # (the minimum's too)
    s_lowrank_a: int
    s_lowrank_b: int
    s_outliers: int  # (where and value)
    s_tiles: int
    tiles: int  # outlier tiles per chunk (the prompt's; the kernel knows the decode chunks')
    segment: int  # outlier entries per chunk: 2k per channel x head_dim
    s_factor_scales: int
    s_widths: int
    constexprs: dict

    def kernel_args(self, run: str) -> tuple[dict, dict]:
        """(runtime arguments, constexprs) named as the kernel's parameters of run "p" or "d"."""
        r = run
        args = {f"{r}kc": self.codes, f"{r}ks": self.scale, f"{r}km": self.minimum, f"{r}ka": self.lowrank_a,
                f"{r}kb": self.lowrank_b, f"s_{r}kc": self.s_codes, f"s_{r}ks": self.s_scale,
                f"s_{r}ka": self.s_lowrank_a, f"s_{r}kb": self.s_lowrank_b,
                _param(f"{r}ow"): self.outlier_where, f"{r}ov": self.outlier_value, _param(f"{r}ot"): self.outlier_tile,
                f"s_{r}ow": self.s_outliers, f"s_{r}ot": self.s_tiles, f"{r}_seg": self.segment,
                f"{r}kas": self.a_scale, f"{r}kbs": self.b_scale, f"s_{r}kas": self.s_factor_scales,
                f"{r}kw": self.widths, f"s_{r}kw": self.s_widths}
        if r == "p":
            args["p_tiles"] = self.tiles
        return args, {f"{r.upper()}_K_{k}": v for k, v in self.constexprs.items()}


class ValueRunArgs(NamedTuple):
    """A value run as the kernel reads it (tensors, their head strides dim 1, constexprs without the run's prefix)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    sparse_values: torch.Tensor
    sparse_index: torch.Tensor
    lowrank_a: torch.Tensor
    lowrank_b: torch.Tensor
    a_scale: torch.Tensor  # int8 factors: per-column scales of A and B, else placeholders
    b_scale: torch.Tensor
    s_codes: int
    s_scale: int  # (the minimum's too)
    s_sparse: int  # (values and index)
    s_lowrank_a: int
    s_lowrank_b: int
    s_factor_scales: int
    constexprs: dict

    def kernel_args(self, run: str) -> tuple[dict, dict]:
        """(runtime arguments, constexprs) named as the kernel's parameters of run "p" or "d"."""
        r = run
        args = {f"{r}vc": self.codes, f"{r}vs": self.scale, f"{r}vm": self.minimum, f"{r}vsv": self.sparse_values,
                f"{r}vsi": self.sparse_index, f"{r}va": self.lowrank_a, f"{r}vb": self.lowrank_b,
                f"s_{r}vc": self.s_codes, f"s_{r}vs": self.s_scale, f"s_{r}vsp": self.s_sparse,
                f"s_{r}va": self.s_lowrank_a, f"s_{r}vb": self.s_lowrank_b,
                f"{r}vas": self.a_scale, f"{r}vbs": self.b_scale, f"s_{r}vas": self.s_factor_scales}
        return args, {f"{r.upper()}_V_{k}": v for k, v in self.constexprs.items()}


def key_run_args(run: ChunkRunView | None, chunks_used: int, dummy: torch.Tensor, head_dim: int, prefix: str,
                 block_n: int) -> KeyRunArgs:
    """The kernel's arguments of a key run; outliers sorted by `prepare_derived` (taken from run.derived when the
    cache provides it, else derived here: a per-step cost). prefix names the run in errors ("P_K", "D_K")."""
    if run is None or chunks_used == 0:
        return KeyRunArgs(*[dummy] * 11, s_codes=0, s_scale=0, s_lowrank_a=0, s_lowrank_b=0, s_outliers=0, s_tiles=0,
                          tiles=1, segment=0, s_factor_scales=0, s_widths=0, constexprs=dict(_NO_KEYS))
    f = {name: _check(getattr(run, name), f"{prefix}.{name}") for name in
         ("codes", "scale", "minimum", "lowrank_a", "lowrank_b")}
    spec = run.spec
    if spec.axis != "channel":
        raise NotImplementedError("fused kernel: keys must be stored per channel (key_axis='channel')")
    grouped = _token_grouped_constexprs(run, head_dim, prefix, block_n)
    k2 = key_outlier_count(run)
    if k2 and spec.rotate:
        raise NotImplementedError("fused kernel: key outliers of rotated keys (rotation='keys'/'both' with a sparse "
                                  "term) are only applied by the torch path")
    derived = {}
    if k2:
        derived = run.derived if "key_outlier_where" in run.derived else \
            prepare_derived(run, chunks_used)  # (a view not prepared by the Triton backend: derived here)
        for name in ("key_outlier_where", "key_outlier_value", "key_outlier_tile"):
            if name not in derived:
                raise ValueError(f"{prefix}: run.derived lacks {name!r} (use gear_hf.kernels.views.prepare_derived)")
            _check(derived[name], f"{prefix}.derived.{name}")
        where, value, tile = derived["key_outlier_where"], derived["key_outlier_value"], derived["key_outlier_tile"]
        if where.shape[2] < chunks_used * k2 * head_dim or tile.shape[2] < chunks_used:
            raise ValueError(f"{prefix}: run.derived covers fewer than the {chunks_used} chunks in use")
    else:
        where = value = tile = dummy
    a_scale, b_scale, s_factor_scales = _factor_scales(run, dummy, prefix)
    widths, s_widths = _key_widths(run, dummy, prefix)
    # PLANES: widths per channel, codes in bit planes of ROW bytes per 8 tokens (else ROW = head_dim bytes per row)
    constexprs = {**grouped, "R": _rank(run, prefix), "SPARSE": k2 > 0, "PLANES": spec.allocated,
                  "ROW": run.codes.shape[-1] if spec.allocated else head_dim}
    return KeyRunArgs(f["codes"], f["scale"], f["minimum"], f["lowrank_a"], f["lowrank_b"], where, value, tile,
                      a_scale, b_scale, widths, s_codes=f["codes"].stride(1), s_scale=f["scale"].stride(1),
                      s_lowrank_a=f["lowrank_a"].stride(1), s_lowrank_b=f["lowrank_b"].stride(1),
                      s_outliers=where.stride(1) if k2 else 0, s_tiles=tile.stride(1) if k2 else 0,
                      tiles=-(-run.chunk_len // OUTLIER_TILE), segment=k2 * head_dim,
                      s_factor_scales=s_factor_scales, s_widths=s_widths, constexprs=constexprs)


def _token_grouped_constexprs(run: ChunkRunView, head_dim: int, prefix: str, block_n: int) -> dict:
    """Checks and constexprs of a run stored per channel over token groups (keys; values with
    value_axis="channel"): codes packed along tokens, read as 32-bit words of 4 channels' bytes (2/4/8 bits), one
    row of statistics per group (STATS_ROW: once per block when a group spans whole blocks)."""
    spec = run.spec
    group = spec.group_for(run.chunk_len, head_dim)
    unit = codes_per_unit(spec.bits, spec.allocated)
    if run.chunk_len % unit or group % unit:
        raise NotImplementedError(f"fused kernel: chunk of {run.chunk_len} tokens / group {group} does not align "
                                  f"with packing units of {unit} codes")
    if spec.bits != 3 and not spec.allocated:
        _check_words(run.codes, f"{prefix}.codes")
    _check_words(run.scale, f"{prefix}.scale"), _check_words(run.minimum, f"{prefix}.minimum")
    # widths per channel (keys only): BITS only marks the run present (the widths are read per chunk)
    return {"BITS": MAX_CHANNEL_BITS if spec.allocated else spec.bits, "UNIT": unit, "GROUP": group,
            "STATS_ROW": group % block_n == 0}




def value_run_args(run: ChunkRunView | None, chunks_used: int, dummy: torch.Tensor, head_dim: int, prefix: str,
                   block_n: int) -> ValueRunArgs:
    """The kernel's arguments of a value run (per token, or per channel over token groups: read like keys, without
    outliers). prefix names the run in errors ("P_V", "D_V")."""
    if run is None or chunks_used == 0:
        return ValueRunArgs(*[dummy] * 9, s_codes=0, s_scale=0, s_sparse=0, s_lowrank_a=0, s_lowrank_b=0,
                            s_factor_scales=0, constexprs=dict(_NO_VALUES))
    names = ("codes", "scale", "minimum", "sparse_values", "sparse_index", "lowrank_a", "lowrank_b")
    f = {name: _check(getattr(run, name), f"{prefix}.{name}") for name in names}
    spec = run.spec
    # row strides of codes and statistics within a head: the fields' last dims (CODES_W, STATS_W)
    widths = {"CODES_W": f["codes"].shape[-1], "STATS_W": f["scale"].shape[-1], "R": _rank(run, prefix)}
    if spec.axis == "channel":  # the keys' layout ([B,H,P(n),d] codes, [B,H,n/g,d] statistics)
        if f["sparse_values"].shape[2]:
            raise NotImplementedError("fused kernel: outliers of values stored per channel (value_axis='channel' "
                                      "with a sparse term) are only applied by the torch path")
        constexprs = {**_token_grouped_constexprs(run, head_dim, prefix, block_n), **widths, "K2": 0,
                      "BY_CHANNEL": True}
    else:
        if spec.bits != 3:
            _check_words(run.codes, f"{prefix}.codes")
        constexprs = {"BITS": spec.bits, "UNIT": pack_unit(spec.bits)[0],
                      "GROUP": spec.group_for(run.chunk_len, head_dim), **widths, "K2": f["sparse_values"].shape[-1],
                      "BY_CHANNEL": False, "STATS_ROW": False}
    a_scale, b_scale, s_factor_scales = _factor_scales(run, dummy, prefix)
    return ValueRunArgs(*(f[n] for n in names), a_scale, b_scale, s_codes=f["codes"].stride(1),
                        s_scale=f["scale"].stride(1), s_sparse=f["sparse_values"].stride(1),
                        s_lowrank_a=f["lowrank_a"].stride(1), s_lowrank_b=f["lowrank_b"].stride(1),
                        s_factor_scales=s_factor_scales, constexprs=constexprs)


def _key_widths(run: ChunkRunView, dummy: torch.Tensor, prefix: str) -> tuple:
    """(widths per channel (uint8 [B,H,chunks,D]), their head stride) of an allocated key run, else placeholders."""
    if not run.spec.allocated:
        return dummy, 0
    widths = _check(run.channel_bits, f"{prefix}.channel_bits")
    return widths, widths.stride(1)


def _factor_scales(run: ChunkRunView, dummy: torch.Tensor, prefix: str) -> tuple:
    """(A's scales, B's scales, their head stride) of a run with int8 low-rank factors, else placeholders."""
    if run.lowrank_a.dtype != torch.int8:
        return dummy, dummy, 0
    a_scale = _check(run.lowrank_a_scale, f"{prefix}.lowrank_a_scale")
    b_scale = _check(run.lowrank_b_scale, f"{prefix}.lowrank_b_scale")
    if a_scale.shape != b_scale.shape or a_scale.shape[2] != run.capacity:
        raise ValueError(f"{prefix}: int8 factor scales must be [B, H, capacity={run.capacity}, r], got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    return a_scale, b_scale, a_scale.stride(1)


def _rotated(runs: list, what: str) -> bool:
    """Whether the compressed runs in use store `what` Walsh–Hadamard-rotated (all of them or none)."""
    flags = {bool(run.spec.rotate) for run in runs if run is not None}
    if len(flags) > 1:
        raise ValueError(f"fused kernel: the prompt and decode chunks disagree on whether {what} are rotated")
    return flags == {True}



_TAIL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class TailArgs(NamedTuple):
    """A stream's buffer held per token (`views.CodedTailView`) as the kernel reads it: codes, scale, minimum, this
    step's exact tokens and which they are, their strides (codes, statistics, exact tokens: dim 1; staged: dim 0),
    how many slots have staged flags, constexprs BITS (0: the buffer is full precision) and ROT."""

    codes: torch.Tensor  # uint8 [B,H,cap,d*bits/8]
    scale: torch.Tensor  # [B,H,cap,1]
    minimum: torch.Tensor
    exact: torch.Tensor  # [B,H,cap,d] (staged tokens), or a placeholder when none is staged
    staged: torch.Tensor  # uint8 [B,cap] (1: read from exact), or a placeholder
    s_codes: int
    s_scale: int  # (the minimum's too)
    s_exact: int
    s_staged: int
    staged_n: int  # slots with staged flags: capacity, or 0 when none is staged
    constexprs: dict
    affine: torch.Tensor | None = None  # float32 [B,H,2,d] (a centered buffer), or a placeholder
    s_affine: int = 0

    def kernel_args(self, stream: str) -> tuple[dict, dict]:
        """(runtime arguments, constexprs) named as the kernel's parameters of stream "k" or "v" (the staged flags:
        `staged_args`), and the centers (tka, s_tka, T_K_AFF; tva ...)."""
        t = f"t{stream}"
        args = {f"{t}c": self.codes, f"{t}s": self.scale, f"{t}m": self.minimum, f"{t}e": self.exact,
                f"s_{t}c": self.s_codes, f"s_{t}s": self.s_scale, f"s_{t}e": self.s_exact, f"{t}a": self.affine,
                f"s_{t}a": self.s_affine}
        return args, {f"T_{stream.upper()}_{k}": v for k, v in self.constexprs.items()}


def staged_args(keys: TailArgs, values: TailArgs, held_values: bool = False) -> dict:
    """The kernel's one set of staged flags (stg, s_stg, stg_n) for both streams, from a coded one: this step's own
    tokens are the same in the key and the value store (written by the same steps), so keys' and values' flags
    agree (`CodedTokenStore.write`); a pair where one stream has staged tokens and the other none is refused.
    held_values: the values' flags (a row's value buffer starts with its held chunk: the kernel reads the values'
    flags of a buffer token buffer_size slots after the keys')."""
    coded = [t for t in (keys, values) if t.constexprs["BITS"]]
    if len({t.staged_n > 0 for t in coded}) > 1 or (not held_values and len({t.staged_n for t in coded}) > 1):
        raise ValueError(f"keys.tail.staged and values.tail.staged disagree: staged flags for "
                         f"{[t.staged_n for t in coded]} slots (both None, or both [B, capacity])")
    src = values if held_values else coded[0] if coded else keys
    return {"stg": src.staged, "s_stg": src.s_staged, "stg_n": src.staged_n}


def tail_args(view: StreamView, dummy: torch.Tensor, batch: int, heads: int, head_dim: int, name: str,
              rotated_basis: bool = False) -> TailArgs:
    """The kernel's arguments of a stream's coded buffer (`view.tail`), checked; placeholders and BITS=0 when the
    buffer is full precision (`view.buffer`). name: the stream in errors ("keys", "values"); rotated_basis: the
    kernel attends the tokens rotated (values under ROT_V: their centers are handed rotated, `affine_in_basis`)."""
    tail = view.tail
    if tail is None:
        return TailArgs(*[dummy] * 5, s_codes=0, s_scale=0, s_exact=0, s_staged=0, staged_n=0,
                        constexprs={"BITS": 0, "ROT": False, "AFF": False}, affine=dummy)
    bits = int(tail.bits)
    if bits not in (4, 8):
        raise ValueError(f"{name}.tail.bits = {tail.bits}: the Triton decode kernels read 8-bit codes or 4-bit codes "
                         "two a byte (format.INT8_TOKENS, INT8_ROTATED_TOKENS, INT4_TOKENS)")
    cap = tail.codes.shape[2] if tail.codes.dim() == 4 else -1
    want = {"codes": ((batch, heads, cap, head_dim * bits // 8), (torch.uint8,)),
            "scale": ((batch, heads, cap, 1), _TAIL_FLOATS), "minimum": ((batch, heads, cap, 1), _TAIL_FLOATS)}
    for field, (shape, dtypes) in want.items():
        t = getattr(tail, field)
        if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != dummy.device:
            raise ValueError(f"{name}.tail.{field} must be {[str(d) for d in dtypes]} {list(shape)} ([B, H, capacity, "
                             f"{'d*bits/8' if field == 'codes' else '1'}]) on {dummy.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
        _check(t, f"{name}.tail.{field}")
    _check_words(tail.codes, f"{name}.tail.codes")  # (rows read as 32-bit words)
    if tail.staged is None:
        exact, staged, s_exact, s_staged, n = dummy, dummy, 0, 0, 0
    else:
        staged, exact = tail.staged, view.buffer
        if tuple(staged.shape) != (batch, cap) or staged.dtype != torch.bool or staged.device != dummy.device:
            raise ValueError(f"{name}.tail.staged must be bool [B, capacity] = {[batch, cap]} on {dummy.device}, got "
                             f"{staged.dtype} {list(staged.shape)} on {staged.device}")
        if tuple(exact.shape) != (batch, heads, cap, head_dim) or exact.dtype not in _TAIL_FLOATS:
            raise ValueError(f"{name}.buffer (this step's exact tokens beside a coded tail) must be a float "
                             f"[B, H, capacity, d] = {[batch, heads, cap, head_dim]}, got {exact.dtype} "
                             f"{list(exact.shape)}")
        _check_words(_check(exact, f"{name}.buffer"), f"{name}.buffer")
        staged = _check(staged, f"{name}.tail.staged").view(torch.uint8)
        s_exact, s_staged, n = exact.stride(1), staged.stride(0), cap
    affine, s_affine = dummy, 0
    if tail.affine is not None:
        want = (batch, heads, 2, head_dim)
        if tuple(tail.affine.shape) != want or tail.affine.dtype != torch.float32 or tail.affine.device != dummy.device:
            raise ValueError(f"{name}.tail.affine must be None or float32 {list(want)} ([B, H, 2, d]: scales, "
                             f"centers) on {dummy.device}, got {tail.affine.dtype} {list(tail.affine.shape)} on "
                             f"{tail.affine.device}")
        affine = _check(affine_in_basis(tail, rotated_basis), f"{name}.tail.affine")
        s_affine = affine.stride(1)
    return TailArgs(tail.codes, tail.scale, tail.minimum, exact, staged, s_codes=tail.codes.stride(1),
                    s_scale=tail.scale.stride(1), s_exact=s_exact, s_staged=s_staged, staged_n=n,
                    constexprs={"BITS": bits, "ROT": bool(tail.rotated), "AFF": tail.affine is not None},
                    affine=affine, s_affine=s_affine)
