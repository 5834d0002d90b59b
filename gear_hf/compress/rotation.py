"""Orthonormal Walsh–Hadamard rotation along head_dim (beyond GEAR; QuaRot-style).

Rotating a vector by H/sqrt(d) spreads a few large channels over all of them, so a group's range follows the
vector's norm instead of its largest channel. The normalized Sylvester matrix is symmetric and orthogonal, so
it is its own inverse: the same product rotates and un-rotates.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(d: int) -> torch.Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs head_dim a power of two, got head_dim={d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).float()  # [d, d], H = Hᵀ = H⁻¹


def hadamard(d: int, device=None) -> torch.Tensor:
    """The orthonormal [d, d] Walsh–Hadamard matrix in float32 (its own transpose and inverse)."""
    return _hadamard_cpu(d).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] @ H in float32; applying it twice gives x back (to float32 rounding)."""
    return x.float() @ hadamard(x.shape[-1], x.device)
