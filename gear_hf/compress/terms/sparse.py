"""The sparse outliers S: per vector, the s/2 largest and s/2 smallest entries kept exactly.

Fields (k = outliers per vector: keys per channel along tokens, values per token along channels):
    sparse_values  side                      [k, d] (axis="channel") or [n, k] (axis="token"); 0 at unused slots
    sparse_index   uint8 / int16 / int32     the same shape: the entry's index inside its vector

An outlier's value is stored as X - D̂ at its entry, with a code chosen so that D̂ + S rounds to X in the model
dtype (`exact_outliers`): reconstruction is additive and exact there.
"""

from __future__ import annotations

import torch

from .. import outliers, quant
from .base import DecodeState, EncodeState, Field, Term

# The (code, S) pairs exact_outliers tries, in order: codes this many steps from the quantized one, and for each, S
# this many ulps from the nearest 16-bit value.
_CODE_STEPS = (0, 1, -1, 2, -2)
_ULP_STEPS = (0, 1, -1, 2, -2)


def exact_outliers(target: torch.Tensor, code: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                   bits: int, model_dtype: torch.dtype, store_dtype: torch.dtype):
    """(code, S) at outlier entries such that D̂ + S = code*scale + minimum + S, computed in float32 as decompress
    does, rounds to `target` in model_dtype. An outlier's code is free (it takes no part in its group's stats):
    nearby codes and S one or two ulps off the nearest are tried (_CODE_STEPS x _ULP_STEPS), first hit kept; else
    the clamped code and the nearest S (only where no 16-bit S can reach: a 32-bit model, or an entry far outside
    its group's range).

    target/scale/minimum: float32 at the entries [*E]; code: uint8 there.
    """
    if target.device.type == "cpu":
        # The first pair (the quantized code, the nearest S) hits for most entries of a 16-bit model: search the
        # others only (finding them is a host sync, so other devices search every entry at once; same result).
        base = code * scale + minimum
        nearest = (target - base).to(store_dtype, memory_format=torch.contiguous_format)  # [*E]
        # flat positions of the misses [M]: one flat index per tensor is far cheaper than a tuple of per-dim indices
        miss = ((base + nearest.float()).to(model_dtype).float() != target).reshape(-1).nonzero().squeeze(1)
        if 2 * miss.numel() <= target.numel():  # (a 32-bit model misses nearly everywhere: search all at once)
            code = code.clone(memory_format=torch.contiguous_format)  # (written through a flat view below)
            code.view(-1)[miss], nearest.view(-1)[miss] = _search_pairs(
                *(t.reshape(-1)[miss] for t in (target, code, scale, minimum)), bits, model_dtype, store_dtype)
            return code, nearest
    return _search_pairs(target, code, scale, minimum, bits, model_dtype, store_dtype)


def _search_pairs(target: torch.Tensor, code: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                  model_dtype: torch.dtype, store_dtype: torch.dtype):
    """exact_outliers on every entry [*E]: all pairs evaluated at once, the first that hits kept."""
    steps = torch.tensor(_CODE_STEPS, dtype=torch.int32, device=code.device).view(-1, *([1] * code.ndim))
    codes = (code.int() + steps).clamp_(0, quant.levels(bits)).to(torch.uint8)  # [c, *E]
    base = codes * scale + minimum  # [c, *E] float32
    nearest = (target - base).to(store_dtype)
    up, down = torch.full_like(nearest, float("inf")), torch.full_like(nearest, float("-inf"))
    by_ulp = {0: nearest}
    for ulps in range(1, max(_ULP_STEPS) + 1):
        by_ulp[ulps] = torch.nextafter(by_ulp[ulps - 1], up)
        by_ulp[-ulps] = torch.nextafter(by_ulp[-(ulps - 1)], down)
    candidates = torch.stack([by_ulp[u] for u in _ULP_STEPS], dim=1)  # [c, u, *E]
    hit = (base.unsqueeze(1) + candidates.float()).to(model_dtype).float() == target  # [c, u, *E]
    hit = hit.flatten(0, 1)  # [c*u, *E], in the order tried
    pairs = hit.shape[0]
    tried = torch.arange(pairs, dtype=torch.uint8, device=code.device).view(-1, *([1] * code.ndim))
    first = torch.where(hit, tried, pairs).amin(dim=0, keepdim=True)  # [1, *E]: the first pair that hits, or `pairs`
    found = first[0] < pairs
    first = first.clamp_(max=pairs - 1).long()
    chosen_code = codes.gather(0, first // len(_ULP_STEPS))[0]  # pair p = (code step p // u, ulp step p % u)
    chosen_s = candidates.flatten(0, 1).gather(0, first)[0]
    # no hit: the clamped code (code steps 0) and the nearest S
    return torch.where(found, chosen_code, codes[0]), torch.where(found, chosen_s, nearest[0])


def _entry_stats(stat: torch.Tensor, index: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """A group statistic [B,H,n/g,d] or [B,H,n,G] at the outlier entries `index` (select_outliers' layout), float32."""
    return outliers.gather_entries(stat, torch.div(index, group, rounding_mode="floor"), axis).float()


def _set_entry_codes(codes: torch.Tensor, index: torch.Tensor, slot_used: torch.Tensor, entry_code: torch.Tensor,
                     quantized_code: torch.Tensor, dim: int) -> None:
    """codes [B,H,n,d] take entry_code at the used outlier slots, in place. Unused slots (index 0) write what a used
    slot of their vector writes (its first slot: used slots come first), or entry 0's own code when none is used,
    so that no two writes to one entry differ."""
    code = torch.where(slot_used, entry_code, quantized_code)
    first_index, first_code = index.narrow(dim, 0, 1), code.narrow(dim, 0, 1)
    codes.scatter_(dim, torch.where(slot_used, index, first_index), torch.where(slot_used, code, first_code))


class SparseOutliers(Term):
    name = "outliers"
    builtin = True

    def active(self, spec) -> bool:
        return spec.outlier_ratio > 0

    def fields(self, spec, n, d, side):
        length = n if spec.axis == "channel" else d
        k = outliers.outliers_per_vector(length, spec.outlier_ratio)
        shape = (k, d) if spec.axis == "channel" else (n, k)
        return (Field("sparse_values", shape, side, "sparse_values"),
                Field("sparse_index", shape, outliers.index_dtype(length), "sparse_indices"))

    def select(self, st: EncodeState) -> None:
        st.index, st.slot_used, mask = outliers.select_outliers(st.work, st.spec.axis, st.spec.outlier_ratio,
                                                                st.valid)
        st.exclude = mask if st.index.numel() else None  # [B,H,n,d] bool, None: nothing kept out of the statistics

    def correct(self, st: EncodeState) -> None:
        spec, index = st.spec, st.index
        sparse_values = torch.zeros(index.shape, dtype=st.side, device=st.x.device)
        if index.numel():
            # exact in the model dtype where the entries are the model's own (rotated entries are float32 sums)
            model_dtype = torch.float32 if spec.rotate else st.x.dtype
            quantized_code = outliers.gather_entries(st.codes, index, spec.axis)
            entry_code, sparse_values = exact_outliers(
                outliers.gather_entries(st.work, index, spec.axis).float(), quantized_code,
                _entry_stats(st.scale, index, spec.axis, st.group), _entry_stats(st.minimum, index, spec.axis,
                                                                                 st.group),
                spec.bits, model_dtype, st.side)
            sparse_values = torch.where(st.slot_used, sparse_values, torch.zeros_like(sparse_values))
            _set_entry_codes(st.codes, index, st.slot_used, entry_code, quantized_code, spec.pack_dim)
            st.packed = None  # outlier entries got their own codes: pack again
        length = st.n if spec.axis == "channel" else st.d
        st.out["sparse_values"] = sparse_values
        st.out["sparse_index"] = index.to(outliers.index_dtype(length))

    def add(self, ds: DecodeState) -> None:
        chunk = ds.chunk
        if chunk.sparse_index.numel():
            index = chunk.sparse_index.long()
            if ds.spec.axis == "channel" and ds.chunks > 1:  # [B,H,C*k,d] token indices within each chunk
                per_chunk = index.shape[2] // ds.chunks
                offsets = torch.arange(ds.chunks, device=index.device).repeat_interleave(per_chunk) * ds.n
                index = index + offsets.view(1, 1, -1, 1)
            ds.x = outliers.scatter_add_entries(ds.x, index, chunk.sparse_values, ds.spec.axis)
