"""The query rows the fused CPU attention reads (`attend._attend_pairs`): scaled, and rotated first when the query is
handed before RoPE, bit for bit as the host would make them (`compress.rope.apply_rotary`, then float32 times the
scale), so that the host spends no torch ops on a decode step's query.

No fastmath here, and said so (`fastmath=False`): each product and sum is rounded as torch rounds it (a fused
multiply-add would round once), and numba compiles a helper that sets no fastmath of its own with its caller's (the
attention kernel's `contract` fused these products into FMAs).
"""

from __future__ import annotations

import numpy as np
import torch

from .bf16 import bf16_value, round_bf16
from .jit import kernel

# how apply_rotary rounds, by (query dtype, cos/sin dtype): float32 throughout; bf16 after every op (bf16 operands:
# torch computes each in float32 and rounds it); float32 ops, bf16 once at the end (float32 cos/sin, OLMo 2's)
ROUND_FLOAT32, ROUND_EACH_BF16, ROUND_LAST_BF16 = 0, 1, 2
_ROUNDING = {(torch.float32, torch.float32): ROUND_FLOAT32, (torch.bfloat16, torch.bfloat16): ROUND_EACH_BF16,
             (torch.bfloat16, torch.float32): ROUND_LAST_BF16}


def rotation_rounding(query_dtype: torch.dtype, table_dtype: torch.dtype) -> int | None:
    """How `_query_row` rounds a query of this dtype rotated by cos/sin of that one; None: not covered (fp16: the
    host rotates it)."""
    return _ROUNDING.get((query_dtype, table_dtype))


@kernel(fastmath=False)
def _rounded(v, bf16):
    return bf16_value(round_bf16(v)) if bf16 else v


@kernel(fastmath=False)
def _rotated_pair(x, c, y, s, sign, rounding):
    """x*c + sign*y*s rounded as apply_rotary rounds it (`ROUND_*`)."""
    each = rounding == ROUND_EACH_BF16
    a = _rounded(x * c, each)
    b = _rounded(y * s, each)
    return _rounded(a + b if sign > 0 else a - b, rounding != ROUND_FLOAT32)


@kernel(fastmath=False)
def _query_row(q, q_cos, q_sin, rounding, scale, b, head, token, row):
    """row [d] float32 = q[b, head, token] (float32 values of the model's query), rotated by q_cos/q_sin [B,QL,d]
    (HF's tables for the step's tokens, as float32) unless they are empty ([0,0,0]: q is rotated already), times
    scale (the softmax scale with the rotary attention_scaling folded in)."""
    d = row.shape[0]
    if q_cos.shape[0] == 0:
        for k in range(d):
            row[k] = q[b, head, token, k] * scale
        return
    half = d // 2
    for i in range(half):
        x1, x2 = q[b, head, token, i], q[b, head, token, i + half]
        row[i] = _rotated_pair(x1, q_cos[b, token, i], x2, q_sin[b, token, i], -1, rounding) * scale
        row[i + half] = _rotated_pair(x2, q_cos[b, token, i + half], x1, q_sin[b, token, i + half], 1,
                                      rounding) * scale


NO_QUERY_ROTATION = np.zeros((0, 0, 0), dtype=np.float32)
