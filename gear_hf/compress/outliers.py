"""Fixed-count outliers per vector (the sparse term S).

A vector is one channel along the chunk's tokens (axis="channel") or one token along its channels
(axis="token"). Each vector keeps `round(ratio * length)` of its extreme entries exactly (no minimum of one:
the stored count follows the ratio to within half an entry per vector). Which extremes: the split between
largest and smallest that leaves the narrowest range for the quantizer (the paper takes half from each side;
the narrower range is what makes the rest quantize better). Because the count is fixed, S is stored as dense
[..., k] value and index arrays instead of COO; an index counts positions inside its vector, so it takes the
smallest integer type that holds the vector length (`index_dtype`).
"""

from __future__ import annotations

import torch


def outliers_per_vector(vector_length: int, ratio: float) -> int:
    """k = round(ratio * length), at most half the vector (so the largest and smallest candidates never meet)."""
    if ratio <= 0:
        return 0
    return min(round(ratio * vector_length), vector_length // 2)


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
      index     int64, [B,H,k,d] (token index, axis="channel") or [B,H,n,k] (channel index, axis="token")
      slot_used bool, same shape: False for slots a short row leaves empty (they must hold value 0)
      mask      bool [B,H,n,d], True at chosen entries
    """
    B, H, n, d = x.shape
    vec = _vectors_last(x.float(), axis)  # [B,H,V,L]
    length = vec.shape[-1]
    k = outliers_per_vector(length, ratio)
    if k == 0:
        shape = (B, H, 0, d) if axis == "channel" else (B, H, n, 0)
        empty = torch.zeros(shape, dtype=torch.long, device=x.device)
        return empty, empty.bool(), torch.zeros_like(x, dtype=torch.bool)

    counts_vec = None  # valid entries per vector, when it is not the length
    if valid is None:
        entry_ok = torch.ones_like(vec, dtype=torch.bool)
        k_row = torch.full((B,), k, device=x.device)
    elif axis == "channel":
        entry_ok = valid[:, None, None, :].expand_as(vec)
        counts = valid.sum(dim=1).tolist()
        k_row = torch.tensor([outliers_per_vector(c, ratio) for c in counts], device=x.device)
        counts_vec = torch.tensor(counts, device=x.device)[:, None, None, None]
    else:
        entry_ok = valid[:, None, :, None].expand_as(vec)
        k_row = torch.full((B,), k, device=x.device)
    k_vec = k_row[:, None, None, None]  # [B,1,1,1]

    # k+1 largest, then k+1 smallest of the rest (padding never: its candidates are infinite)
    top_val, top_idx = vec.masked_fill(~entry_ok, float("-inf")).topk(min(k + 1, length), dim=-1)
    taken = torch.zeros_like(entry_ok).scatter_(-1, top_idx[..., :k], True)
    bottom_val, bottom_idx = vec.masked_fill(~entry_ok | taken, float("inf")).topk(
        min(k + 1, length - k), dim=-1, largest=False)
    # Taking j from the top and k-j from the bottom leaves the range [bottom[k-j], top[j]]: pick the narrowest.
    j = torch.arange(k + 1, device=x.device)
    hi = _at(top_val, j, float("-inf"))  # [B,H,V,k+1]
    p = (k_vec - j).clamp(min=0)  # taken from the bottom
    lo = _at(bottom_val, p, float("inf"))
    # a short vector (length < 2k+1): the rest ran out of bottom candidates, and the p-th smallest is one of the
    # k largest, the (n-1-p)-th of them
    n_vec = counts_vec if counts_vec is not None else length
    lo_among_top = _at(top_val, (n_vec - 1 - p).clamp(min=0), float("inf"))
    lo = torch.where(torch.isinf(lo) & (p >= n_vec - k), lo_among_top, lo)
    width = hi - lo
    width = torch.where((j <= k_vec) & torch.isfinite(width), width, float("inf"))  # padding: never preferred
    from_top = width.argmin(dim=-1, keepdim=True)  # [B,H,V,1]
    slot = torch.arange(k, device=x.device)
    chosen = torch.cat([slot < from_top, slot < k_vec - from_top], dim=-1)  # [B,H,V,2k], k_row True per vector
    candidates = torch.cat([top_idx[..., :k], bottom_idx[..., :k]], dim=-1)
    values = torch.cat([top_val[..., :k], bottom_val[..., :k]], dim=-1)
    order = torch.sort((~chosen).to(torch.uint8), dim=-1, stable=True).indices[..., :k]  # chosen slots first
    index = candidates.gather(-1, order)  # [B,H,V,k]
    slot_used = chosen.gather(-1, order) & torch.isfinite(values.gather(-1, order))

    mask_vec = torch.zeros_like(entry_ok).scatter_(-1, index, slot_used)
    mask = mask_vec.transpose(-1, -2) if axis == "channel" else mask_vec
    index = torch.where(slot_used, index, 0)
    if axis == "channel":
        index, slot_used = index.transpose(-1, -2), slot_used.transpose(-1, -2)  # [B,H,k,d]
    return index, slot_used, mask


def _at(values: torch.Tensor, position: torch.Tensor, missing: float) -> torch.Tensor:
    """values[..., position] with `missing` where position is past the end (values [..., m], position [..., p])."""
    m = values.shape[-1]
    position = position.expand(*values.shape[:-1], position.shape[-1])
    picked = values.gather(-1, position.clamp(max=m - 1))
    return torch.where(position < m, picked, torch.full_like(picked, missing))


def gather_entries(x: torch.Tensor, index: torch.Tensor, axis: str) -> torch.Tensor:
    """Values of x [B,H,n,d] at `index` (as returned by select_outliers)."""
    return x.gather(-2 if axis == "channel" else -1, index)


def scatter_add_entries(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor, axis: str) -> torch.Tensor:
    """out [B,H,n,d] += S, in place; unused slots hold value 0 (index 0), so they add nothing."""
    return out.scatter_add_(-2 if axis == "channel" else -1, index.long(), values.to(out.dtype))
