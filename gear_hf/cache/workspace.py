"""`StepWorkspace`: scratch tensors of one step, reused by every layer of it."""

from __future__ import annotations

import torch


class StepWorkspace:
    """The reference path rebuilds the whole history of every layer each step (keys, values, rotated keys), in the
    same shapes layer after layer: building them in the same memory every layer skips an allocation per layer and
    keeps that memory warm in the CPU caches. A per-step temporary: `clear()` drops it when the step ends, so
    nothing is held between steps. What `get` returns is overwritten by the next layer's request."""

    def __init__(self) -> None:
        self._tensors: dict = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor for `role` ("keys", "values", "rotated keys", "rotary scratch"), the same one for
        the same request."""
        key = (role, tuple(shape), dtype, device)
        tensor = self._tensors.get(key)
        if tensor is None:
            self._tensors = {k: t for k, t in self._tensors.items() if k[0] != role}  # one tensor per role
            tensor = self._tensors[key] = torch.empty(shape, dtype=dtype, device=device)
        return tensor

    def clear(self) -> None:
        self._tensors.clear()
