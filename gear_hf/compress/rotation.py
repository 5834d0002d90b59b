"""Orthonormal Walsh–Hadamard rotation along head_dim (beyond GEAR; QuaRot-style).

Rotating a vector by H/sqrt(b) spreads a few large channels over all of them, so a group's range follows the
vector's norm instead of its largest channel. The normalized Sylvester matrix is symmetric and orthogonal, so
it is its own inverse: the same product rotates and un-rotates. A head_dim that is not a power of two is rotated
in blocks of its largest power-of-two divisor b (block-diagonal, still orthonormal; d=96: three blocks of 32;
an odd d: b=1, no rotation).
"""

from __future__ import annotations

import functools
import math

import torch


def block_size(d: int) -> int:
    """The Hadamard block for head_dim d: its largest power-of-two divisor."""
    if d < 1:
        raise ValueError(f"head_dim={d} must be >= 1")
    return d & -d


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).float()  # [b, b], H = Hᵀ = H⁻¹


def hadamard(d: int, device=None) -> torch.Tensor:
    """The orthonormal [d, d] rotation in float32 (block-diagonal Walsh–Hadamard; its own transpose and inverse)."""
    b = block_size(d)
    return torch.block_diag(*[_hadamard_cpu(b)] * (d // b)).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated, in float32; applying it twice gives x back (to float32 rounding). Computed as the fast
    Walsh–Hadamard butterflies (pairs (k, k+s) of each 2s-block for s = 1, 2, .., b/2: sums and differences), then
    times the matrix's entry 1/sqrt(b) rounded to float32: the order of operations the CPU kernels follow
    (`kernels.cpu.dequant._hadamard_rows`), so they rotate bit for bit as this does (a matmul's sums follow the BLAS
    library's order)."""
    d = x.shape[-1]
    b = block_size(d)
    y = x.float()
    s = 1
    while s < b:
        pairs = y.reshape(*x.shape[:-1], d // (2 * s), 2, s)  # [..., blocks of 2s, (k, k+s), s]
        first, second = pairs.unbind(-2)
        y = torch.stack((first + second, first - second), dim=-2)
        s *= 2
    return (y * _hadamard_cpu(b)[0, 0]).reshape(x.shape)
