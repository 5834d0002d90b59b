"""The `Backend` protocol and the `BackendPlan` a cache resolves once: who compresses, reconstructs and attends.

Operations (`OPS`):
    compress     a chunk of keys or values into its stored fields (and the finiteness check of what it compresses)
    reconstruct  a run of stored chunks back to [B,H,T,d] (and keys rotated at their positions)
    attend       the fused decode attention straight from storage (else the reference path: reconstruct, then
                 the model's own attention function)

A backend says for a configuration, head_dim, model dtype and device whether it serves an operation, and why not
(`supports`). Derived state a backend reads every step (prepared runs, sorted outliers) belongs to the store that
owns the data (`ChunkStore.derived`), built by `prepare` after a write, counted by the memory report.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field

import torch

OPS = ("compress", "reconstruct", "attend")


def import_problem(*modules: str) -> str | None:
    """None when every module imports; else why not: "not installed", or the error an installed one raised (a
    broken install is reported, never mistaken for an absent one)."""
    if importlib.util.find_spec(modules[0]) is None:
        return f"{modules[0]} is not installed"
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 (any failure of an installed package is reported as it is)
        return f"{modules[0]} is installed but failed to import ({type(error).__name__}: {error})"
    return None


class Backend:
    """One way of running GEAR's operations. Subclasses set `name`, `ops` (the operations they implement; the
    others are the torch backend's) and override what they implement."""

    name = ""
    ops: tuple[str, ...] = ()
    install_hint = ""  # how to get it when it is missing
    rotates_in_read = False  # reconstructs keys already rotated (no separate rotation pass)
    # attend takes a centered stream's exact tokens (the sink, this step's own) as they are and centers them itself
    # (`views.StreamView.exact_centered` False): no pass over them on the host at every step
    centers_exact_tokens = False

    def unavailable(self, device: torch.device, forced: bool = False) -> str | None:
        """None when the backend can run on `device` here (forced: the user asked for it by name); else why not."""
        return None

    def supports(self, op: str, config, head_dim: int, dtype: torch.dtype) -> str | None:
        """None when `op` serves caches of this GearConfig, head_dim and model dtype; else why not."""
        return None if op in self.ops else f"backend {self.name!r} does not implement {op!r}"

    # compress
    def compress(self, spec, x: torch.Tensor, channel_bits: torch.Tensor | None):
        raise NotImplementedError

    def all_finite(self, x: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(x).all()

    # reconstruct
    def reconstruct(self, store, chunks: int, out_dtype: torch.dtype, out=None, rotary=None, scratch=None):
        raise NotImplementedError

    def rotate(self, x, cos, sin, out, scratch=None):
        raise NotImplementedError

    # attend
    def step_reason(self, head_dim: int, query_len: int, rotary_dim: int | None, softcap) -> str | None:
        """Why the fused kernel cannot take this step (whatever the storage), or None."""
        return None

    def attend(self, query, keys, values, layout, *, scaling, inv_freq, attention_scaling, sliding_window, shared,
               query_rotary=None):
        """query_rotary: (cos, sin), the model's rotary tables of the step's tokens, where query is handed before RoPE
        (only to a backend that `rotates_queries` it)."""
        raise NotImplementedError

    def rotates_queries(self, query: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether `attend` takes this query before RoPE (with its cos/sin) and rotates it itself, bit for bit as
        `compress.rope.apply_rotary`: no torch ops on the host for it."""
        return False

    # the buffer held per token (`gear_hf.cache.coded_store.CodedTokenStore`)
    def encode_tokens(self, spec, exact: torch.Tensor, written: torch.Tensor, fields: dict,
                      affine: torch.Tensor | None = None) -> bool:
        """Encode the tokens marked in written [B,cap] (bool) of exact [B,H,cap,d] into a coded buffer's fields
        ([B,H,cap,...]) in place, bit for bit as `compress(token, spec)` (affine: float32 [B,H,2,d], a centered
        buffer's `ChannelCenters.kernel_affine`: each token as `ChannelCenters.normalized` codes it); False when this
        backend does not (the store's oracle encodes them)."""
        return False

    def decode_centers(self, fields: dict) -> torch.Tensor | None:
        """A centered buffer's stored centers (`ChannelCenters.fields`) as float32 (scales, centers) [B,H,2,d], bit
        for bit `ChannelCenters.kernel_affine`'s torch decode; None when this backend does not (torch decodes them)."""
        return None

    def reads_tail(self, spec, head_dim: int) -> bool:
        """Whether `attend` reads a buffer stored per token in `spec` from its fields (`views.CodedTailView`); else
        the fused kernel is handed the buffer decoded."""
        return False

    # derived state
    def view_derived(self, store, view, chunks: int, stream: str) -> dict:
        """What `attend` reads of the store's first `chunks` chunks beyond its fields (`ChunkRunView.derived`);
        stream: "key" or "value"."""
        return {}

    def prepare(self, store) -> None:
        """Bring the store's derived state for this backend up to date after a write (`store.derived`)."""


@dataclass(frozen=True)
class BackendPlan:
    """The backend of each operation for one cache (resolved once: `gear_hf.backends.resolve`). attend=None: the
    reference path (reconstruct, then the model's attention function). skipped: for each operation, the backends
    passed over and why."""

    compress: Backend
    reconstruct: Backend
    attend: Backend | None
    forced: str | None = None  # the backend the user forced, None under auto
    skipped: dict = field(default_factory=dict, compare=False)

    def names(self) -> dict[str, str]:
        """{"compress": "numba", "reconstruct": "numba", "attend": "numba" | "reference"}."""
        return {"compress": self.compress.name, "reconstruct": self.reconstruct.name,
                "attend": self.attend.name if self.attend is not None else "reference"}

    @functools.cached_property  # (read at every step by every store; the plan never changes)
    def accelerators(self) -> tuple[Backend, ...]:
        """The distinct backends in the plan (whose `prepare` runs after a write)."""
        seen: list[Backend] = []
        for backend in (self.compress, self.reconstruct, self.attend):
            if backend is not None and backend not in seen:
                seen.append(backend)
        return tuple(seen)
