"""CPU compression kernel (numba): a chunk's outliers, quantized backbone and residual, one (row, head) plane at a time.

What `gear_hf.compress.gear.compress` computes before the low-rank fit, bit for bit: the outlier choice
(`outliers.select_outliers`), the group statistics and codes (`quant.quantize`), the outliers' exact codes and
values (`gear.exact_outliers`), the packed codes (`quant.pack_codes`, or `pack_planes` for widths per channel) and
the residual R = X - D̂ - S the low-rank term is fitted to (`lowrank.py` fits it). The torch path spends most of a
prefill's compression in a few hundred small whole-chunk ops (ranking keys, masks, gathers, casts); here each plane
is read a few times while it is in cache.

Exactness: the same float32 operations in the same order (no fused multiply-adds), 16-bit values rounded to
nearest even as torch converts them, ties ranked by position as `select_outliers` ranks them. Covered
(`compress_supported`): bf16 and float32 models (side information in bf16), widths 2/3/4/8 or one per channel
(keys), either axis, 16-bit statistics or 8-bit ones (values: `quant.stats8`'s uint8 codes, the downstream stages
reading them decoded as `quant.decode_stats8` decodes them), Hadamard rotation (the chunk rotated first, as the
oracle does), no padding mask, no range search; anything else takes the torch path. Non-finite input gives
unspecified outputs (the cache refuses it once per step), never a crash.

The stages, each in its module: the outlier choice (`outlier_select`), statistics, codes, exact outliers and the
residual (`quantize`), packing (`pack`); here the loop over planes (`_compress`) and the entry points.
"""

from __future__ import annotations

import numpy as np
import torch

from ...compress import ChunkSpec, outliers, quant
from ...compress.gear import Backbone, check_channel_bits, compute_backbone, side_dtype
from . import arrays
from .dequant import _hadamard_rows
from .jit import kernel
from .outlier_select import _MAX_LANE_SLOTS, _choose
from .pack import _pack, _pack_planes
from .quantize import _exact_entries, _quantize_channel, _quantize_token, _residual

_F32 = np.float32


# -- one chunk ------------------------------------------------------------------------------------------------
@kernel()
def _compress(x, bits, widths, channel_axis, group, k, model_bf16, packed, scale, minimum, sparse, index, residual):
    """x [B,H,n,d] float32 -> packed codes [B,H,P(n),d] / [B,H,n,P(d')], scale/minimum [B,H,n/g,d] / [B,H,n,G]
    (bf16 bits, or uint8 codes of 8-bit statistics: values), sparse (bf16 bits) and index (int64) [B,H,k,d] /
    [B,H,n,k] (0 at unused slots), and, when residual has rows, residual [B,H,n,d] = X - D̂ - S in float32. widths
    [B,H,d] uint8: a width per channel (keys; codes packed as bit planes [B,H,n/8,S], `_pack_planes`), or [0,0,0]:
    `bits` for all. Returns whether every group's range fits (8-bit statistics' grid; else the outputs are
    unspecified)."""
    B, H, n, d = x.shape
    V, L = (d, n) if channel_axis else (n, d)
    top = (1 << bits) - 1
    tops = np.full(d, top, np.int64)
    codes = np.empty((n, d), np.uint8)
    excluded = np.zeros((n, d), np.bool_)
    lanes = 3 * k + 2 <= _MAX_LANE_SLOTS
    vectors = np.empty((d, n) if channel_axis != lanes else (0, 0), _F32)  # the plane transposed, when needed
    top_v, bottom_v = np.empty(k + 1, _F32), np.empty(k + 1, _F32)
    top_i, bottom_i = np.empty(k + 1, np.int64), np.empty(k + 1, np.int64)
    taken, blocks = np.zeros(L, np.bool_), np.empty((3, 2 * k + 2), _F32)
    W = V if lanes else 0  # ranking keys of every vector, for `_extremes_lanes`
    top_key, low_key = np.empty((k + 1, W), np.int64), np.empty((min(2 * k + 1, L), W), np.int64)
    top_in, low_in = np.empty(W, np.int64), np.empty(W, np.int64)
    slot_index, slot_used = np.zeros((V, max(k, 1)), np.int64), np.zeros((V, max(k, 1)), np.bool_)
    fits = True
    for b in range(B):
        for h in range(H):
            plane = x[b, h]
            if k:
                _choose(plane, channel_axis, k, vectors, top_v, top_i, bottom_v, bottom_i, taken, blocks, top_key,
                        low_key, top_in, low_in, slot_index, slot_used)
                for v in range(V):
                    for s in range(k):
                        if slot_used[v, s]:
                            if channel_axis:
                                excluded[slot_index[v, s], v] = True
                            else:
                                excluded[v, slot_index[v, s]] = True
            if widths.shape[0]:
                for c in range(d):
                    tops[c] = (1 << np.int64(widths[b, h, c])) - 1
            if channel_axis:
                _quantize_channel(plane, excluded, group, tops, scale[b, h], minimum[b, h], codes)
            else:
                fits &= _quantize_token(plane, excluded, group, top, scale[b, h], minimum[b, h], codes)
            if k:
                _exact_entries(plane, codes, channel_axis, group, k, top, model_bf16, scale[b, h], minimum[b, h],
                               slot_index, slot_used, sparse[b, h], index[b, h])
                excluded[:] = False
            if widths.shape[0]:
                _pack_planes(codes, widths[b, h], packed[b, h])
            else:
                _pack(codes, bits, channel_axis, packed[b, h])
            if residual.shape[2]:
                _residual(plane, codes, channel_axis, group, top, scale[b, h], minimum[b, h], k, slot_index,
                          slot_used, sparse[b, h], residual[b, h])
    return fits


# -- torch-facing entry points --------------------------------------------------------------------------------
def compress_supported(spec: ChunkSpec, x: torch.Tensor) -> bool:
    """True when `compress_backbone` and `lowrank.fit_factors` cover this spec and chunk x [B,H,n,d] (else
    `compute_backbone` and `gear.fit_factors` run)."""
    if spec.range_search or (not spec.allocated and spec.bits not in quant.BITS):
        return False  # (searched ranges: the torch oracle's)
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.ndim != 4:
        return False
    n, d = x.shape[2], x.shape[3]
    group = spec.group_for(n, d)
    if spec.axis == "channel":  # whole groups and whole packing units along tokens (else the torch path raises)
        return group > 0 and n % group == 0 and n % quant.codes_per_unit(spec.bits, spec.allocated) == 0
    return group > 0


def compress_backbone(x: torch.Tensor, spec: ChunkSpec, channel_bits: torch.Tensor | None = None) -> Backbone:
    """`gear_hf.compress.gear.compute_backbone(x, spec, channel_bits=channel_bits)`, bit for bit, for what
    `compress_supported` covers. channel_bits [B,H,d] uint8: the widths of an allocated spec (and only then).
    A chunk with a group too wide for 8-bit statistics' grid is the oracle's, which raises its ValueError."""
    check_channel_bits(spec, channel_bits)
    B, H, n, d = x.shape
    channel_axis = spec.axis == "channel"
    bits = 0 if spec.allocated else int(spec.bits)
    group = spec.group_for(n, d)
    k = outliers.outliers_per_vector(n if channel_axis else d, spec.outlier_ratio)
    side = side_dtype(x.dtype)  # bf16 for both covered dtypes
    if spec.allocated:  # bit planes: per 8 tokens, the widths' sum in bytes (the same for every row and head)
        widths = channel_bits.to(torch.uint8).contiguous()
        packed = torch.empty(B, H, n // quant.PLANE_TOKENS, int(widths[0, 0].sum()) if widths.numel() else 0,
                             dtype=torch.uint8)
        stats_shape, slots_shape = (B, H, n // group, d), (B, H, k, d)
    elif channel_axis:
        widths = _UNIFORM
        packed = torch.empty(B, H, quant.packed_length(n, bits), d, dtype=torch.uint8)
        stats_shape, slots_shape = (B, H, n // group, d), (B, H, k, d)
    else:
        widths = _UNIFORM
        unit = quant.pack_unit(bits)[0]
        packed = torch.empty(B, H, n, quant.packed_length(-(-d // unit) * unit, bits), dtype=torch.uint8)
        stats_shape, slots_shape = (B, H, n, -(-d // group)), (B, H, n, k)
    stats_dtype = torch.uint8 if spec.stats == "8" else side  # 8-bit statistics: uint8 codes (`quant.stats8`)
    scale, minimum = torch.empty(stats_shape, dtype=stats_dtype), torch.empty(stats_shape, dtype=stats_dtype)
    sparse, index = torch.empty(slots_shape, dtype=side), torch.empty(slots_shape, dtype=torch.long)
    residual = torch.empty(B, H, n, d) if spec.rank else torch.empty(B, H, 0, 0)
    # a rotating spec compresses the rotated chunk (rotated as the oracle rotates it), whose entries are float32 sums
    work = _rotated(x) if spec.rotate else x.float()
    fits = _compress(work.contiguous().numpy(), bits, widths if isinstance(widths, np.ndarray) else widths.numpy(),
                     channel_axis, group, k, x.dtype == torch.bfloat16 and not spec.rotate, packed.numpy(),
                     *(_bits(t) for t in (scale, minimum, sparse)), index.numpy(), residual.numpy())
    if not fits:  # (the oracle raises: a range beyond 8-bit statistics' grid)
        return compute_backbone(x, spec, channel_bits=channel_bits)
    stored_bits = channel_bits.unsqueeze(2) if spec.allocated else torch.zeros(B, H, 0, d, dtype=torch.uint8)
    return Backbone(codes=packed, channel_bits=stored_bits, scale=scale, minimum=minimum, sparse_values=sparse,
                    sparse_index=index, residual=residual if spec.rank else None)


_UNIFORM = np.zeros((0, 0, 0), dtype=np.uint8)  # no widths per channel


def _rotated(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated as `compress.rotation.rotate` rotates it, bit for bit (`dequant._hadamard_rows`: the same
    butterflies in the same order, then the same scale), in a new float32 tensor: one pass over rows in cache where
    the oracle's torch ops make a whole-chunk tensor per butterfly stage."""
    d = x.shape[-1]
    work = torch.empty(x.shape, dtype=torch.float32)
    work.copy_(x)
    rows = work.view(-1, d).numpy()
    _hadamard_rows(rows, rows.shape[0], np.empty((d, 64), dtype=np.float32))
    return work


def _bits(t: torch.Tensor) -> np.ndarray:
    """A side field as the loops write it: bf16 as its bits (int16), uint8 codes as they are."""
    return t.numpy() if t.dtype == torch.uint8 else t.view(torch.int16).numpy()


# the exponent bits of a float dtype (all set: inf or NaN), and the integer dtype its bits are read as
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}


@kernel()
def _count_nonfinite(bits, at, N, exponent):
    """Entries of rows [at, at+N) of bits [B,H,T,d] (a float tensor's bits as integers) with every exponent bit set."""
    count = 0
    for b in range(bits.shape[0]):
        for h in range(bits.shape[1]):
            for t in range(at, at + N):
                for c in range(bits.shape[3]):
                    count += (bits[b, h, t, c] & exponent) == exponent
    return count


def all_finite(x: torch.Tensor) -> torch.Tensor | None:
    """torch.isfinite(x).all() for CPU float tensors x [B,H,N,d] in one integer pass over their bits (a 0-dim bool
    tensor), or None for what it does not cover (other dtypes or shapes)."""
    if x.dtype not in _EXPONENT or x.ndim != 4 or x.device.type != "cpu" or x.stride(-1) != 1:
        return None
    int_dtype, exponent = _EXPONENT[x.dtype]
    bits, at = arrays.readable(x.view(int_dtype))
    return torch.tensor(_count_nonfinite(bits, at, x.shape[2], exponent) == 0)
