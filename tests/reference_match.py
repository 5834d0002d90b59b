"""How a read through the CPU kernels must match the torch oracle (`gear_hf.compress.decompress`)."""

from __future__ import annotations

import torch


def assert_matches_oracle(got: torch.Tensor, expected: torch.Tensor, low_rank: bool) -> None:
    """Bit for bit, except that with a low-rank term (or a Hadamard rotation to undo) float32 rounding may differ
    (the numba kernels sum rank terms, and rotate by butterflies, in another order than the matmul): then within a
    few ulps of the largest entry."""
    if low_rank:
        tolerance = 4 * torch.finfo(torch.float32).eps * expected.abs().max()
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
    else:
        assert torch.equal(got, expected)
