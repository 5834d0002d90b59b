"""The fused Triton decode attention over one layer's storage views: `decode_attention`.

The code lives in `gear_hf.kernels.triton` (launch, argument builders, kernels, tiles); this module keeps the
import path `gear_hf.kernels.decode` (and the kernels' names, for compile_check and the GPU tests) and the form that
takes a GearCache layer (`cache_decode_attention`).
"""

from __future__ import annotations

import torch

from .triton.decode_kernel import _combine_kernel, _decode_attention_kernel
from .triton.launch import decode_attention

__all__ = ["decode_attention", "cache_decode_attention", "_decode_attention_kernel", "_combine_kernel"]


def cache_decode_attention(cache, layer_idx: int, query: torch.Tensor, *, scaling: float,
                           inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           **tuning) -> torch.Tensor:
    """Fused attention of `query` [B,Hq,q,d] over layer `layer_idx` of a GearCache (`GearCache.kernel_views`:
    during a step what it attends to, between steps what the layer holds). Returns [B, q, Hq, d]."""
    keys, values, layout = cache.kernel_views(layer_idx, query.shape[2], query.device)
    return decode_attention(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                            attention_scaling=attention_scaling, sliding_window=sliding_window, out=out, **tuning)
