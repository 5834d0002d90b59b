"""CPU read kernels (numba): a chunk run decompressed, and keys rotated, in one pass each.

The reference path reconstructs the whole compressed history every decode step. In eager torch that is a
dozen whole-history passes per layer (unpack, cast, scale, shift, outliers, low-rank, RoPE), each at memory
speed, and on a 2-core machine they cost more than the model's attention itself. These loops read the packed
codes once and write each float once.

They compute what `gear_hf.compress.decompress` and `gear_hf.rope.apply_rotary` compute (those stay the oracle):
the dequantization and RoPE bit for bit (same float32 operations in the same order, no contraction into
fused multiply-adds), the outlier and low-rank terms to float32 rounding (a matmul's summation order is BLAS's).
What they cover (`decompress_supported`): uniform widths 2/3/4/8, either axis, outliers, low-rank, no
Hadamard rotation, no per-channel widths, float32 output; anything else takes the torch path.

numba is imported on first use only (`import gear_hf` stays light); compiled loops are cached on disk.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ..compress import ChunkSpec, CompressedChunk
from ..compress.gear import add_lowrank

_F32 = np.float32


# Arrays come in whole (C-contiguous, so LLVM knows the unit stride and vectorizes) with the first row along
# dim 2 that a call covers: `out, at` is rows [at, at + N) of out (a slice of the attention's workspace).


@numba.njit(cache=True, nogil=True)
def _channel_axis(codes, bits, group, scale, minimum, N, out, at, cos, sin, cos_at):
    """Keys-style codes packed along tokens: codes [B,H,>=P(N),d] -> out[:, :, at:at+N] = code*scale + minimum,
    with scale/minimum [B,H,N/group,d] float32 (groups run along tokens). cos/sin [B|1,1,>=cos_at+N,d] (or an
    empty dim 2 for none): each row then rotated as `_rotate` does, while it is in cache (the keys' RoPE without a
    pass of its own)."""
    B, H, _, d = out.shape
    half = d // 2
    for b in range(B):
        cb = b if cos.shape[0] > 1 else 0
        for h in range(H):
            for t in range(N):
                g = t // group
                if bits == 3:  # units of 8 tokens in 3 bytes: two 2-bit planes (tokens 0-3, 4-7), one high-bit plane
                    unit, j = t // 8, t % 8
                    low_row, low_shift, high_row = unit * 3 + j // 4, 2 * (j % 4), unit * 3 + 2
                    for c in range(d):
                        code = ((codes[b, h, low_row, c] >> low_shift) & 3) | (((codes[b, h, high_row, c] >> j) & 1) << 2)
                        out[b, h, at + t, c] = _F32(code) * scale[b, h, g, c] + minimum[b, h, g, c]
                else:
                    per = 8 // bits
                    row, shift, mask = t // per, bits * (t % per), (1 << bits) - 1
                    for c in range(d):
                        code = (codes[b, h, row, c] >> shift) & mask
                        out[b, h, at + t, c] = _F32(code) * scale[b, h, g, c] + minimum[b, h, g, c]
                if cos.shape[2]:
                    for i in range(half):
                        x1, x2 = out[b, h, at + t, i], out[b, h, at + t, i + half]
                        ct = cos_at + t
                        out[b, h, at + t, i] = x1 * cos[cb, 0, ct, i] - x2 * sin[cb, 0, ct, i]
                        out[b, h, at + t, i + half] = x2 * cos[cb, 0, ct, i + half] + x1 * sin[cb, 0, ct, i + half]


@numba.njit(cache=True, nogil=True)
def _spread_codes(codes, bits, out):
    """Codes packed along channels [B,H,N,P] -> one code per byte, out uint8 [B,H,N,W] contiguous (W: P's codes
    rounded up to 8): each byte's (or 3-bit unit's) fields spread over the bytes of a wider integer (little-
    endian). Lane-independent integer ops over whole rows vectorize; a per-code shift and mask does not."""
    B, H, N, P = out.shape[0], out.shape[1], out.shape[2], codes.shape[3]
    if bits == 8:
        out[:, :, :, :P] = codes[:, :, :N]
    elif bits == 4:
        out16 = out.view(np.uint16)
        for b in range(B):
            for h in range(H):
                for t in range(N):
                    for p in range(P):
                        x = np.uint16(codes[b, h, t, p])
                        out16[b, h, t, p] = (x | (x << 4)) & 0x0F0F
    elif bits == 2:
        out32 = out.view(np.uint32)
        for b in range(B):
            for h in range(H):
                for t in range(N):
                    for p in range(P):
                        x = (np.uint32(codes[b, h, t, p]) * np.uint32(0x1001)) & np.uint32(0x000F000F)
                        out32[b, h, t, p] = (x * np.uint32(0x41)) & np.uint32(0x03030303)
    else:  # 3 bits: units of 8 codes in 3 bytes (2-bit planes of codes 0-3 and 4-7, then the high bits)
        out64 = out.view(np.uint64)
        for b in range(B):
            for h in range(H):
                for t in range(N):
                    for u in range(P // 3):
                        lo0 = (np.uint64(codes[b, h, t, 3 * u]) * np.uint64(0x1001)) & np.uint64(0x000F000F)
                        lo1 = (np.uint64(codes[b, h, t, 3 * u + 1]) * np.uint64(0x1001)) & np.uint64(0x000F000F)
                        lo0 = (lo0 * np.uint64(0x41)) & np.uint64(0x03030303)
                        lo1 = (lo1 * np.uint64(0x41)) & np.uint64(0x03030303)
                        hi = np.uint64(codes[b, h, t, 3 * u + 2])
                        hi = (hi | (hi << np.uint64(28))) & np.uint64(0x0000000F0000000F)
                        hi = (hi | (hi << np.uint64(14))) & np.uint64(0x0003000300030003)
                        hi = (hi | (hi << np.uint64(7))) & np.uint64(0x0101010101010101)
                        out64[b, h, t, u] = lo0 | (lo1 << np.uint64(32)) | (hi << np.uint64(2))


@numba.njit(cache=True, nogil=True)
def _token_axis(codes, bits, scale, minimum, N, out, at):
    """Values-style codes packed along channels: codes [B,H,>=N,P(d)] -> out[:, :, at:at+N] with out [B,H,T,G,g]
    (the d channels as G groups of g) = code*scale + minimum, scale/minimum [B,H,N,G] float32. (Inner loops start at 0: LLVM vectorizes them; an offset start did not.)"""
    B, H, _, G, g = out.shape
    spread = np.empty((B, H, N, G, (codes.shape[3] * 8 // bits + 7) // 8 * 8 // G), dtype=np.uint8)
    _spread_codes(codes, bits, spread.reshape(B, H, N, -1))
    for b in range(B):
        for h in range(H):
            for t in range(N):
                for k in range(G):
                    s, m = scale[b, h, t, k], minimum[b, h, t, k]
                    for c in range(g):
                        out[b, h, at + t, k, c] = _F32(spread[b, h, t, k, c]) * s + m


@numba.njit(cache=True, nogil=True)
def _add_outliers(values, index, channel_axis, n, N, out, at):
    """out[:, :, at:at+N] += S: values/index [B,H,C*k,d] (channel axis: token index within its chunk of n) or
    [B,H,N,k] (token axis: channel index). Unused slots hold value 0, adding nothing."""
    B, H, E, K = values.shape
    for b in range(B):
        for h in range(H):
            if channel_axis:
                per_chunk = E // (N // n)
                for e in range(E):
                    first = at + (e // per_chunk) * n
                    for c in range(K):
                        out[b, h, first + index[b, h, e, c], c] += values[b, h, e, c]
            else:
                for t in range(E):
                    for k in range(K):
                        out[b, h, at + t, index[b, h, t, k]] += values[b, h, t, k]


@numba.njit(cache=True, nogil=True)
def _rotate(x, x_at, cos, sin, cos_at, T, out, out_at):
    """out[:, :, out_at:+T] = x[:, :, x_at:+T]*cos + rotate_half(..)*sin per half (x1*c1 - x2*s1, x2*c2 + x1*s2), as
    `apply_rotary`; cos/sin [B|1,1,>=cos_at+T,d]. (Not in place: LLVM vectorizes distinct arrays.)"""
    B, H, _, d = x.shape
    half = d // 2
    for b in range(B):
        cb = b if cos.shape[0] > 1 else 0
        for h in range(H):
            for t in range(T):
                xt, ot, ct = x_at + t, out_at + t, cos_at + t
                for i in range(half):
                    x1, x2 = x[b, h, xt, i], x[b, h, xt, i + half]
                    out[b, h, ot, i] = x1 * cos[cb, 0, ct, i] - x2 * sin[cb, 0, ct, i]
                    out[b, h, ot, i + half] = x2 * cos[cb, 0, ct, i + half] + x1 * sin[cb, 0, ct, i + half]


# -- torch-facing entry points --------------------------------------------------------------------------------
def _rows(t: torch.Tensor):
    """(a C-contiguous numpy array over the tensor t lies in, t's first row along dim 2) when t [B,H,N,...] is rows
    [at, at+N) of a C-contiguous [B,H,T,...] tensor (a slice of a workspace or a store field), else None. numba compiles C-contiguous arrays with unit strides, which is what lets loops vectorize.
    (Plain stride arithmetic: this runs a few times per layer and step.)"""
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


def _target(out: torch.Tensor):
    """(tensor to write, its `_rows`): out itself, or a temporary to copy into out after when numba cannot view it."""
    rows = _rows(out)
    if rows is None:
        out = torch.empty(out.shape)
        rows = _rows(out)
    return (out, *rows)


def _readable(t: torch.Tensor):
    """(array, first row) to read t through: `_rows` (a slice viewed whole, no copy), else a contiguous copy."""
    return _rows(t) or (t.contiguous().numpy(), 0)


def decompress_supported(spec: ChunkSpec, head_dim: int, out: torch.Tensor | None) -> bool:
    """True when `decompress_into` covers this spec and output (else the torch `decompress` runs)."""
    if spec.allocated or spec.rotate or spec.bits not in (2, 3, 4, 8):
        return False
    if out is None or out.dtype != torch.float32 or out.device.type != "cpu":
        return False
    if spec.axis == "token":  # groups split the channels, and each token's codes fill whole bytes of 8
        group = spec.group or head_dim
        return head_dim % group == 0 and head_dim % 8 == 0
    return True


def decompress_into(chunk: CompressedChunk, spec: ChunkSpec, n: int, d: int, chunks: int,
                    out: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`gear_hf.compress.decompress` of `chunks` consecutive chunks of n tokens into out [B,H,chunks*n,d] float32,
    bit for bit (`decompress_supported` says when it applies): codes and outliers here, the low-rank term by the
    same torch matmul (a numba loop summing the rank terms was no faster). The 16-bit stats and outliers are cast
    to float32 first (1/group of the codes' size). rotary: (cos, sin) [B|1,1,chunks*n,d] to return the tokens
    rotated (`rotate_into`'s result), in the same pass when nothing is added after the codes."""
    bits, group, N = int(spec.bits), spec.group_for(n, d), chunks * n
    scale, minimum = chunk.scale.float().numpy(), chunk.minimum.float().numpy()
    codes, code_at = _readable(chunk.codes)
    codes = codes[:, :, code_at:]
    fused = rotary is not None and spec.axis == "channel" and not chunk.sparse_index.numel() \
        and not chunk.lowrank_a.shape[-1]
    target, whole, at = _target(out if rotary is None or fused else torch.empty(out.shape))
    if spec.axis == "channel":
        (cos, cos_at), (sin, sin_at) = (_readable(t) for t in rotary) if fused else ((_NO_ROTATION, 0),) * 2
        assert cos_at == sin_at, "cos and sin tables of one layout"
        _channel_axis(codes, bits, group, scale, minimum, N, whole, at, cos, sin, cos_at)
    else:
        _token_axis(codes, bits, scale, minimum, N, whole.reshape(*whole.shape[:3], d // group, group), at)
    if chunk.sparse_index.numel():
        _add_outliers(chunk.sparse_values.float().numpy(), chunk.sparse_index.contiguous().numpy(),
                      spec.axis == "channel", n, N, whole, at)
    add_lowrank(target, chunk, n, d, chunks)
    if rotary is not None and not fused:  # terms added after the codes: rotate the sum, into out
        return rotate_into(target, *rotary, out)
    return out if target is out else out.copy_(target)


_NO_ROTATION = np.zeros((1, 1, 0, 1), dtype=np.float32)


def rotate_supported(x: torch.Tensor, cos: torch.Tensor, out: torch.Tensor) -> bool:
    """True when `rotate_into` covers these tensors (float32 on CPU, every channel rotated, cos [B|1,1,T,d])."""
    return (x.dtype == cos.dtype == out.dtype == torch.float32 and x.device.type == "cpu" and x.ndim == 4
            and cos.shape[-1] == x.shape[-1] and cos.ndim == 4 and cos.shape[1] == 1)


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`gear_hf.rope.apply_rotary(x, cos, sin, out=out)`, bit for bit, in one pass (`rotate_supported`)."""
    source = _readable(x)
    target, whole, at = _target(out)
    (cos, cos_at), (sin, sin_at) = _readable(cos), _readable(sin)
    assert cos_at == sin_at, "cos and sin tables of one layout"
    _rotate(*source, cos, sin, cos_at, x.shape[2], whole, at)
    return out if target is out else out.copy_(target)
