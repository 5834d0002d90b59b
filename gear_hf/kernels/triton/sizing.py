"""The fused decode kernel's launch sizing: SM counts and resident programs per SM (`_SM_COUNT`, `_RESIDENT`: properties
of the device and of a compiled kernel configuration, keyed by value, never by tensor identity), the split count, and
the Hadamard table builder. State derived from a cache's data (sorted key outliers, workspaces, tables) is the
caller's: the store's `derived` and the cache's `KernelState` (gear_hf.backends.triton_backend)."""

from __future__ import annotations

import torch
import triton.language as tl

_SM_COUNT: dict[int, int] = {}
# Programs of the main kernel resident per SM, learned from its register count after the first launch of a
# configuration (key: device, warps, block, dtype, key/value bits); 1 until then.
_RESIDENT: dict[tuple, int] = {}

# tokens per step through a run: the decode kernels' tile with no register spills at head_dim 128 (default launch)
BLOCK_TOKENS = 32


def block_tokens(length: int, widest: int = BLOCK_TOKENS) -> int:
    """Tokens per step through runs whose pieces hold `length` tokens (a decode chunk, a page): `widest`, or the
    largest power of two dividing length below that."""
    return min(widest, length & -length)


def _num_splits(max_blocks: int, programs: int, device: torch.device, resident: int) -> int:
    """Splits of each program's token range so the grid fills whole waves of the GPU (`resident` programs per
    SM), at least about two blocks per split."""
    if max_blocks <= 1:
        return 1
    if device.type != "cuda":
        return min(2, max_blocks)
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    slots = resident * _SM_COUNT[device.index]
    best, best_cost = 1, None
    for ns in range(1, min(64, max(1, max_blocks // 2)) + 1):
        waves = -(-programs * ns // slots)
        cost = waves / ns + 0.01 * ns  # time ~ waves x per-split work, plus merging more splits
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = ns, cost
    return best


def _resident_programs(compiled, num_warps: int) -> int:
    """Programs per SM that the register file allows (65536 registers, allocated per warp in units of 8 per
    thread), at most 8."""
    regs = getattr(compiled, "n_regs", 0) or 0
    if regs <= 0:
        return 1
    per_program = -(-regs // 8) * 8 * 32 * num_warps
    return max(1, min(8, 65536 // per_program))


def hadamard_table(n: int, dot_dtype, device: torch.device) -> torch.Tensor:
    """The Sylvester matrix of n (±1, exact) in the kernel's dot dtype (callers keep it: the cache's KernelState)."""
    from ...compress.rotation import hadamard

    dtype = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}.get(dot_dtype, torch.float32)
    return (hadamard(n) * n ** 0.5).round().to(device=device, dtype=dtype).contiguous()
