"""The fused Triton decode attention over one layer's storage views: `decode_attention`.

The code lives in `gear_hf.kernels.triton` (launch, argument builders, kernels, tiles); this module keeps the
import path `gear_hf.kernels.decode` (and the kernels' names, for compile_check and the GPU tests). The cache-facing
form that takes a GearCache layer is `gear_hf.cache.fused.cache_decode_attention`.
"""

from __future__ import annotations

from .triton.decode_kernel import _combine_kernel, _decode_attention_kernel
from .triton.launch import decode_attention

__all__ = ["decode_attention", "_decode_attention_kernel", "_combine_kernel"]
