"""The pieces a term is made of: the fields it declares, the stage hooks it runs, and the state they share.

Encoding runs every term's hook of one stage before the next stage (`ENCODE_STAGES`), in registry order:

    transform  change the basis the rest is computed in (rotation)           EncodeState.work
    select     choose entries the statistics must not see (outliers)         EncodeState.exclude
    quantize   the backbone's codes and statistics                           EncodeState.codes/scale/minimum
    correct    make the chosen entries exact (outliers)                      EncodeState.codes (changed)
    pack       the backbone's codes into bytes                               EncodeState.out["codes"]
    fit        terms fitted to what the others left (low-rank)               EncodeState.residual()

Decoding runs `dequantize`, then `add` in registry order, then `untransform` in reverse registry order.
Every hook writes the fields it declared into `state.out` (encoding) or reads them from `state.chunk` (decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..spec import ChunkSpec, CompressedChunk

ENCODE_STAGES = ("transform", "select", "quantize", "correct", "pack", "fit")
DECODE_STAGES = ("dequantize", "add", "untransform")


@dataclass(frozen=True)
class Field:
    """One stored tensor of a chunk: [B, H, *shape] per chunk (shape[0] is its extent along dim 2, where chunks of
    a run follow each other), `dtype`, counted in the memory report under `component`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    component: str

    def nbytes(self, itemsize_cap: int | None = None) -> int:
        """Bytes of one (row, head); itemsize_cap: floating fields counted at most this many bytes per element."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        if itemsize_cap and self.dtype.is_floating_point:
            size = min(size, itemsize_cap)
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * size


class Term:
    """One term of a stored format. Subclasses set `name`, declare `fields`, and override the hooks they need.

    Built-in terms (`builtin = True`) always declare their fields, empty when inactive for a spec: the kernels read
    a fixed set. A registered extra term takes part only where a spec names it (`ChunkSpec.extra_terms`)."""

    name: str = ""
    builtin: bool = False

    def active(self, spec: ChunkSpec) -> bool:
        return self.name in spec.extra_terms

    def fields(self, spec: ChunkSpec, n: int, d: int, side: torch.dtype) -> tuple[Field, ...]:
        """What one chunk of n tokens, head_dim d stores for this term (side: the 16-bit side dtype)."""
        return ()

    def transforms(self, spec: ChunkSpec) -> bool:
        """True when this term changes the basis (its `untransform` must run after the backbone's dequantize)."""
        return False

    # encoding stages (EncodeState), in ENCODE_STAGES order
    def transform(self, st: "EncodeState") -> None: ...
    def select(self, st: "EncodeState") -> None: ...
    def quantize(self, st: "EncodeState") -> None: ...
    def correct(self, st: "EncodeState") -> None: ...
    def pack(self, st: "EncodeState") -> None: ...
    def fit(self, st: "EncodeState") -> None: ...

    # decoding stages (DecodeState)
    def dequantize(self, ds: "DecodeState") -> None: ...
    def add(self, ds: "DecodeState") -> None: ...
    def untransform(self, ds: "DecodeState") -> None: ...


@dataclass
class EncodeState:
    """What the encoding stages of one chunk x [B,H,n,d] share (see the module docstring)."""

    spec: ChunkSpec
    x: torch.Tensor  # [B,H,n,d] the model's keys or values
    valid: torch.Tensor | None  # [B,n] bool, False at padding
    side: torch.dtype  # the 16-bit side dtype
    channel_bits: torch.Tensor | None = None  # uint8 [B,H,d]: allocated key widths
    quantize_pack: Callable | None = None  # an accelerated quantize + pack (compress's argument), or None
    factors: Callable | None = None  # an accelerated low-rank fit (compress's argument), or None
    work: torch.Tensor | None = None  # [B,H,n,d] what is compressed (the model's values, or float32 rotated)
    exclude: torch.Tensor | None = None  # [B,H,n,d] bool: entries kept out of the statistics
    index: torch.Tensor | None = None  # int64 outlier entries (select_outliers' layout)
    slot_used: torch.Tensor | None = None
    codes: torch.Tensor | None = None  # uint8 [B,H,n,d] unpacked codes
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # codes packed by the accelerated quantizer, while still valid
    out: dict[str, torch.Tensor] = field(default_factory=dict)  # the fields written so far
    terms: tuple = ()  # the terms being run (set by the pipeline)
    extra: dict[str, Any] = field(default_factory=dict)  # scratch for extra terms
    given_residual: torch.Tensor | None = None  # the residual an accelerated backbone computed, if any

    @property
    def n(self) -> int:
        return self.x.shape[2]

    @property
    def d(self) -> int:
        return self.x.shape[3]

    @property
    def group(self) -> int:
        return self.spec.group_for(self.n, self.d)

    def residual(self, before: Term) -> torch.Tensor:
        """work - what the terms registered before `before` reconstruct (float32 [B,H,n,d], in the working basis:
        no untransform), from the fields written so far and the unpacked codes."""
        if self.given_residual is not None:
            return self.given_residual
        ds = DecodeState(self.spec, CompressedChunk(dict(self.out)), self.n, self.d, 1, None, torch.float32,
                         codes=self.codes)
        earlier = self.terms[: self.terms.index(before)]
        for term in earlier:
            term.dequantize(ds)
        for term in earlier:
            term.add(ds)
        return torch.sub(self.work, ds.x, out=ds.x)  # (work promoted to float32, in the approximation's memory)


@dataclass
class DecodeState:
    """What the decoding stages of a run of `chunks` chunks of n tokens share: `x` float32 [B,H,chunks*n,d]."""

    spec: ChunkSpec
    chunk: CompressedChunk
    n: int
    d: int
    chunks: int
    out: torch.Tensor | None  # where the result goes, if given
    out_dtype: torch.dtype
    codes: torch.Tensor | None = None  # unpacked codes, when the caller has them (encoding's residual)
    x: torch.Tensor | None = None
    direct: bool = False  # the backbone wrote straight into `out` (float32, nothing transforms after it)

    @property
    def group(self) -> int:
        return self.spec.group_for(self.n, self.d)
