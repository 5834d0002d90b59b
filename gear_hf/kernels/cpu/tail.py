"""CPU kernel (numba) for the buffer held per token (`GearConfig.key_buffer` / `value_buffer` = "int8",
"int8-rotated" or "int4": `gear_hf.format.INT8_TOKENS` / `INT8_ROTATED_TOKENS` / `INT4_TOKENS`): the step's staged
tokens encoded straight into the store's fields.

What `gear_hf.compress.compress(x, spec)` stores for each token, bit for bit: one group over the whole head vector
(the vector rotated first for the rotated formats: `compress.rotation.rotate`, the oracle's own call on the same
[N,H,1,d] gather, so the same float32 sums), its [min, max] in float32, the 16-bit minimum and scale as
`quant._stored_stats` rounds and widens them (`quantize._stats`), codes round((x - minimum) / scale) clamped to
[0, 2^bits - 1] (`quantize._code`), packed along channels as `quant.pack_codes` packs them (`pack._pack`: 8-bit codes
pack to themselves, two 4-bit codes per byte, the even channel in the low nibble). The torch oracle
(`CodedTokenStore.encode`) spends ~0.5 ms of small ops per layer, stream and step on a token; this is one call (plus,
rotated, the gather and the rotation). The fused attention reads the codes directly (`attend._buffer_rows`).

Covered (`encode_supported`): the per-token 8-bit formats (rotated or not) and the rotated 4-bit one, one group, no
other term, bf16 side information (bf16 and float32 models), CPU tensors; anything else is encoded by the oracle.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...compress import ChunkSpec, rotate, side_dtype
from ..views import tail_format
from .bf16 import side_value as _value
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
def _encode(exact, written, bits, codes, scale, minimum):
    """Every token (b, t) with written[b, t], of every head: exact [B,H,cap,d] (bf16 bits as int16, or float32) ->
    codes [B,H,cap,P] uint8, scale/minimum [B,H,cap,1] bf16 bits, in place (unrotated formats)."""
    B, H, cap, d = exact.shape
    vector = np.empty(d, dtype=np.float32)
    spread = np.empty((1, d), dtype=np.uint8)
    for b in range(B):
        for t in range(cap):
            if not written[b, t]:
                continue
            for h in range(H):
                for c in range(d):
                    vector[c] = _value(exact[b, h, t, c])
                minimum[b, h, t, 0], scale[b, h, t, 0] = _encode_token(vector, bits, spread, codes[b, h, t : t + 1])


@kernel()
def _encode_rows(work, rows, columns, bits, codes, scale, minimum):
    """Token j of work [N,H,1,d] (float32: the rotated tokens) into column columns[j] of row rows[j] of codes
    [B,H,cap,P] uint8, scale/minimum [B,H,cap,1] bf16 bits, in place."""
    N, H, _, d = work.shape
    spread = np.empty((1, d), dtype=np.uint8)
    for j in range(N):
        b, t = rows[j], columns[j]
        for h in range(H):
            minimum[b, h, t, 0], scale[b, h, t, 0] = _encode_token(work[j, h, 0], bits, spread,
                                                                   codes[b, h, t : t + 1])


def _bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the array the loop reads or writes in place (bf16 as its bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def encode_staged(exact: torch.Tensor, written: torch.Tensor, fields: dict[str, torch.Tensor],
                  spec: ChunkSpec) -> None:
    """The tokens marked in written [B,cap] (bool) of exact [B,H,cap,d] (`encode_supported(spec, exact)`), encoded
    into the store's fields {"codes": uint8 [B,H,cap,d*bits/8], "scale"/"minimum": bf16 [B,H,cap,1]} in place, as
    `compress(exact[b, :, t], spec)` stores them."""
    if not encode_supported(spec, exact):
        raise ValueError(f"encode_staged: {spec} with staged tokens {tuple(exact.shape)} {exact.dtype} on "
                         f"{exact.device} is not covered (allowed: format.INT8_TOKENS, INT8_ROTATED_TOKENS or "
                         "INT4_TOKENS, bf16/float32 CPU tokens; see encode_supported)")
    codes, scale, minimum = fields["codes"], fields["scale"], fields["minimum"]
    if not (codes.is_contiguous() and scale.is_contiguous() and minimum.is_contiguous()):
        raise ValueError("encode_staged writes contiguous store fields in place")
    bits = int(spec.bits)
    if not spec.rotate:
        _encode(_bits(exact.contiguous()), written.contiguous().numpy(), bits, codes.numpy(), _bits(scale),
                _bits(minimum))
        return
    rows, columns = written.nonzero(as_tuple=True)
    if rows.numel():  # rotated as the oracle rotates them: the same gather, the same call (the same float32 sums)
        work = rotate(exact[rows, :, columns].unsqueeze(2))  # [N,H,1,d] float32
        _encode_rows(work.contiguous().numpy(), rows.numpy(), columns.numpy(), bits, codes.numpy(), _bits(scale),
                     _bits(minimum))
