"""`KernelState`: what the fused kernels need beyond one store's data, owned by the cache and counted by its report.

    rope_halves  cos/sin of the half angles at the step's row-local positions (CPU kernel), computed once per step
                 and positions table, shared by the layers that read the same one; dropped when the step ends
                 (`end_step`): a table proportional to T is not kept between steps
    per_step     anything else the layers of a step share (the CPU kernel's query rotation tables), dropped alike
    workspace    the split-KV partial results of the Triton kernel: one buffer shared by every layer, sized to the
                 largest step so far
    scratch      the Triton tensor-core kernel's outlier tiles: one zeroed buffer shared the same way
    tables       small constant tables (the Walsh–Hadamard matrix the Triton kernel un-rotates values with)

Per-store derived state (prepared runs, sorted outliers) lives with the store instead (`ChunkStore.derived`).
"""

from __future__ import annotations

import torch

from ..compress.rope import rope_angles


class KernelState:
    def __init__(self) -> None:
        # this step's {(id(inv_freq), id(positions)): (positions, cos, sin)} (no reference to the model's tensors)
        self._rope: dict = {}
        self._step_values: dict = {}  # this step's {key: (kept, value)} (`per_step`)
        self._shared_step = -1  # the step `_rope` and `_step_values` belong to
        self._workspaces: dict[tuple, torch.Tensor] = {}
        self._tables: dict[tuple, torch.Tensor] = {}
        self.step = -1  # the cache's step counter, set before each step's first attention
        # which fused kernel the attending backend ran last ("fused-tc": the tensor-core kernel, "fused": the
        # register kernel or the CPU one) and, when not the tensor-core one, why (`kernels.tensor_core_reason`)
        self.attend_path = "fused"
        self.attend_reason: str | None = None

    def rope_halves(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        """cos/sin [B, T, d/2] float32 numpy arrays at `positions` (as the rotary module computes them), once per
        step, rotary module (a model may have two, local and global) and positions tensor: the layers of a step
        share the layout's positions, except a sliding layer that released chunks, whose kernel positions skip them
        (`RowLayout.kernel_inputs`: same shape, other values). The entry keeps its positions tensor, so its id
        cannot be reused by another one within the step."""
        self._for_step()
        key = (id(inv_freq), id(positions))
        entry = self._rope.get(key)
        if entry is None or entry[0] is not positions:
            angles = rope_angles(positions, inv_freq)
            entry = self._rope[key] = (positions, angles.cos().numpy(), angles.sin().numpy())
        return entry[1:]

    def per_step(self, key: tuple, kept: tuple, build):
        """`build()`, once per step for `key`; kept: the objects whose ids the key holds (kept with the value, so
        that no other object takes one of those ids within the step)."""
        self._for_step()
        entry = self._step_values.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], kept)):
            entry = self._step_values[key] = (kept, build())
        return entry[1]

    def _for_step(self) -> None:
        """What the layers share belongs to the current step: an earlier step's is dropped."""
        if self._shared_step != self.step:
            self._rope, self._step_values, self._shared_step = {}, {}, self.step

    def end_step(self) -> None:
        """The step ended: drop what its layers shared."""
        self._rope, self._step_values, self._shared_step = {}, {}, -1

    def workspace(self, device: torch.device, numel: int) -> torch.Tensor:
        """A float32 buffer of at least `numel` elements on `device` (contents undefined), shared by the layers that
        launch on the same stream (one after the other); grown to the largest step, never shrunk."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream)
        ws = self._workspaces.get(key)
        if ws is None or ws.numel() < numel:
            ws = self._workspaces[key] = torch.empty(numel, dtype=torch.float32, device=device)
        return ws

    def scratch(self, device: torch.device, numel: int) -> torch.Tensor:
        """A zeroed float32 buffer of at least `numel` elements on `device`, shared like `workspace`: the Triton
        tensor-core kernel scatters outliers into it and zeroes what it wrote before it ends."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = ("scratch", str(device), stream)
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._workspaces[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        return buf

    def tables(self, key: tuple, build) -> torch.Tensor:
        """The table `build()` makes for `key`, built once."""
        if key not in self._tables:
            self._tables[key] = build()
        return self._tables[key]

    def nbytes(self) -> int:
        tensors = list(self._workspaces.values()) + list(self._tables.values())
        rope = sum(cos.nbytes + sin.nbytes for _, cos, sin in self._rope.values())
        shared = sum(_nbytes(value) for _, value in self._step_values.values())
        return sum(t.numel() * t.element_size() for t in tensors) + rope + shared


def _nbytes(value) -> int:
    """Bytes of the arrays and tensors in value (nested tuples)."""
    if isinstance(value, tuple):
        return sum(_nbytes(item) for item in value)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(getattr(value, "nbytes", 0))
