"""Torch tensors as the numpy arrays the numba loops read and write (no copy where the layout allows one)."""

from __future__ import annotations

import torch


def rows(t: torch.Tensor):
    """(a C-contiguous numpy array over the tensor t lies in, t's first row along dim 2) when t [B,H,N,...] is rows
    [at, at+N) of a C-contiguous [B,H,T,...] tensor (a slice of a workspace or a store field), else None. numba
    compiles C-contiguous arrays with unit strides, which is what lets loops vectorize. (Plain stride arithmetic:
    this runs a few times per layer and step.)"""
    if t.is_contiguous():
        return t.numpy(), 0
    shape, stride = t.shape, t.stride()
    inner = 1
    for size, step in zip(reversed(shape[3:]), reversed(stride[3:])):
        if step != inner and size > 1:
            return None
        inner *= size
    B, H, N = shape[:3]
    if stride[2] != inner:
        return None
    T = (stride[1] if H > 1 else stride[0]) // inner  # (B = H = 1: contiguous, returned above)
    offset = t.storage_offset()
    at = (offset // inner) % T if T else 0
    start = offset - at * inner  # where the [B,H,T,...] tensor t lies in begins
    if (H > 1 and stride[1] != T * inner) or (B > 1 and stride[0] != H * T * inner) or offset % inner \
            or at + N > T or (start + B * H * T * inner) * t.element_size() > t.untyped_storage().nbytes():
        return None
    whole = (B, H, T, *shape[3:])
    contiguous = [inner * T * H, inner * T, inner]
    for size in shape[3:]:
        contiguous.append(contiguous[-1] // size)
    return torch.as_strided(t, whole, contiguous, start).numpy(), at


def target(out: torch.Tensor):
    """(tensor to write, its `rows`): out itself, or a temporary to copy into out after when numba cannot view it."""
    whole = rows(out)
    if whole is None:
        out = torch.empty(out.shape, dtype=out.dtype)
        whole = rows(out)
    return (out, *whole)


def readable(t: torch.Tensor):
    """(array, first row) to read t through: `rows` (a slice viewed whole, no copy), else a contiguous copy."""
    return rows(t) or (t.contiguous().numpy(), 0)
