"""Module-level memos of the fused decode kernel's host side, kept together here (issue 24 replaces them with state
owned by the store and the cache): key-outlier orderings derived per sparse_values tensor (`_DERIVED_MEMO`), SM
counts and resident programs per SM (`_SM_COUNT`, `_RESIDENT`), Hadamard tables (`_HADAMARD`) and float32
workspaces (`_WORKSPACES`)."""

from __future__ import annotations

import weakref

import torch
import triton.language as tl

from ..views import ChunkRunView, prepare_derived

# Key-outlier orderings derived by decode_attention itself (when the cache passes no run.derived), kept per
# sparse_values tensor (by identity; dropped with it) while it is unchanged: its in-place version counter and
# the chunks in use.
_DERIVED_MEMO: dict[int, tuple] = {}


def _derived_for(run: ChunkRunView, chunks_used: int) -> dict:
    tensor = run.sparse_values
    key = (tensor._version, run.sparse_index._version, chunks_used, tuple(tensor.shape))
    hit = _DERIVED_MEMO.get(id(tensor))
    if hit is not None and hit[0]() is tensor and hit[1] == key:
        return hit[2]
    derived = prepare_derived(run, chunks_used)
    ident = id(tensor)
    _DERIVED_MEMO[ident] = (weakref.ref(tensor, lambda _: _DERIVED_MEMO.pop(ident, None)), key, derived)
    return derived


_SM_COUNT: dict[int, int] = {}
# Programs of the main kernel resident per SM, learned from its register count after the first launch of a
# configuration (key: device, warps, block, dtype, key/value bits); 1 until then.
_RESIDENT: dict[tuple, int] = {}


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


_HADAMARD: dict[tuple, torch.Tensor] = {}


def _hadamard_table(n: int, dot_dtype, device: torch.device) -> torch.Tensor:
    """The Sylvester matrix of n (±1, exact) in the kernel's dot dtype, built once per size, dtype and device."""
    dtype = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}.get(dot_dtype, torch.float32)
    key = (n, dtype, str(device))
    if key not in _HADAMARD:
        from ...compress.rotation import hadamard

        _HADAMARD[key] = (hadamard(n) * n ** 0.5).round().to(device=device, dtype=dtype).contiguous()
    return _HADAMARD[key]


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """float32 scratch of at least `numel` elements, cached per device and stream (grown, never shrunk)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(max(numel, 2 * ws.numel() if ws is not None else 0), dtype=torch.float32, device=device)
        _WORKSPACES[key] = ws
    return ws
