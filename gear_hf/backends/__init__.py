"""Backends and their registry: which code compresses, reconstructs and attends for a cache's format.

    torch   the oracle (`gear_hf.compress`), any device
    numba   the CPU kernels (`gear_hf.kernels.cpu`): compression, reads, fused decode attention
    triton  the CUDA kernels (`gear_hf.kernels.decode`, `.quant`): fused decode attention, quantize + pack

`resolve(config, head_dim, dtype, device)` gives a cache its `BackendPlan`, once. GearConfig.backend "auto" (the
default; the environment variable GEAR_HF_BACKEND overrides it) takes, per operation, the first backend in
`PRIORITY` that runs on the device and supports the format, and records why the others were passed over; an
accelerator that is installed but fails to import is reported with its error (a warning, once), never mistaken for
an absent one. A forced backend ("torch" / "numba" / "triton") serves every operation it implements, or raising
says why it cannot: at `gear_hf.enable`, or when a `GearCache` first sees its tensors.

Adding a backend: a module with a `Backend` subclass (`base.py`: `ops`, `unavailable`, `supports` and the
operations) and one line in `_REGISTRY` below.
"""

from __future__ import annotations

import os
import warnings

import torch

from ..config.core import BACKENDS
from .base import OPS, Backend, BackendPlan, import_problem
from .numba_backend import NumbaBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

__all__ = ["OPS", "Backend", "BackendPlan", "BACKEND_NAMES", "PRIORITY", "get_backend", "import_problem",
           "plan_of", "requested_backend", "resolve"]

_REGISTRY: dict[str, Backend] = {b.name: b for b in (TritonBackend(), NumbaBackend(), TorchBackend())}
BACKEND_NAMES = BACKENDS  # (as users read them: GearConfig.backend)
assert set(BACKENDS) == {"auto", *_REGISTRY}, (BACKENDS, list(_REGISTRY))
PRIORITY = tuple(_REGISTRY)  # auto: the first that serves an operation (torch, last, serves every format)
_WARNED: set[str] = set()


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"GEAR backend {name!r} is not registered; registered: {' | '.join(_REGISTRY)}")
    return _REGISTRY[name]


def plan_of(name: str) -> BackendPlan:
    """The plan of one named backend: it runs every operation it implements, torch the others (tests, scripts that
    build stores by hand; a cache resolves its plan with `resolve`)."""
    backend, torch_backend = get_backend(name), _REGISTRY["torch"]
    pick = {op: backend if op in backend.ops else torch_backend for op in ("compress", "reconstruct")}
    return BackendPlan(pick["compress"], pick["reconstruct"], backend if "attend" in backend.ops else None,
                       forced=name)


def requested_backend(config) -> tuple[str, str]:
    """(the backend asked for, where it was asked): GearConfig.backend, or GEAR_HF_BACKEND when that is 'auto'."""
    choice = getattr(config, "backend", "auto")
    if choice != "auto":
        return choice, f"GearConfig.backend={choice!r}"
    env = os.environ.get("GEAR_HF_BACKEND", "auto").strip().lower() or "auto"
    if env not in BACKEND_NAMES:
        raise ValueError(f"GEAR_HF_BACKEND={env!r} is invalid; allowed: {' | '.join(BACKEND_NAMES)}")
    return env, f"GEAR_HF_BACKEND={env} (GearConfig.backend='auto')"


def resolve(config, head_dim: int, dtype: torch.dtype, device) -> BackendPlan:
    """The backend of each operation for caches of this GearConfig, head_dim and model dtype on `device`."""
    device = torch.device(device)
    choice, source = requested_backend(config)
    torch_backend = _REGISTRY["torch"]
    if not config.compresses:  # nothing is ever compressed or read back: every choice is the stock attention
        return BackendPlan(torch_backend, torch_backend, None, forced=None if choice == "auto" else choice)
    if choice != "auto":
        return _forced(get_backend(choice), source, config, head_dim, dtype, device)
    chosen: dict[str, Backend | None] = {}
    skipped: dict[str, list] = {op: [] for op in OPS}
    for op in OPS:
        chosen[op] = None
        for backend in _REGISTRY.values():
            if op not in backend.ops:
                continue
            reason = backend.unavailable(device) or backend.supports(op, config, head_dim, dtype)
            if reason is None:
                chosen[op] = backend
                break
            _warn_if_broken(backend, reason)
            skipped[op].append((backend.name, reason))
    return BackendPlan(chosen["compress"], chosen["reconstruct"], chosen["attend"],
                       skipped={op: tuple(v) for op, v in skipped.items()})


def _forced(backend: Backend, source: str, config, head_dim, dtype, device) -> BackendPlan:
    problem = backend.unavailable(device, forced=True)
    if problem is None:
        for op in backend.ops:
            reason = backend.supports(op, config, head_dim, dtype)
            if reason is not None:
                problem = f"its {op} does not serve this configuration: {reason}"
                break
    if problem is not None:
        hint = f" ({backend.install_hint})" if "not installed" in problem and backend.install_hint else ""
        raise ValueError(f"{source}: GEAR backend {backend.name!r} cannot run here: {problem}{hint}; use "
                         "backend='auto' (the best backend for each operation) or 'torch'")
    return plan_of(backend.name)


def _warn_if_broken(backend: Backend, reason: str) -> None:
    if "failed to import" in reason and backend.name not in _WARNED:
        _WARNED.add(backend.name)
        warnings.warn(f"gear_hf: the {backend.name} backend is installed but unusable, so GEAR runs without it: "
                      f"{reason}", RuntimeWarning, stacklevel=3)
