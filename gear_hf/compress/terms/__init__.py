"""The terms a chunk's stored format is made of, and their registry.

A stored format is a list of terms (`ChunkSpec.terms`), each in one module: it declares its fields (name, dtype,
shape per chunk, memory component) and implements its stages of the oracle encode/decode (`base`). The chunk's
storage (`gear_hf.cache.storage.ChunkStore`), the memory report and the kernels' field lists are generated from these
declarations.

Adding a term (the recipe):
  1. a module here with a `Term` subclass: `name`, `fields(spec, n, d, side)`, and the stage hooks it needs
     (`transform`/`select`/`quantize`/`correct`/`pack`/`fit` to encode, `dequantize`/`add`/`untransform` to
     decode; `transforms(spec)` True if it changes the basis);
  2. one registry line below: `register_term(MyTerm())`;
  3. select it where a chunk is specified: `ChunkSpec(..., extra_terms=("my-term",))`, or for a cache
     `GearConfig(extra_terms=("my-term",))`.
  The torch backend (the oracle) then stores and reads it; accelerated backends refuse a format with a term they
  do not implement (`gear_hf.backends`), so it can never be skipped silently. tests/test_format.py defines a term
  in the test file and round-trips it.
"""

from __future__ import annotations

from ..spec import ChunkSpec
from .backbone import QuantizedBackbone
from .base import DECODE_STAGES, ENCODE_STAGES, DecodeState, EncodeState, Field, Term
from .lowrank import LowRank
from .rotation import Rotation
from .sparse import SparseOutliers

__all__ = ["DECODE_STAGES", "ENCODE_STAGES", "DecodeState", "EncodeState", "Field", "Term", "METHOD_TERMS",
           "register_term", "unregister_term", "registered_terms", "terms_of", "active_terms", "chunk_fields",
           "BUILTIN_FIELDS"]

_REGISTRY: dict[str, Term] = {}


def register_term(term: Term) -> Term:
    """Add a term to the registry (its hooks run in registration order within each stage)."""
    if not isinstance(term, Term) or not term.name:
        raise TypeError(f"register_term takes a named gear_hf.compress.terms.Term instance, got {term!r}")
    if term.name in _REGISTRY:
        raise ValueError(f"a term named {term.name!r} is already registered; registered: {list(_REGISTRY)}")
    _REGISTRY[term.name] = term
    return term


def unregister_term(name: str) -> None:
    """Remove an extra term (built-in terms stay: every format relies on them)."""
    term = _REGISTRY.get(name)
    if term is None:
        raise ValueError(f"no term named {name!r} is registered; registered: {list(_REGISTRY)}")
    if term.builtin:
        raise ValueError(f"term {name!r} is built in and cannot be unregistered")
    del _REGISTRY[name]


def registered_terms() -> tuple[Term, ...]:
    return tuple(_REGISTRY.values())


def terms_of(spec: ChunkSpec) -> tuple[Term, ...]:
    """The terms that run for a chunk of this spec, in registry order: every built-in term (each handles being
    inactive) and the extra terms the spec names."""
    unknown = [name for name in spec.extra_terms if name not in _REGISTRY]
    if unknown:
        raise ValueError(f"ChunkSpec.extra_terms names unregistered term(s) {unknown}; registered: "
                         f"{[t.name for t in _REGISTRY.values() if not t.builtin]} (gear_hf.compress.terms."
                         "register_term)")
    return tuple(t for t in _REGISTRY.values() if t.builtin or t.name in spec.extra_terms)


def active_terms(spec: ChunkSpec) -> tuple[str, ...]:
    """Names of the terms that store something for this spec (the format's terms, e.g. ('backbone', 'lowrank'))."""
    return tuple(t.name for t in terms_of(spec) if t.active(spec))


def chunk_fields(spec: ChunkSpec, n: int, d: int, side) -> tuple[Field, ...]:
    """Every field one chunk of n tokens, head_dim d stores, in storage order (`Field`: [B,H,*shape] each)."""
    return tuple(f for term in terms_of(spec) for f in term.fields(spec, n, d, side))


# Which terms each GearConfig method stores (GearConfig.method; "fp16" compresses nothing).
METHOD_TERMS: dict[str, tuple[str, ...]] = {
    "fp16": (),
    "kivi": ("backbone",),
    "kcvt": ("backbone",),  # coarse groups: one per whole channel / token vector
    "outlier": ("backbone", "outliers"),
    "gear-l": ("backbone", "lowrank"),
    "gear": ("backbone", "outliers", "lowrank"),
}

# The registry: encoding runs each stage's hooks in this order (rotation first: the others work in its basis).
register_term(Rotation())
register_term(QuantizedBackbone())
register_term(SparseOutliers())
register_term(LowRank())

# The fields of the built-in terms, in storage order (what the kernels read).
BUILTIN_FIELDS: tuple[str, ...] = tuple(
    f.name for t in registered_terms() if t.builtin
    for f in t.fields(ChunkSpec(bits=4, axis="channel", group=8, outlier_ratio=0.1, rank=1), 8, 8, None))
