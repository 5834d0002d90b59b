"""Fixed-count outliers per vector (the sparse term S).

A vector is one channel along the chunk's tokens (axis="channel") or one token along its channels
(axis="token"). Each vector keeps its `k` largest and `k` smallest entries exactly; because the count is
fixed, S is stored as dense [..., 2k] value and index arrays instead of COO; an index counts positions
inside its vector, so it takes the smallest integer type that holds the vector length (`index_dtype`).
"""

from __future__ import annotations

import torch


def outliers_per_side(vector_length: int, ratio: float) -> int:
    """k = round(ratio/2 * length), at least 1 when ratio > 0 and the vector is long enough for 2k slots."""
    if ratio <= 0 or vector_length < 2:
        return 0
    return max(1, min(round(ratio / 2 * vector_length), vector_length // 2))


def index_dtype(vector_length: int) -> torch.dtype:
    """uint8 up to 256 entries (a value vector, a decode chunk), int16 up to 32768, else int32."""
    if vector_length <= 256:
        return torch.uint8
    return torch.int16 if vector_length <= 32768 else torch.int32


def _vectors_last(x: torch.Tensor, axis: str) -> torch.Tensor:
    """[B,H,n,d] -> vectors along the last dim: [B,H,d,n] for axis="channel", [B,H,n,d] for "token"."""
    return x.transpose(-1, -2) if axis == "channel" else x


def select_outliers(x: torch.Tensor, axis: str, ratio: float, valid: torch.Tensor | None = None):
    """Choose the outlier entries of x [B,H,n,d].

    valid: [B, n] bool, False at padding (padding is never chosen, and a row's count k follows its number
    of valid tokens when vectors run along tokens).
    Returns (index, slot_used, mask):
      index     int64, [B,H,2k,d] (token index, axis="channel") or [B,H,n,2k] (channel index, axis="token")
      slot_used bool, same shape: False for slots a short row leaves empty (they must hold value 0)
      mask      bool [B,H,n,d], True at chosen entries
    """
    B, H, n, d = x.shape
    vec = _vectors_last(x.float(), axis)  # [B,H,V,L]
    length = vec.shape[-1]
    k = outliers_per_side(length, ratio)
    if k == 0:
        shape = (B, H, 0, d) if axis == "channel" else (B, H, n, 0)
        empty = torch.zeros(shape, dtype=torch.long, device=x.device)
        return empty, empty.bool(), torch.zeros_like(x, dtype=torch.bool)

    if valid is None:
        entry_ok = torch.ones_like(vec, dtype=torch.bool)
        k_row = torch.full((B,), k, device=x.device)
    elif axis == "channel":
        entry_ok = valid[:, None, None, :].expand_as(vec)
        counts = valid.sum(dim=1).tolist()
        k_row = torch.tensor([outliers_per_side(c, ratio) for c in counts], device=x.device)
    else:
        entry_ok = valid[:, None, :, None].expand_as(vec)
        k_row = torch.full((B,), k, device=x.device)

    top_val, top_idx = vec.masked_fill(~entry_ok, float("-inf")).topk(k, dim=-1)
    taken = torch.zeros_like(entry_ok).scatter_(-1, top_idx, True)
    bottom_val, bottom_idx = vec.masked_fill(~entry_ok | taken, float("inf")).topk(k, dim=-1, largest=False)
    index = torch.cat([top_idx, bottom_idx], dim=-1)  # [B,H,V,2k]
    chosen_ok = torch.cat([torch.isfinite(top_val), torch.isfinite(bottom_val)], dim=-1)
    slot = torch.arange(k, device=x.device).repeat(2)  # slot j of each side
    within_k = (slot[None, :] < k_row[:, None])[:, None, None, :]  # [B,1,1,2k]
    slot_used = chosen_ok & within_k  # padding is never chosen: its selections are infinite

    mask_vec = torch.zeros_like(entry_ok).scatter_(-1, index, slot_used)
    mask = mask_vec.transpose(-1, -2) if axis == "channel" else mask_vec
    if axis == "channel":
        index, slot_used = index.transpose(-1, -2), slot_used.transpose(-1, -2)  # [B,H,2k,d]
    return index, slot_used, mask


def gather_entries(x: torch.Tensor, index: torch.Tensor, axis: str) -> torch.Tensor:
    """Values of x [B,H,n,d] at `index` (as returned by select_outliers)."""
    return x.gather(-2 if axis == "channel" else -1, index)


def scatter_add_entries(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor, axis: str) -> torch.Tensor:
    """out [B,H,n,d] += S, in place; unused slots hold value 0, so duplicate indices are harmless."""
    return out.scatter_add_(-2 if axis == "channel" else -1, index.long(), values.to(out.dtype))
