"""GEAR on one chunk of keys or values: X ≈ D̂ + S + A Bᵀ.

    S  = the extreme entries of each vector (outliers.select_outliers), stored as X - D̂ at those entries,
         chosen so that D̂ + S rounds to X in the model dtype (reconstruction is additive)
    D̂  = quantize(X) with those entries excluded from the group statistics
    L  = A Bᵀ, low-rank fit of R = X - D̂ - S
    optionally all of it in a rotated basis X H (H: orthonormal Walsh–Hadamard along head_dim), undone at
    decompress

Side information (scales, minimums, outlier values, low-rank factors) is stored in 16 bits whatever the model
dtype (`side_dtype`): a 32-bit model would otherwise pay twice for it. Low-rank factors may be stored in 8 bits
(int8 with one 16-bit absmax scale per column).

This is the reference implementation (the oracle for the kernels); the cache stores its outputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import lowrank, outliers, quant
from .rotation import rotate

FACTOR_BITS = (8, 16)


def side_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """16-bit dtype of the side information: fp16 for fp16 models (their range), bf16 otherwise (fp32's range)."""
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


@dataclass(frozen=True)
class ChunkSpec:
    """How one stream (keys or values) of one chunk is compressed."""

    bits: float  # the code width; with allocated=True the mean over channels (a multiple of 1/8)
    axis: str  # "channel": groups run along tokens; "token": groups run along channels
    group: int  # group length; 0 = one group per whole vector (KCVT)
    outlier_ratio: float  # 0 = no sparse term
    rank: int  # 0 = no low-rank term
    power_iters: int = 3
    rotate: bool = False  # Walsh–Hadamard rotation along head_dim before compressing
    factor_bits: int = 16  # 16: factors in the side dtype; 8: int8 + a 16-bit scale per column
    range_search: bool = False  # each group's range searched for the least squared error (quant.quantize)
    allocated: bool = False  # widths per channel (compress's channel_bits, allocation.py), stored as bit planes

    def __post_init__(self) -> None:
        if self.allocated:
            if self.axis != "channel" or self.outlier_ratio or self.rotate:
                raise ValueError("ChunkSpec.allocated (bits per channel) needs axis='channel', no outliers and no "
                                 f"rotation; got axis={self.axis!r}, outlier_ratio={self.outlier_ratio}, "
                                 f"rotate={self.rotate}")
        else:
            quant.pack_unit(self.bits)  # raises on unsupported bits
        if self.factor_bits not in FACTOR_BITS:
            raise ValueError(f"ChunkSpec.factor_bits={self.factor_bits!r}; allowed: 8 or 16")

    def group_for(self, n: int, d: int) -> int:
        if self.group:
            return self.group
        return n if self.axis == "channel" else d

    @property
    def pack_dim(self) -> int:
        return -2 if self.axis == "channel" else -1


def stream_specs(cfg, stream: str) -> tuple[ChunkSpec, ChunkSpec]:
    """(prompt chunk spec, decode chunk spec) for stream "key" or "value" of a GearConfig `cfg`."""
    bits, axis = (cfg.key_bits, cfg.key_axis) if stream == "key" else (cfg.value_bits, cfg.value_axis)
    decode_group = cfg.key_group if stream == "key" else cfg.value_group
    groups = (0, 0) if cfg.coarse_groups else (cfg.prompt_group(stream), decode_group)
    ratio = cfg.outlier_ratio if cfg.uses_outliers else 0.0
    ranks = (cfg.rank_prefill, cfg.rank_decode) if cfg.uses_lowrank else (0, 0)
    rotate = cfg.rotation in ("both", stream + "s")
    range_search = cfg.range_search in ("both", stream + "s")
    allocated = stream == "key" and cfg.key_bit_allocation == "query"
    return tuple(ChunkSpec(bits, axis, group, ratio, rank, cfg.power_iters, rotate, cfg.factor_bits,
                           range_search, allocated)
                 for group, rank in zip(groups, ranks))


@dataclass
class CompressedChunk:
    """One compressed chunk, shapes for x [B,H,n,d] (P(m): bytes of m packed codes, quant.packed_length):

    codes           uint8 packed: [B,H,P(n),d] (axis="channel") or [B,H,n,P(d)] (axis="token");
                    widths per channel: [B,H,n/8,S] bit planes (quant.pack_planes, S = the widths' sum)
    channel_bits    uint8 [B,H,1,d]: each channel's width (allocated specs), else [B,H,0,d]
    scale/minimum   [B,H,n/g,d] or [B,H,n,ceil(d/g)], side dtype
    sparse_values   [B,H,k,d] or [B,H,n,k], side dtype; sparse_index same shape (uint8/int16/int32)
    lowrank_a       [B,H,n,r];  lowrank_b [B,H,d,r]: side dtype, or int8 with factor_bits=8
    lowrank_a_scale / lowrank_b_scale  [B,H,1,r] side dtype with factor_bits=8 (per-column absmax / 127),
                    else [B,H,0,r]
    """

    codes: torch.Tensor
    channel_bits: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    sparse_values: torch.Tensor
    sparse_index: torch.Tensor
    lowrank_a: torch.Tensor
    lowrank_b: torch.Tensor
    lowrank_a_scale: torch.Tensor
    lowrank_b_scale: torch.Tensor


def _padded_to_unit(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Value codes [B,H,n,d] padded along channels to whole packing units (only when d is not a multiple)."""
    unit = quant.pack_unit(bits)[0]
    pad = (-codes.shape[-1]) % unit
    return torch.nn.functional.pad(codes, (0, pad)) if pad else codes


def _entry_stats(stat: torch.Tensor, index: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """A group statistic [B,H,n/g,d] or [B,H,n,G] at the outlier entries `index` (select_outliers' layout), float32."""
    return outliers.gather_entries(stat, torch.div(index, group, rounding_mode="floor"), axis).float()


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


def _set_entry_codes(codes: torch.Tensor, index: torch.Tensor, slot_used: torch.Tensor, entry_code: torch.Tensor,
                     quantized_code: torch.Tensor, dim: int) -> None:
    """codes [B,H,n,d] take entry_code at the used outlier slots, in place. Unused slots (index 0) write what a used
    slot of their vector writes (its first slot: used slots come first), or entry 0's own code when none is used,
    so that no two writes to one entry differ."""
    code = torch.where(slot_used, entry_code, quantized_code)
    first_index, first_code = index.narrow(dim, 0, 1), code.narrow(dim, 0, 1)
    codes.scatter_(dim, torch.where(slot_used, index, first_index), torch.where(slot_used, code, first_code))


def _quantize_factor(f: torch.Tensor, store_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """f [B,H,m,r] float32 -> (int8 codes [B,H,m,r], scale [B,H,1,r] in store_dtype): per-column absmax."""
    scale = (f.abs().amax(dim=-2, keepdim=True) / 127).to(store_dtype)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale.float()))
    return torch.round(f / safe).clamp_(-127, 127).to(torch.int8), scale


def _factor(t: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """Stored factor [B,H,C*m,r] (int8 with per-chunk scales [B,H,C,r], or 16-bit) -> float32 [B*H,C,m,r]."""
    B, H, _, r = t.shape
    f = t.float().view(B * H, chunks, -1, r)
    if t.dtype == torch.int8:
        f = f * scale.float().view(B * H, chunks, 1, r)
    return f


def add_lowrank(x: torch.Tensor, chunk: CompressedChunk, n: int, d: int, chunks: int = 1) -> torch.Tensor:
    """x [B,H,C*n,d] float32 += each chunk's A Bᵀ, in place (nothing when the chunk has no low-rank term)."""
    if chunk.lowrank_a.shape[-1]:
        B, H = x.shape[0], x.shape[1]
        a = _factor(chunk.lowrank_a, chunk.lowrank_a_scale, chunks)  # [B*H,C,n,r]
        b = _factor(chunk.lowrank_b, chunk.lowrank_b_scale, chunks)  # [B*H,C,d,r]
        if chunks == 1:  # accumulate inside the matmul: no [n, d] temporary
            x.view(B * H, n, d).baddbmm_(a[:, 0], b[:, 0].transpose(-1, -2))
        else:  # each chunk's own A Bᵀ
            x.view(B * H, chunks, n, d).add_(a @ b.transpose(-1, -2))
    return x


@dataclass
class Backbone:
    """What a chunk stores before its low-rank term (D̂ and S), and the residual that term is fitted to."""

    codes: torch.Tensor  # packed as CompressedChunk.codes
    channel_bits: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    sparse_values: torch.Tensor  # side dtype, 0 at unused slots
    sparse_index: torch.Tensor  # int64, select_outliers' layout
    residual: torch.Tensor | None  # [B,H,n,d] float32: (rotated) X - D̂ - S, when the spec has a low-rank term


def compress(x: torch.Tensor, spec: ChunkSpec, valid: torch.Tensor | None = None,
             quantize_pack=None, channel_bits: torch.Tensor | None = None, backbone=None,
             factors=None) -> CompressedChunk:
    """Compress x [B,H,n,d]. valid [B,n] bool marks real tokens; padding takes no part in any statistic.
    channel_bits: uint8 [B,H,d], each channel's width (1..8), for an allocated spec (allocation.py) and only then.

    Accelerated steps (used only without valid; the caller checks that they cover the spec):
    quantize_pack: (x, bits, axis, group, exclude, stats_dtype) -> (packed codes, scale, minimum), equal to
    quant.quantize + pack_codes bit for bit (gear_hf.kernels.quantize_pack on CUDA; not for allocated widths).
    backbone: (x, spec, channel_bits) -> Backbone, equal to `compute_backbone` bit for bit (gear_hf.kernels.cpu on
    the CPU).
    factors: (residual, spec, store) -> what `fit_factors` returns, equal to float32 rounding.
    """
    B, H, n, d = x.shape
    store = side_dtype(x.dtype)
    if backbone is not None and valid is None:
        part = backbone(x, spec, channel_bits)
    else:
        part = compute_backbone(x, spec, valid, quantize_pack, channel_bits)
    if spec.rank:
        fit = factors if factors is not None and valid is None else functools.partial(fit_factors, valid=valid)
        lowrank_a, lowrank_b, a_scale, b_scale = fit(part.residual, spec, store)
    else:
        lowrank_a, lowrank_b = x.new_zeros(B, H, n, 0, dtype=store), x.new_zeros(B, H, d, 0, dtype=store)
        a_scale = b_scale = x.new_zeros(B, H, 0, 0, dtype=store)
    return CompressedChunk(
        codes=part.codes,
        channel_bits=part.channel_bits,
        scale=part.scale,
        minimum=part.minimum,
        sparse_values=part.sparse_values,
        sparse_index=part.sparse_index.to(outliers.index_dtype(n if spec.axis == "channel" else d)),
        lowrank_a=lowrank_a,
        lowrank_b=lowrank_b,
        lowrank_a_scale=a_scale,
        lowrank_b_scale=b_scale,
    )


def fit_factors(residual: torch.Tensor, spec: ChunkSpec, store: torch.dtype, valid: torch.Tensor | None = None):
    """The stored low-rank factors of a residual R [B,H,n,d] float32 (`CompressedChunk`'s lowrank_* fields):
    (A [B,H,n,r], B [B,H,d,r], A's scales, B's scales). 16-bit factors: in the side dtype `store`, no scales
    ([B,H,0,rank]); 8-bit: int8 with a per-column scale [B,H,1,r], B refitted to the quantized A (least squares)
    before it is quantized itself."""
    B, H = residual.shape[:2]
    lowrank_a, lowrank_b = lowrank.lowrank_fit(residual, spec.rank, spec.power_iters, valid, out_dtype=torch.float32)
    if spec.factor_bits == 16:
        empty_scale = residual.new_zeros(B, H, 0, spec.rank, dtype=store)
        return (*(lowrank.to_finite(f, store) for f in (lowrank_a, lowrank_b)), empty_scale, empty_scale)
    lowrank_a, a_scale = _quantize_factor(lowrank_a, store)
    # refit B to the quantized A (least squares: B = Rᵀ A (AᵀA)⁻¹), then quantize it
    a = lowrank_a.float() * a_scale.float()
    # non-finite input is refused by the cache once per step (no sync here): keep pinv from raising first
    gram = torch.nan_to_num(a.transpose(-1, -2) @ a)  # [B,H,r,r]
    eye = torch.eye(gram.shape[-1], device=residual.device)
    refit = residual.transpose(-1, -2) @ a @ torch.linalg.pinv(gram + 1e-12 * eye)  # [B,H,d,r]
    lowrank_b, b_scale = _quantize_factor(refit, store)
    return lowrank_a, lowrank_b, a_scale, b_scale


def check_channel_bits(spec: ChunkSpec, channel_bits: torch.Tensor | None) -> None:
    """channel_bits come with a spec whose widths are allocated per channel, and only with one."""
    if spec.allocated != (channel_bits is not None):
        raise ValueError("channel_bits are given for a spec with bits allocated per channel (allocated=True), and "
                         f"only then: allocated={spec.allocated}, channel_bits given: {channel_bits is not None}")


def compute_backbone(x: torch.Tensor, spec: ChunkSpec, valid: torch.Tensor | None = None,
                     quantize_pack=None, channel_bits: torch.Tensor | None = None) -> Backbone:
    """D̂ and S of x [B,H,n,d] (outliers chosen, the rest quantized, outliers made exact), and, for a spec with a
    low-rank term, the residual (`compress` documents the arguments)."""
    B, H, n, d = x.shape
    store = side_dtype(x.dtype)
    group = spec.group_for(n, d)
    work = rotate(x) if spec.rotate else x  # [B,H,n,d] float32 when rotated, else the model's own values
    index, slot_used, mask = outliers.select_outliers(work, spec.axis, spec.outlier_ratio, valid)
    exclude = mask if index.numel() else None  # [B,H,n,d] bool, None: nothing to keep out of the statistics
    if valid is not None:
        padding = ~valid[:, None, :, None]
        exclude = padding.expand(x.shape) if exclude is None else exclude | padding
    check_channel_bits(spec, channel_bits)
    bits = spec.bits if channel_bits is None else channel_bits.unsqueeze(2)  # [B,H,1,d]
    packed = None
    if quantize_pack is None or spec.range_search or spec.allocated:  # the accelerated quantizer: min/max, one width
        codes, scale, minimum = quant.quantize(work, bits, spec.axis, group, exclude=exclude, stats_dtype=store,
                                               range_search=spec.range_search)
    else:
        packed, scale, minimum = quantize_pack(work, spec.bits, spec.axis, group, exclude, store)
        codes = quant.unpack_codes(packed, spec.bits, spec.pack_dim)[..., :d]
    sparse_values = torch.zeros(index.shape, dtype=store, device=x.device)
    if index.numel():
        # exact in the model dtype where the entries are the model's own (rotated entries are float32 sums)
        model_dtype = torch.float32 if spec.rotate else x.dtype
        quantized_code = outliers.gather_entries(codes, index, spec.axis)
        entry_code, sparse_values = exact_outliers(
            outliers.gather_entries(work, index, spec.axis).float(), quantized_code,
            _entry_stats(scale, index, spec.axis, group), _entry_stats(minimum, index, spec.axis, group),
            spec.bits, model_dtype, store)
        sparse_values = torch.where(slot_used, sparse_values, torch.zeros_like(sparse_values))
        _set_entry_codes(codes, index, slot_used, entry_code, quantized_code, spec.pack_dim)
    if spec.allocated:
        packed = quant.pack_planes(codes, bits)
    elif packed is None or index.numel():  # outlier entries got their own codes: pack again
        padded = _padded_to_unit(codes, spec.bits) if spec.axis == "token" else codes
        packed = quant.pack_codes(padded, spec.bits, spec.pack_dim)
    residual = None
    if spec.rank:
        approx = quant.dequantize(codes, scale, minimum, spec.axis, group, d, torch.float32)  # [B,H,n,d]
        outliers.scatter_add_entries(approx, index, sparse_values, spec.axis)  # D̂ + S, in place
        residual = torch.sub(work, approx, out=approx)  # [B,H,n,d] float32 (work promoted), in approx's memory
    return Backbone(codes=packed,
                    channel_bits=bits if channel_bits is not None else x.new_zeros(B, H, 0, d, dtype=torch.uint8),
                    scale=scale, minimum=minimum, sparse_values=sparse_values, sparse_index=index, residual=residual)


def decompress(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, out_dtype: torch.dtype,
               chunks: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct D̂ + S + A Bᵀ of `chunks` consecutive chunks of n tokens: [B,H,chunks*n,d], computed in float32
    (and rotated back when the spec rotates).

    `chunk` holds the chunks one after the other along dim 2 of every field (as `ChunkStore` keeps them), so
    one call covers a row's whole run of decode chunks: a quantization group never straddles two chunks, outlier
    token indices count from their chunk's start, and each chunk has its own low-rank factors.
    out: an optional [B,H,chunks*n,d] tensor (e.g. a slice of the attention's key buffer) written in place
    and returned; otherwise a new tensor in out_dtype.
    """
    if spec.allocated:
        codes = quant.unpack_planes(chunk.codes, chunk.channel_bits)
    else:
        codes = quant.unpack_codes(chunk.codes, spec.bits, spec.pack_dim)[..., :d]
    # float32 `out` is written directly, else accumulate in float32 and round once at the end
    direct = out is not None and out.dtype == torch.float32 and not spec.rotate
    x = quant.dequantize(codes, chunk.scale, chunk.minimum, spec.axis, spec.group_for(n, d), d, torch.float32,
                         out=out if direct else None)  # [B,H,C*n,d]
    if chunk.sparse_index.numel():
        index = chunk.sparse_index.long()
        if spec.axis == "channel" and chunks > 1:  # [B,H,C*k,d] token indices within each chunk
            per_chunk = index.shape[2] // chunks
            offsets = torch.arange(chunks, device=index.device).repeat_interleave(per_chunk) * n
            index = index + offsets.view(1, 1, -1, 1)
        x = outliers.scatter_add_entries(x, index, chunk.sparse_values, spec.axis)
    add_lowrank(x, chunk, n, d, chunks)
    if spec.rotate:
        x = rotate(x)  # H is its own inverse
    if out is None:
        return x.to(out_dtype)
    if not direct:
        out.copy_(x)
    return out
