"""CPU kernel (numba) for the buffer held per token (`GearConfig.key_buffer` / `value_buffer` = "int8",
"int8-rotated" or "int4": `gear_hf.format.INT8_TOKENS` / `INT8_ROTATED_TOKENS` / `INT4_TOKENS`): the step's staged
tokens encoded straight into the store's fields.

What `gear_hf.compress.compress(x, spec)` stores for each token, bit for bit: one group over the whole head vector
(a centered buffer's vector coded by its row's centers first, as `ChannelCenters.normalized` codes it; the vector
rotated then for the rotated formats, by `compress.rotation.rotate`'s butterflies in its order), its [min, max] in
float32, the 16-bit minimum and scale as
`quant._stored_stats` rounds and widens them (`quantize._stats`), codes round((x - minimum) / scale) clamped to
[0, 2^bits - 1] (`quantize._code`), packed along channels as `quant.pack_codes` packs them (`pack._pack`: 8-bit codes
pack to themselves, two 4-bit codes per byte, the even channel in the low nibble). The torch oracle
(`CodedTokenStore.encode`) spends ~0.5 ms of small ops per layer, stream and step on a token; this is one call.
The fused attention reads the codes directly (`attend._buffer_rows`).

Covered (`encode_supported`): the per-token 8-bit formats (rotated or not) and the rotated 4-bit one, one group, no
other term, bf16 side information (bf16 and float32 models), CPU tensors; anything else is encoded by the oracle.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...compress import ChunkSpec, side_dtype
from ..views import tail_format
from .bf16 import bf16_value, round_bf16
from .bf16 import side_value as _value
from .dequant import _hadamard_rows
from .jit import kernel
from .pack import _pack
from .quantize import _code, _stats

_F32 = np.float32
_INF = _F32(np.inf)
def encode_supported(spec: ChunkSpec, exact: torch.Tensor) -> bool:
    """True when `encode_staged` covers this format and staged tensor exact [B,H,cap,d]."""
    return (tail_format(spec, exact.shape[-1]) and exact.device.type == "cpu"
            and exact.dtype in (torch.bfloat16, torch.float32) and side_dtype(exact.dtype) == torch.bfloat16)


@numba.njit
def _encode_token(vector, bits, spread, packed):
    """vector [d] float32 -> its codes packed into packed [1, P] (spread [1, d]: scratch); returns the (minimum,
    scale) bf16 bits."""
    top = (1 << bits) - 1
    lo, hi = _INF, -_INF
    for c in range(vector.shape[0]):
        lo = min(lo, vector[c])
        hi = max(hi, vector[c])
    m_bits, s_bits = _stats(lo, hi, top)
    m = _value(np.int16(m_bits))
    s = _value(np.int16(s_bits))
    safe = s if s > 0 else _F32(1.0)
    for c in range(vector.shape[0]):
        spread[0, c] = _code(vector[c], m, safe, top)
    _pack(spread, bits, False, packed)
    return m_bits, s_bits


@kernel()
def _encode(exact, written, affine, round_to_bf16, rotated, bits, codes, scale, minimum):
    """Every token (b, t) with written[b, t], of every head: exact [B,H,cap,d] (bf16 bits as int16, or float32),
    coded as (x - affine[b,h,1]) / affine[b,h,0] per channel first when affine [B,H,2,d] float32 is not empty (a
    centered buffer, as `ChannelCenters.normalized` codes it: float32, then rounded to bf16 when round_to_bf16), then
    rotated when rotated (`_hadamard_rows`: `compress.rotation.rotate`'s butterflies, bit for bit) -> codes [B,H,cap,P]
    uint8, scale/minimum [B,H,cap,1] bf16 bits, in place."""
    B, H, cap, d = exact.shape
    vector = np.empty((1, d), dtype=np.float32)
    tile = np.empty((d, 1), dtype=np.float32)
    spread = np.empty((1, d), dtype=np.uint8)
    centered = affine.shape[0] > 0
    for b in range(B):
        for t in range(cap):
            if not written[b, t]:
                continue
            for h in range(H):
                for c in range(d):
                    v = _value(exact[b, h, t, c])
                    if centered:
                        v = _F32(_F32(v - affine[b, h, 1, c]) / affine[b, h, 0, c])
                        if round_to_bf16:
                            v = bf16_value(round_bf16(v))
                    vector[0, c] = v
                if rotated:
                    _hadamard_rows(vector, 1, tile)
                minimum[b, h, t, 0], scale[b, h, t, 0] = _encode_token(vector[0], bits, spread, codes[b, h, t : t + 1])


def _bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the array the loop reads or writes in place (bf16 as its bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def encode_staged(exact: torch.Tensor, written: torch.Tensor, fields: dict[str, torch.Tensor],
                  spec: ChunkSpec, affine: torch.Tensor | None = None) -> None:
    """The tokens marked in written [B,cap] (bool) of exact [B,H,cap,d] (`encode_supported(spec, exact)`), encoded
    into the store's fields {"codes": uint8 [B,H,cap,d*bits/8], "scale"/"minimum": bf16 [B,H,cap,1]} in place, as
    `compress(exact[b, :, t], spec)` stores them; affine (float32 [B,H,2,d]: per channel a scale, then a center, as
    `ChannelCenters.kernel_affine` gives them): each token coded as `ChannelCenters.normalized` codes it first."""
    if not encode_supported(spec, exact):
        raise ValueError(f"encode_staged: {spec} with staged tokens {tuple(exact.shape)} {exact.dtype} on "
                         f"{exact.device} is not covered (allowed: format.INT8_TOKENS, INT8_ROTATED_TOKENS or "
                         "INT4_TOKENS, bf16/float32 CPU tokens; see encode_supported)")
    codes, scale, minimum = fields["codes"], fields["scale"], fields["minimum"]
    if not (codes.is_contiguous() and scale.is_contiguous() and minimum.is_contiguous()):
        raise ValueError("encode_staged writes contiguous store fields in place")
    B, H, _, d = exact.shape
    if affine is None:
        affine = _NO_AFFINE
    elif tuple(affine.shape) != (B, H, 2, d) or affine.dtype != torch.float32:
        raise ValueError(f"encode_staged: affine must be float32 [B,H,2,d] = {[B, H, 2, d]}, got "
                         f"{affine.dtype} {list(affine.shape)}")
    else:
        affine = affine.contiguous().numpy()
    _encode(_bits(exact.contiguous()), written.contiguous().numpy(), affine, exact.dtype == torch.bfloat16,
            bool(spec.rotate), int(spec.bits), codes.numpy(), _bits(scale), _bits(minimum))


_NO_AFFINE = np.zeros((0, 0, 2, 0), dtype=np.float32)
