"""Kernels for GEAR storage: Triton on GPUs, numba on CPUs (optional accelerators; the torch code in
`gear_hf.compress` and the reconstruct-then-attend path in `gear_hf.attention` stay the oracle).

Nothing here imports triton or numba at import time: `import gear_hf` (and `import gear_hf.kernels`) stay light.
The kernel modules are imported on first use:

* `gear_hf.kernels.quant`  - quantize + pack kernels writing exactly the `ChunkStore` layout
  (`quantize_pack`, bit-for-bit equal to `gear_hf.compress.quant`);
* `gear_hf.kernels.decode` - the fused decode attention over one layer's storage views (`decode_attention`; the
  code lives in `gear_hf.kernels.triton`);
* `gear_hf.kernels.cpu` - numba loops for CPUs: the fused decode attention (`cpu.decode_attention`); for the
  reference path a chunk run decompressed and keys rotated in one pass (bit for bit the torch functions without a
  low-rank term or rotation, to float32 rounding with one; float32 or bf16 outputs); a chunk's outliers, codes
  and residual compressed in one pass per plane (bit for bit `compress.gear.compute_backbone`), its low-rank
  factors fitted per plane (to float32 rounding).

Nothing here imports `gear_hf.cache`, `gear_hf.config` or `gear_hf.format` (kernels take tensors, specs and views;
tests/test_layering.py checks it): what takes a GearCache layer and builds its views, and the torch oracle and
fixtures over a cache, are in `gear_hf.cache.fused`. The developer tools that compile the kernels for a GPU without
one (`scripts/dev/compile_check.py`, `scripts/dev/triton_compile_check.py`) live outside the package.

Triton without a GPU: every launch fails unless TRITON_INTERPRET=1 is set *before* the kernel modules are
imported (triton decides at decoration time); the tests do that.

Which of them runs, and for which configuration, is the backends' business (`gear_hf.backends`); this module only
says what the kernels cover in terms of tensors, specs and numbers (`step_reason`, `reconstruct_supported`,
`quantize_pack_supports`, `tensor_core_reason`). Kernels take tensors and views, never configurations or caches.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["interpreting", "tensor_core_reason", "step_reason", "quantize_pack_supports",
           "reconstruct_supported", "MAX_FUSED_QUERY", "quantize_pack", "decode_attention", "reconstruct_run"]

_LAZY = {"quantize_pack": "quant", "decode_attention": "decode", "reconstruct_run": "triton.reconstruct"}

# The fused kernel is a decode kernel: steps with more new tokens per row (the prompt) use the torch path.
MAX_FUSED_QUERY = 16


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def tensor_core_reason(dtype) -> str | None:
    """None when the tensor-core decode kernel (`gear_hf.kernels.triton.tc_kernel`) serves a step whose storage
    the fused kernel covers (`gear_hf.backends.triton_backend.fused_supported`), else why the register kernel runs
    it instead. It reads every format the register kernel reads; what it needs is 16-bit dot operands."""
    import torch

    if dtype not in (torch.float16, torch.bfloat16):
        return (f"query dtype {dtype}: the tensor-core kernel takes fp16/bf16 operands (a float32 model runs the "
                "register kernel's float32 dots)")
    return None


def step_reason(head_dim: int, query_len: int, rotary_dim: int | None, softcap: float | None) -> str | None:
    """What in the step itself keeps both fused kernels (Triton and CPU) off it, whatever the storage; None if
    nothing does."""
    if rotary_dim is not None and rotary_dim != head_dim:
        return f"partial rotary ({rotary_dim} of {head_dim} channels rotated): the fused kernel rotates whole heads"
    if softcap:
        return f"attention logit soft-capping (softcap={softcap}): the fused kernel does not cap logits"
    if query_len > MAX_FUSED_QUERY:
        return f"{query_len} new tokens in one step (a prompt): the fused kernel is a decode kernel"
    return None


def reconstruct_supported(spec, head_dim: int) -> str | None:
    """None when the Triton reconstruction kernel (`reconstruct_run`) reads chunks of this ChunkSpec, else why not.
    It reads every built-in term (both axes, every width, allocated widths, outliers, int8/16-bit factors,
    rotation); registered extra terms are the torch oracle's."""
    from .views import MAX_FUSED_RANK  # no triton import

    if spec.extra_terms:
        return f"the reconstruction kernel does not implement the term(s) {list(spec.extra_terms)}"
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim}: the reconstruction kernel needs a power of two >= 32"
    if spec.rank > MAX_FUSED_RANK:
        return f"rank {spec.rank}: the reconstruction kernel reads low-rank factors of rank <= {MAX_FUSED_RANK}"
    return None


def quantize_pack_supports(spec, n: int, d: int) -> bool:
    """Whether `quantize_pack` covers this ChunkSpec for a chunk x [B,H,n,d] (else the torch engine quantizes): one
    width per stream (not widths allocated per channel), groups of whole packing units."""
    from ..compress.quant import pack_unit

    return not spec.allocated and spec.group_for(n, d) % pack_unit(spec.bits)[0] == 0


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'gear_hf.kernels' has no attribute {name!r}")
