"""Kernels for GEAR storage: Triton on GPUs, numba on CPUs (optional accelerators; the torch code in
`gear_hf.compress` and the reconstruct-then-attend path in `gear_hf.attention` stay the oracle).

Nothing here imports triton or numba at import time: `import gear_hf` (and `import gear_hf.kernels`) stay light.
The kernel modules are imported on first use:

* `gear_hf.kernels.quant`  - quantize + pack kernels writing exactly the `ChunkStore` layout
  (`quantize_pack`, bit-for-bit equal to `gear_hf.compress.quant`);
* `gear_hf.kernels.decode` - the fused decode attention over one layer's storage views (`decode_attention`; the
  code lives in `gear_hf.kernels.triton`);
* `gear_hf.kernels.compile_check` - compiles the kernels for sm_90/sm_80 with ptxas on a machine without a GPU;
* `gear_hf.kernels.cpu` - numba loops for CPUs: the fused decode attention (`cpu.decode_attention`); for the
  reference path a chunk run decompressed and keys rotated in one pass (bit for bit the torch functions without a
  low-rank term or rotation, to float32 rounding with one; float32 or bf16 outputs); a chunk's outliers, codes
  and residual compressed in one pass per plane (bit for bit `compress.gear.compute_backbone`), its low-rank
  factors fitted per plane (to float32 rounding).

Nothing here imports `gear_hf.cache` (kernels take tensors and views; tests/test_layering.py checks it): what takes
a GearCache layer and builds its views, and the torch oracle and fixtures over a cache, are in `gear_hf.cache.fused`.
The one exception is the command-line tool `compile_check`, which builds caches to plan real launches and which no
module imports.

Triton without a GPU: every launch fails unless TRITON_INTERPRET=1 is set *before* the kernel modules are
imported (triton decides at decoration time); the tests do that.

Backend choice (`resolve_backend`): GearConfig.backend "torch" / "triton" / "numba" force a path; "auto" (the
default) is overridden by the environment variable GEAR_HF_BACKEND (auto|torch|triton|numba), and otherwise
picks triton for CUDA tensors when triton imports, numba for CPU tensors when numba imports, else torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass

import torch

from ..config import BACKENDS
from ..rope import apply_rotary

__all__ = ["triton_available", "numba_available", "interpreting", "resolve_backend", "cpu_kernels", "rotate",
           "all_finite", "fused_supported", "use_fused",
           "quantize_pack_supports",
           "quantize_pack", "decode_attention"]

_LAZY = {"quantize_pack": "quant", "decode_attention": "decode"}

NUMBA_MISSING = ("GEAR backend 'numba' was forced but numba is not installed (pip install 'gear-hf[cpu]'); use "
                 "backend='auto' or 'torch'")

# The fused kernel is a decode kernel: steps with more new tokens per row (the prompt) use the torch path.
MAX_FUSED_QUERY = 16


def _importable(*modules: str) -> bool:
    """True when every module imports (checked without leaving the first half-imported when it is absent). A broken
    install (a CPU-only triton wheel without its backend, a numba too old for the installed numpy) counts as
    absent."""
    if importlib.util.find_spec(modules[0]) is None:
        return False
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when `import triton` works (checked once)."""
    return _importable("triton", "triton.language")


@functools.lru_cache(maxsize=None)
def numba_available() -> bool:
    """True when `import numba` works (the CPU kernels' compiler; checked once)."""
    return _importable("numba")


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_backend(config, device=None) -> str:
    """'torch', 'triton' or 'numba' for a GearConfig and the device the tensors live on.

    "torch"/"triton"/"numba" in the config are forced; "auto" first looks at GEAR_HF_BACKEND, then picks triton
    for CUDA tensors when triton imports, numba (the CPU kernels, `gear_hf.kernels.cpu`) for CPU tensors when
    numba imports, else torch. A forced "triton" without CUDA needs TRITON_INTERPRET=1 (checked at launch); a
    forced "numba" needs numba and CPU tensors.
    """
    choice = getattr(config, "backend", "auto")
    if choice == "auto":
        env = os.environ.get("GEAR_HF_BACKEND", "auto").strip().lower() or "auto"
        if env not in BACKENDS:
            raise ValueError(f"GEAR_HF_BACKEND={env!r} is invalid; allowed: {' | '.join(BACKENDS)}")
        choice = env
    is_cuda = getattr(device, "type", device) == "cuda"
    if choice == "numba" and is_cuda:
        raise ValueError("GEAR backend 'numba' runs the CPU kernels and the tensors are on CUDA; use "
                         "backend='auto' (Triton on CUDA) or 'torch'")
    if choice != "auto":
        return choice
    if is_cuda:
        return "triton" if triton_available() else "torch"
    return "numba" if numba_available() else "torch"


def cpu_kernels(config, device):
    """`gear_hf.kernels.cpu` when the config's backend resolves to numba for `device`, else None."""
    if resolve_backend(config, device) != "numba":
        return None
    if not numba_available():  # forced (gear_hf.enable refuses that up front; a bare GearCache gets here)
        raise ValueError(NUMBA_MISSING)
    return _cpu_module()


@dataclass(frozen=True)
class Backend:
    """The one field of a GearConfig that `resolve_backend` reads (for stores that keep only that)."""

    backend: str


def rotate(config, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """`apply_rotary(x, cos, sin, out=out)` (keys before RoPE, at read): in one pass of the CPU kernel where it
    applies. scratch: `apply_rotary`'s, for the torch path."""
    cpu = cpu_kernels(config, x.device)
    if cpu is not None and cpu.rotate_supported(x, cos, out):
        return cpu.rotate_into(x, cos, sin, out)
    return apply_rotary(x, cos, sin, out=out, scratch=scratch)


def all_finite(config, x: torch.Tensor) -> torch.Tensor:
    """torch.isfinite(x).all() (a 0-dim bool on x's device): one integer pass of the CPU kernel where it applies
    (what a cache compresses is checked once per step; torch's check of a bf16 tensor is several times slower)."""
    cpu = cpu_kernels(config, x.device)
    flag = cpu.all_finite(x) if cpu is not None else None
    return torch.isfinite(x).all() if flag is None else flag


@functools.lru_cache(maxsize=None)
def _cpu_module():
    return importlib.import_module(".cpu", __name__)  # (asked a few times per layer and step: looked up once)


def fused_supported(config, head_dim: int, query_len: int, *, rotary_dim: int | None = None,
                    softcap: float | None = None) -> str | None:
    """None when the fused decode kernel covers this configuration and step, else the reason it does not.

    rotary_dim: channels per head the model's RoPE rotates (None: all); softcap: the attention-logit soft cap
    the model's attention function is given (Gemma 2), None when it has none."""
    if not config.pre_rope:
        return "pre_rope=False (keys stored after RoPE) is only implemented by the torch path"
    if config.compresses and config.key_axis != "channel":
        return (f"key_axis={config.key_axis!r}: the fused kernel reads keys stored per channel (key_axis='channel') "
                "only")
    if config.compresses and config.value_axis == "channel" and config.uses_outliers:
        return (f"value_axis='channel' with value outliers (method={config.method!r}): the fused kernel adds value "
                "outliers per token only")
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim}: the fused kernel needs a power of two >= 32"
    reason = _step_reason(head_dim, query_len, rotary_dim, softcap)
    if reason:
        return reason
    if config.compresses:
        from ..compress.quant import codes_per_unit

        reason = _fused_storage_reason(config)
        if reason:
            return reason
        block = config.buffer_size & -config.buffer_size  # largest power of two dividing n_b
        if block < 16:
            return f"buffer_size={config.buffer_size} is not a multiple of 16 (kernel tiles are 16 tokens at least)"
        for bits, group, allocated in ((config.key_bits, config.key_group, config.key_bit_allocation == "query"),
                                       (config.value_bits, config.value_group, False)):
            unit = codes_per_unit(bits, allocated)
            if group % unit and not config.coarse_groups:
                return f"group size {group} is not a multiple of the {unit} codes of a {bits}-bit packing unit"
    return None


def _step_reason(head_dim: int, query_len: int, rotary_dim: int | None, softcap: float | None) -> str | None:
    """What in the step itself keeps both fused kernels (Triton and CPU) off it, whatever the storage; None if
    nothing does."""
    if rotary_dim is not None and rotary_dim != head_dim:
        return f"partial rotary ({rotary_dim} of {head_dim} channels rotated): the fused kernel rotates whole heads"
    if softcap:
        return f"attention logit soft-capping (softcap={softcap}): the fused kernel does not cap logits"
    if query_len > MAX_FUSED_QUERY:
        return f"{query_len} new tokens in one step (a prompt): the fused kernel is a decode kernel"
    return None


def _fused_storage_reason(config) -> str | None:
    """Storage options that the fused decode kernel does not read; the torch path does."""
    from .views import MAX_FUSED_RANK  # no triton import

    if config.uses_lowrank and max(config.rank_prefill, config.rank_decode) > MAX_FUSED_RANK:
        return (f"rank_prefill={config.rank_prefill}/rank_decode={config.rank_decode}: the fused kernel reads "
                f"low-rank factors of rank <= {MAX_FUSED_RANK}")
    if config.rotation in ("keys", "both") and config.uses_outliers and config.outlier_ratio > 0:
        return (f"rotation={config.rotation!r} with key outliers (method={config.method!r}): the fused kernel adds "
                "key outliers in the unrotated basis only")
    return None


def quantize_pack_supports(spec, n: int, d: int) -> bool:
    """Whether `quantize_pack` covers this ChunkSpec for a chunk x [B,H,n,d] (else the torch engine quantizes): one
    width per stream (not widths allocated per channel), groups of whole packing units."""
    from ..compress.quant import pack_unit

    return not spec.allocated and spec.group_for(n, d) % pack_unit(spec.bits)[0] == 0


def use_fused(config, query, *, training: bool = False, output_attentions: bool = False,
              rotary_dim: int | None = None, softcap: float | None = None) -> bool:
    """Whether the shared attention forward should take the fused path for this step.

    auto: on CUDA with triton, on CPU with numba (`cpu.attend_supported`: the CPU kernel reads every storage the
    read kernels do), only for supported steps. Forced "triton": every supported step; an unsupported
    *configuration* raises (a prompt step, which the kernel does not cover, still uses torch).
    """
    backend = resolve_backend(config, query.device)
    if backend not in ("triton", "numba") or training or output_attentions:
        return False
    if backend == "numba":
        return (_step_reason(query.shape[-1], query.shape[-2], rotary_dim, softcap) is None
                and cpu_kernels(config, query.device).attend_supported(config, query.shape[-1], query.dtype) is None)
    reason = fused_supported(config, query.shape[-1], query.shape[-2], rotary_dim=rotary_dim, softcap=softcap)
    if reason is None:
        return True
    forced = config.backend == "triton" or (config.backend == "auto" and
                                            os.environ.get("GEAR_HF_BACKEND", "").strip().lower() == "triton")
    if forced and query.shape[-2] <= MAX_FUSED_QUERY:
        raise NotImplementedError(f"GEAR backend 'triton' was forced but {reason}; use backend='auto' or 'torch'")
    return False


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'gear_hf.kernels' has no attribute {name!r}")
