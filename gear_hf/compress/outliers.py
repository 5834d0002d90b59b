"""Fixed-count outliers per vector (the sparse term S).

A vector is one channel along the chunk's tokens (axis="channel") or one token along its channels
(axis="token"). Each vector keeps `round(ratio * length)` of its extreme entries exactly (no minimum of one:
the stored count follows the ratio to within half an entry per vector). Which extremes: the split between
largest and smallest that leaves the narrowest range for the quantizer (the paper takes half from each side;
the narrower range is what makes the rest quantize better). Because the count is fixed, S is stored as dense
[..., k] value and index arrays instead of COO; an index counts positions inside its vector, so it takes the
smallest integer type that holds the vector length (`index_dtype`).

Equal values rank by position (the lower index first), so the choice is a function of the values alone. No full
sort or topk over the chunk: a few extremes per vector are taken one reduction at a time; more are ranked among
candidates that cheap block bounds guarantee to contain them (see `_extremes`).
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
    Ties: among equal values the entry with the lower index inside its vector ranks first (so the choice depends on
    the values and their order only, not on how a sort happens to break ties).
    Returns (index, slot_used, mask):
      index     int64, [B,H,k,d] (token index, axis="channel") or [B,H,n,k] (channel index, axis="token")
      slot_used bool, same shape: False for slots a short row leaves empty (they must hold value 0)
      mask      bool [B,H,n,d], True at chosen entries
    """
    B, H, n, d = x.shape
    length = n if axis == "channel" else d
    k = outliers_per_vector(length, ratio)
    if k == 0:
        shape = (B, H, 0, d) if axis == "channel" else (B, H, n, 0)
        empty = torch.zeros(shape, dtype=torch.long, device=x.device)
        return empty, empty.bool(), torch.zeros_like(x, dtype=torch.bool)

    entry_ok = None  # [B,1,n,1] valid entries, when there is padding
    counts_vec = None  # valid entries per vector, when it is not the length
    k_row = torch.full((B,), k, device=x.device)
    if valid is not None:
        entry_ok = valid[:, None, :, None]
        if axis == "channel":
            counts = valid.sum(dim=1).tolist()
            k_row = torch.tensor([outliers_per_vector(c, ratio) for c in counts], device=x.device)
            counts_vec = torch.tensor(counts, device=x.device)[:, None, None, None]
    k_vec = k_row[:, None, None, None]  # [B,1,1,1]

    # k+1 largest, then k+1 smallest of the rest (padding never: its slots hold -inf / +inf)
    top_val, top_idx, bottom_val, bottom_idx = _extremes(x, axis, k, entry_ok)  # [B,H,V,k+1] (fewer if short)
    # Taking j from the top and k-j from the bottom leaves the range [bottom[k-j], top[j]]: pick the narrowest.
    if valid is None and bottom_val.shape[-1] == k + 1:  # every vector full and long enough (length >= 2k+1)
        width = (top_val - bottom_val.flip(-1)).nan_to_num_(nan=float("inf"), neginf=float("inf"))  # [B,H,V,k+1]
    else:
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
    # slot s holds the s-th largest while s < from_top, then the (s - from_top)-th smallest; k_row slots per vector
    slot = torch.arange(k, device=x.device)
    on_top = slot < from_top  # [B,H,V,k]
    below = (slot - from_top).clamp_(min=0)
    index = torch.where(on_top, top_idx[..., :k], bottom_idx.gather(-1, below))  # [B,H,V,k]
    values = torch.where(on_top, top_val[..., :k], bottom_val.gather(-1, below))
    slot_used = (slot < k_vec) & torch.isfinite(values)
    index = torch.where(slot_used, index, 0)
    if axis == "channel":
        index, slot_used = index.transpose(-1, -2), slot_used.transpose(-1, -2)  # [B,H,k,d]
    # each entry is chosen at most once and unused slots (index 0) add 0: the sum is the 0/1 mask
    dim = -2 if axis == "channel" else -1
    mask = torch.zeros(x.shape, dtype=torch.uint8, device=x.device).scatter_add_(
        dim, index, slot_used.to(torch.uint8)).view(torch.bool)
    return index, slot_used, mask


# How _extremes finds each vector's extremes. Up to _EXTRACTION_MAX_SLOTS slots (k+1) per side it takes the extreme
# k+1 times (each a pass over the chunk); beyond, it ranks candidates, bounded with _BLOCKS_PER_SLOT blocks per slot
# (more blocks: a tighter bound, fewer candidates to rank, more block statistics to rank first; on SmolLM2's bf16 keys
# at T=1k, 2 per slot took ~0.93 ms per chunk, 4 took ~1.07 ms: kthvalue's cost grows faster than the candidates'
# count falls, 75 vs 60 per vector). Only the speed depends on it: the candidates always contain the extremes.
_EXTRACTION_MAX_SLOTS = 4
_BLOCKS_PER_SLOT = 2


class _Keys:
    """Ranking keys: one integer per entry, unique inside its vector, the value's order in the high half and its
    position in the vector in the low half (top keys hold `low - position`, so that equal values rank by position
    whichever way they are ranked). 16-bit values of vectors shorter than 2^16 fit int32 keys (16 + 16 bits: half
    the memory of int64 and faster integer passes on the CPU); anything else takes int64 keys (32 + 32 bits).
    Both order every value the same way, so the choice changes no ranking."""

    def __init__(self, value_dtype: torch.dtype, length: int) -> None:
        narrow = torch.finfo(value_dtype).bits == 16 and length < 1 << 16
        self.value_bits = 16 if narrow else 32
        self.dtype = torch.int32 if narrow else torch.int64
        self.low = (1 << self.value_bits) - 1  # the position half; positions stay below it
        self.min, self.max = torch.iinfo(self.dtype).min, torch.iinfo(self.dtype).max  # below / above every key

    def order(self, values: torch.Tensor) -> torch.Tensor:
        """Float values -> keys with the value's order in the high half and 0 in the low half (a new tensor): equal
        values, -0.0 and +0.0 included, get equal keys."""
        if self.value_bits == 16:
            bits = values.view(torch.int16).to(self.dtype)  # sign-extended
        else:
            bits = values.float().view(torch.int32).to(self.dtype)
        # sign-magnitude to two's complement: the magnitude bits, negated where the sign bit is set (-0.0 -> 0)
        sign = bits >> (self.value_bits - 1)  # -1 or 0
        magnitude = bits.bitwise_and_((1 << (self.value_bits - 1)) - 1)
        return magnitude.bitwise_xor_(sign).sub_(sign).bitwise_left_shift_(self.value_bits)

    def position(self, key: torch.Tensor, largest: bool, length: int) -> torch.Tensor:
        """The position (int64) held in the low half of a top key, or of an inverted (~) bottom key; a key at the
        limit (no entry left) gives length-1, which is then taken already or padding."""
        low = (key if largest else ~key) & self.low
        return (self.low - low if largest else low).clamp_(max=length - 1).long()


def _extremes(x: torch.Tensor, axis: str, k: int, entry_ok: torch.Tensor | None):
    """The min(k+1, L) largest entries of each vector of x [B,H,n,d], then the min(k+1, L-k) smallest of those
    left once the k largest are taken: (top_val, top_idx, bottom_val, bottom_idx), [B,H,V,m] float32 / int64,
    each ordered from the extreme inward, equal values in index order. entry_ok [B,1,n,1] (or None): entries
    that may be taken; slots without one hold -inf (top) / +inf (bottom).

    Three ways, one result: for a few slots, the extreme is taken k+1 times (_extract_extremes); else, on the CPU,
    only the candidates (_candidates: every entry that can be among them) are ranked; else whole vectors are (fast
    on a GPU, no host sync).
    """
    if k + 1 <= _EXTRACTION_MAX_SLOTS:
        return _extract_extremes(x, axis, k, entry_ok)
    if x.device.type == "cpu":
        compact = _candidates(x, axis, k, entry_ok)
        if compact is not None:
            values, positions, present = compact  # [B,H,V,C]
            return _sorted_extremes(values, present, k, x.shape[2 if axis == "channel" else 3], positions)
    vec = _vectors_last(x, axis)  # [B,H,V,L]
    ok = None if entry_ok is None else _vectors_last(entry_ok, axis).expand_as(vec)
    return _sorted_extremes(vec, ok, k, vec.shape[-1])


def _sorted_extremes(values: torch.Tensor, present: torch.Tensor | None, k: int, length: int,
                     positions: torch.Tensor | None = None):
    """_extremes of vectors values [..., C] (floating) whose entries are present where `present` (None: all), at
    `positions` inside their vector of `length` entries (None: 0..C-1, ascending)."""
    C = values.shape[-1]
    if positions is None:
        positions = torch.arange(C, device=values.device).expand(values.shape)
    # unique keys, so that topk ranks equal values by position (its own order among equal values is unspecified)
    keys = _Keys(values.dtype, length)
    order = keys.order(values)
    key_positions = positions.to(keys.dtype)  # (mixed integer types would take a slow promoting path)
    top_key = order | (keys.low - key_positions)
    bottom_key = order.bitwise_or_(key_positions)
    if present is not None:
        top_key.masked_fill_(~present, keys.min)
    top_order = top_key.topk(k + 1, dim=-1).indices  # largest first, [..., k+1]
    bottom_key.scatter_(-1, top_order[..., :k], keys.max)  # the k largest are taken
    if present is not None:
        bottom_key.masked_fill_(~present, keys.max)
    bottom_order = bottom_key.topk(min(k + 1, C - k), dim=-1, largest=False).indices  # smallest first
    top_val, bottom_val = values.gather(-1, top_order).float(), values.gather(-1, bottom_order).float()
    top_val.masked_fill_(top_key.gather(-1, top_order) == keys.min, float("-inf"))  # no entry left in the slot
    bottom_val.masked_fill_(bottom_key.gather(-1, bottom_order) == keys.max, float("inf"))
    return top_val, positions.gather(-1, top_order), bottom_val, positions.gather(-1, bottom_order)


def _extract_extremes(x: torch.Tensor, axis: str, k: int, entry_ok: torch.Tensor | None):
    """_extremes by taking the largest key k+1 times, then the smallest of the rest: reductions along the vectors in
    x's own layout (no transpose, no sort), 2k+2 of them."""
    dim = 2 if axis == "channel" else 3
    L = x.shape[dim]
    keys = _Keys(x.dtype, L)
    position = torch.arange(L, dtype=keys.dtype, device=x.device).view([L if i == dim else 1 for i in range(4)])
    order = keys.order(x)  # [B,H,n,d], unique keys as in _sorted_extremes
    top_key = order | (keys.low - position)
    # bottom keys bitwise inverted (~key = -key-1 reverses the order): the smallest is taken with amax as well
    bottom_key = order.bitwise_or_(position).bitwise_not_()
    if entry_ok is not None:
        top_key.masked_fill_(~entry_ok, keys.min)
        bottom_key.masked_fill_(~entry_ok, keys.min)

    def take(key_of: torch.Tensor, count: int, largest: bool) -> torch.Tensor:
        taken = []  # each [B,H,1,d] / [B,H,n,1]
        for _ in range(count):
            key = key_of.amax(dim=dim, keepdim=True)
            taken.append(key)
            key_of.scatter_(dim, keys.position(key, largest, L), keys.min)
        return torch.cat(taken, dim=dim)  # [B,H,count,d] / [B,H,n,count]

    top = take(top_key, k + 1, largest=True)
    top_pos = keys.position(top, True, L)
    bottom_key.scatter_(dim, top_pos.narrow(dim, 0, k), keys.min)  # the k largest are taken
    bottom = take(bottom_key, min(k + 1, L - k), largest=False)
    bottom_pos = keys.position(bottom, False, L)
    # slots with no entry left (key at the limit) hold -inf / +inf
    top_val = x.gather(dim, top_pos).float().masked_fill_(top == keys.min, float("-inf"))
    bottom_val = x.gather(dim, bottom_pos).float().masked_fill_(bottom == keys.min, float("inf"))
    return tuple(_vectors_last(t, axis) for t in (top_val, top_pos, bottom_val, bottom_pos))


def _candidates(x: torch.Tensor, axis: str, k: int, entry_ok: torch.Tensor | None):
    """The entries of each vector of x [B,H,n,d] that can be among its k+1 largest or, once the k largest are
    taken, the k+1 smallest of the rest, packed to the front: (values in x's dtype, positions int64, present bool),
    each [B,H,V,C] (C: the most candidates of any vector, at least k+1, in index order); None when nearly every
    entry is a candidate (ranking whole vectors is then as cheap).

    Bounds from block statistics: split each vector into m >= k+1 blocks; at least k+1 entries are >= the (k+1)-th
    largest block maximum (t_hi) and at least k+1 are <= the (k+1)-th smallest block minimum (t_lo). So every entry
    of the top k+1 is >= t_hi, and, when t_hi > t_lo, the k largest are all > t_lo and the k+1 smallest of the rest
    are <= t_lo (when t_hi <= t_lo every entry is a candidate). Equal values at a boundary are all candidates.
    """
    B, H, n, d = x.shape
    dim = 2 if axis == "channel" else 3
    L = x.shape[dim]
    block = max(1, L // (_BLOCKS_PER_SLOT * (k + 1)))
    blocks = L // block  # >= k+1 (k <= L // 2); a remainder shorter than a block joins no block
    xf = x.float()  # [B,H,n,d]: comparisons run several times faster on float32 than on 16-bit operands on the CPU
    hi_src = xf if entry_ok is None else xf.masked_fill(~entry_ok, float("-inf"))
    lo_src = xf if entry_ok is None else xf.masked_fill(~entry_ok, float("inf"))
    # block j: the entries j, j+m, j+2m, ... (interleaved: neighbouring tokens are alike, so blocks of consecutive
    # ones would have alike maxima and a loose bound)
    block_max = hi_src.narrow(dim, 0, blocks * block).unflatten(dim, (block, blocks)).amax(dim)  # m blocks
    block_min = lo_src.narrow(dim, 0, blocks * block).unflatten(dim, (block, blocks)).amin(dim)
    t_hi = block_max.kthvalue(blocks - k, dim=dim, keepdim=True).values  # (k+1)-th largest, [B,H,1,d] / [B,H,n,1]
    t_lo = block_min.kthvalue(k + 1, dim=dim, keepdim=True).values  # (k+1)-th smallest
    # candidates marked in x's own layout (contiguous; a transposed output would cost a copy), then listed by nonzero
    # through the vectors' view [B,H,V,L], vector by vector, positions ascending
    candidate = (xf >= t_hi).logical_or_(xf <= t_lo)  # [B,H,n,d]
    if entry_ok is not None:
        candidate &= entry_ok
    b, h, v, position = _vectors_last(candidate, axis).nonzero(as_tuple=True)
    V = x.shape[5 - dim]  # vectors per head
    vector = (b * H + h) * V + v  # flat id
    counts = torch.bincount(vector, minlength=B * H * V)  # (a sum over the bool mask would convert all of it first)
    per_vector = counts.view(B, H, V)
    width = max(int(counts.max()), k + 1)
    if 2 * width > L:
        return None
    first = counts.cumsum(0) - counts  # [B*H*V] where each vector's candidates start
    column = torch.arange(vector.numel(), device=x.device) - first[vector]
    shape = (*per_vector.shape, width)
    values = x.new_zeros(shape)
    # read through x's strides (a chunk sliced from a longer buffer is not contiguous: no copy of it)
    values.view(-1, width)[vector, column] = x[b, h, position, v] if axis == "channel" else x[b, h, v, position]
    positions = torch.zeros(shape, dtype=torch.long, device=x.device)
    positions.view(-1, width)[vector, column] = position
    present = torch.arange(width, device=x.device) < per_vector[..., None]
    return values, positions, present


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
