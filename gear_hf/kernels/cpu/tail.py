"""CPU kernel (numba) for the buffer held at 8 bits per token (`GearConfig.key_buffer` / `value_buffer` = "int8",
`gear_hf.format.INT8_TOKENS`): the step's staged tokens encoded straight into the store's fields, in one call.

What `gear_hf.compress.compress(x, INT8_TOKENS)` stores for each token, bit for bit: one group over the whole head
vector, its [min, max] in float32, the 16-bit minimum and scale as `quant._stored_stats` rounds and widens them
(`quantize._stats`), codes round((x - minimum) / scale) clamped to [0, 255] (`quantize._code`); 8-bit codes pack to
themselves. The torch oracle (`CodedTokenStore.encode`) spends ~0.5 ms of small ops per layer, stream and step on a
token; this is one call. The fused attention reads the codes directly (`attend._buffer_rows`).

Covered (`encode_supported`): the per-token 8-bit format with one group, no other term, bf16 side information (bf16
and float32 models), CPU tensors; anything else is encoded by the oracle.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...compress import ChunkSpec, side_dtype
from .bf16 import side_value as _value
from .quantize import _code, _stats

_F32 = np.float32
_INF = _F32(np.inf)
_TOP = 255


def tail_format(spec: ChunkSpec, head_dim: int) -> bool:
    """True when spec stores each token as 8-bit codes of one group over the head vector with a scale and minimum,
    and nothing else (the format `encode_staged` writes and the fused CPU attention reads)."""
    return (spec.bits == 8 and spec.axis == "token" and spec.group_for(1, head_dim) >= head_dim
            and not (spec.outlier_ratio or spec.rank or spec.rotate or spec.range_search or spec.allocated
                     or spec.extra_terms))


def encode_supported(spec: ChunkSpec, exact: torch.Tensor) -> bool:
    """True when `encode_staged` covers this format and staged tensor exact [B,H,cap,d]."""
    return (tail_format(spec, exact.shape[-1]) and exact.device.type == "cpu"
            and exact.dtype in (torch.bfloat16, torch.float32) and side_dtype(exact.dtype) == torch.bfloat16)


@numba.njit(cache=True, nogil=True)
def _encode(exact, written, codes, scale, minimum):
    """Every token (b, t) with written[b, t], of every head: exact [B,H,cap,d] (bf16 bits as int16, or float32) ->
    codes [B,H,cap,d] uint8, scale/minimum [B,H,cap,1] bf16 bits, in place."""
    B, H, cap, d = exact.shape
    for b in range(B):
        for t in range(cap):
            if not written[b, t]:
                continue
            for h in range(H):
                lo, hi = _INF, -_INF
                for c in range(d):
                    v = _value(exact[b, h, t, c])
                    lo = min(lo, v)
                    hi = max(hi, v)
                m_bits, s_bits = _stats(lo, hi, _TOP)
                minimum[b, h, t, 0], scale[b, h, t, 0] = m_bits, s_bits
                m = _value(np.int16(m_bits))
                s = _value(np.int16(s_bits))
                safe = s if s > 0 else _F32(1.0)
                for c in range(d):
                    codes[b, h, t, c] = _code(_value(exact[b, h, t, c]), m, safe, _TOP)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the array the loop reads or writes in place (bf16 as its bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def encode_staged(exact: torch.Tensor, written: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
    """The tokens marked in written [B,cap] (bool) of exact [B,H,cap,d] (`encode_supported`), encoded into the store's
    fields {"codes": uint8 [B,H,cap,d], "scale"/"minimum": bf16 [B,H,cap,1]} in place, as
    `compress(exact[b, :, t], INT8_TOKENS)` stores them."""
    codes, scale, minimum = fields["codes"], fields["scale"], fields["minimum"]
    if not (codes.is_contiguous() and scale.is_contiguous() and minimum.is_contiguous()):
        raise ValueError("encode_staged writes contiguous store fields in place")
    _encode(_bits(exact.contiguous()), written.contiguous().numpy(), codes.numpy(), _bits(scale), _bits(minimum))
