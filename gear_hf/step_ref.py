"""`StepRef`: how a compiled graph holds the GearCache and the attention module without tracing or guarding them.

Under torch.compile each layer's cache step is one custom operator (`gear_hf::cache_step`, gear_hf.attention). An
operator takes tensors, scalars and registered opaque types, so the cache and the module go in wrapped in a
`StepRef`, registered as a *reference* opaque type (torch._library.opaque_object): dynamo lifts a reference it finds
on a graph input (`cache.step_ref`, `module._gear_hf_patch.step_ref`) as a graph input of its own, does not trace
into it and guards on its type only, so a new cache (every generate) reuses the compiled graph. An operator with an
opaque argument is also ordered (torch._library.effects): the steps run in program order. A StepRef cannot be created
inside the compiled region (dynamo refuses), so each exists beforehand: the cache's from its constructor, the
module's from `gear_hf.enable`.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

try:  # torch's opaque objects (private API; in torch 2.13, the version setup.cfg pins)
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # an older torch (the GPU image's): compile falls back to one graph break per layer
    register_opaque_type = None
    OpaqueBase = object

# Whether the cache step can be one opaque operator inside a compiled graph (gear_hf.attention).
OPAQUE_STEP = register_opaque_type is not None


class StepRef(OpaqueBase):
    """A weak reference to `target`: the cache (or module) holds its StepRef, and a strong one would make a cycle
    that keeps a finished cache's storage alive until the garbage collector runs. A deepcopy of the owner gets a
    StepRef to the copied owner; a pickled one, to the unpickled owner."""

    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        self._target = weakref.ref(target)

    @property
    def target(self) -> Any:
        target = self._target()
        if target is None:
            raise ReferenceError("gear_hf: the cache or module of this compiled step no longer exists")
        return target

    def __deepcopy__(self, memo: dict) -> StepRef:
        return StepRef(copy.deepcopy(self.target, memo))  # the owner is in memo: its copy

    def __reduce__(self):
        return StepRef, (self.target,)

    def __repr__(self) -> str:
        return f"StepRef({type(self._target()).__name__})"


if OPAQUE_STEP:
    register_opaque_type(StepRef, typ="reference")
