"""An independent walk of every tensor a cache keeps, for the memory-report tests and scripts/bench_memory_peak.py.

`walk(roots)` follows the object graph from named roots — attributes (``__dict__`` and ``__slots__``), dicts (keys
and values), lists, tuples, sets, dataclasses, tensor subclasses' inner tensors (quanto) — and collects the memory
blocks it reaches:

* a torch tensor: its storage, keyed by ``untyped_storage().data_ptr()`` and counted once with its full ``nbytes()``
  (a view of a grown buffer pays for the whole buffer: that is what the allocator holds);
* a numpy array (the CPU kernels' prepared runs hold some): the buffer that owns its data. An array made by
  ``tensor.numpy()`` has the tensor as its base, so it resolves to that tensor's storage; an array that owns its data
  is its own block; any other owner (numba's) is counted by the array's own extent.

Blocks overlapping one another (a numpy view inside a torch storage) are counted once: the total is the union of
their address ranges per device. Each block is attributed to the first path that reached it, so roots walked first
claim shared storage (walk the cache before the module-level memos).

Not followed: weak references (they do not keep anything alive), modules and classes, functions, and
``torch.nn.Module`` (a cache holding a model would otherwise count the weights; such a reference is listed in
`Walk.skipped_modules` instead). `exclude` leaves out given tensors' storages (`walk_cache(..., model=...)`: the
model's parameters and buffers, which a kernel memo may reference). Nothing here reads a cache's own accounting:
it sees objects, not counts.

`kernel_memos()` finds the kernels' module-level memos (derived state keyed by tensor identity) by name in every
loaded ``gear_hf`` module, wherever they live now; a memo that no longer exists is simply absent. What no walk can
reach: ``functools.lru_cache`` tables (their values are not exposed), e.g. compress/rotation.py `_hadamard_cpu`, the
[b, b] float32 Hadamard block (16 KiB for head_dim 64) that a rotating config keeps for good. `walk_cache` walks a
cache and the memo entries kept for it (an entry anchored on another cache's tensor is that cache's).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

try:
    import numpy as np
except ImportError:  # numpy comes with torch's usual installs; without it there are no arrays to find
    np = None

# Module-level memos of derived kernel state: prepared runs, key-outlier orderings, decode workspaces,
# rotary tables. Looked up by name so that moving them to another module keeps them walked.
MEMO_NAMES = ("_PREPARED", "_DERIVED_MEMO", "_WORKSPACES", "_TABLES", "_HADAMARD")

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size,
           range, slice, type(Ellipsis))
_NOT_FOLLOWED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                 weakref.ref, weakref.ProxyType, weakref.CallableProxyType, types.CodeType, types.FrameType)


@dataclass
class Block:
    path: str  # the first path that reached it, e.g. "cache.layers[0].key_stream.buffer.data"
    device: str
    start: int  # address
    nbytes: int
    kind: str  # "torch" (a storage) or "numpy" (an array's owning buffer)


@dataclass
class Walk:
    blocks: list[Block] = field(default_factory=list)
    skipped_modules: list[str] = field(default_factory=list)  # paths of nn.Module references not followed

    @property
    def total(self) -> int:
        """Bytes of the union of every block's address range, per device (each byte once)."""
        total = 0
        for device in {b.device for b in self.blocks}:
            end = None
            for b in sorted((b for b in self.blocks if b.device == device), key=lambda b: b.start):
                lo, hi = b.start, b.start + b.nbytes
                if end is None or lo >= end:
                    total += hi - lo
                    end = hi
                elif hi > end:
                    total += hi - end
                    end = hi
        return total

    def bytes_under(self, *prefixes: str) -> int:
        """Bytes of the blocks first reached under any of `prefixes` (overlaps with other blocks not removed:
        use it for attribution, `total` for the sum)."""
        return sum(b.nbytes for b in self.blocks if b.path.startswith(prefixes))

    def by_root(self) -> dict[str, int]:
        """Bytes per top-level root name (the part of the path before the first '.' or '[')."""
        out: dict[str, int] = {}
        for b in self.blocks:
            root = b.path.split(".", 1)[0].split("[", 1)[0]
            out[root] = out.get(root, 0) + b.nbytes
        return out

    def largest(self, n: int = 10) -> list[tuple[str, int]]:
        return [(b.path, b.nbytes) for b in sorted(self.blocks, key=lambda b: -b.nbytes)[:n]]


def _slot_names(obj) -> list[str]:
    names = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def walk(roots: dict[str, object], exclude=(), max_objects: int = 2_000_000) -> Walk:
    """Every distinct memory block reachable from `roots` ({name: object}, walked in order); exclude: tensors whose
    storages are someone else's (a model's parameters and buffers, which a memo may reference)."""
    result = Walk()
    seen_objects: set[int] = set()
    seen_blocks: set[tuple[str, int, int]] = set()
    excluded = {(str(t.device), t.untyped_storage().data_ptr()) for t in exclude}
    keep_alive = []  # objects made during the walk (inner tensors), so their ids are not reused

    def add_block(path: str, device: str, start: int, nbytes: int, kind: str) -> None:
        key = (device, start, nbytes)
        if nbytes > 0 and key not in seen_blocks and (device, start) not in excluded:
            seen_blocks.add(key)
            result.blocks.append(Block(path, device, start, nbytes, kind))

    for name, root in roots.items():
        stack = deque([(root, name)])
        while stack:
            obj, path = stack.pop()
            if isinstance(obj, _LEAVES) or isinstance(obj, _NOT_FOLLOWED) or id(obj) in seen_objects:
                continue
            seen_objects.add(id(obj))
            if len(seen_objects) > max_objects:
                raise RuntimeError(f"memory walk: more than {max_objects} objects reachable from {list(roots)}")
            if isinstance(obj, torch.nn.Module):
                result.skipped_modules.append(path)
                continue
            if isinstance(obj, torch.Tensor):
                flatten = getattr(obj, "__tensor_flatten__", None)
                if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                    names, _ = flatten()
                    for inner_name in names:
                        inner = getattr(obj, inner_name)
                        keep_alive.append(inner)
                        stack.append((inner, f"{path}.{inner_name}"))
                    continue
                if obj.device.type == "meta" or obj.is_sparse:
                    continue
                storage = obj.untyped_storage()
                add_block(path, str(obj.device), storage.data_ptr(), storage.nbytes(), "torch")
                continue
            if np is not None and isinstance(obj, np.ndarray):
                owner = obj
                while isinstance(owner, np.ndarray) and owner.base is not None:
                    owner = owner.base
                if isinstance(owner, torch.Tensor):  # tensor.numpy(): the tensor's storage
                    stack.append((owner, path))
                elif isinstance(owner, np.ndarray):  # owns its data
                    add_block(path, "cpu", owner.__array_interface__["data"][0], owner.nbytes, "numpy")
                else:  # another exporter (numba's memory info, a buffer): the array's own extent
                    add_block(path, "cpu", obj.__array_interface__["data"][0], obj.nbytes, "numpy")
                continue
            if isinstance(obj, dict):
                for key, value in obj.items():
                    stack.append((value, f"{path}[{key!r}]"))
                    if not isinstance(key, _LEAVES):
                        stack.append((key, f"{path}.<key {type(key).__name__}>"))
                continue
            if isinstance(obj, (list, tuple, deque)):
                for i, value in enumerate(obj):
                    stack.append((value, f"{path}[{i}]"))
                continue
            if isinstance(obj, (set, frozenset)):
                for value in obj:
                    stack.append((value, f"{path}{{}}"))
                continue
            if callable(obj) and not hasattr(obj, "__dict__") and not _slot_names(obj):
                continue  # builtins, C callables
            attributes = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for slot in _slot_names(obj):
                if hasattr(obj, slot):
                    attributes[slot] = getattr(obj, slot)
            if dataclasses.is_dataclass(obj):
                for f in dataclasses.fields(obj):
                    if f.name not in attributes and hasattr(obj, f.name):
                        attributes[f.name] = getattr(obj, f.name)
            for attr, value in attributes.items():
                stack.append((value, f"{path}.{attr}"))
    return result


def kernel_memos() -> dict[str, object]:
    """{"<module>.<memo>": memo} for every loaded gear_hf module defining one of MEMO_NAMES (a module that was never
    imported has never filled its memo)."""
    found = {}
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not (module_name == "gear_hf" or module_name.startswith("gear_hf.")):
            continue
        for memo in MEMO_NAMES:
            value = module.__dict__.get(memo)
            if value is not None:
                found[f"{module_name}.{memo}"] = value
    return found


def _entries_for(memo, storages: set[tuple[str, int]]):
    """The part of a memo kept for the walked cache: a dict whose entries are (weakref to an anchor tensor, ...)
    (`_PREPARED`, `_DERIVED_MEMO`: derived state per store tensor) keeps only the entries whose anchor's storage is
    the cache's; any other memo (the last step's tables, shared workspaces) is kept whole."""
    if not isinstance(memo, dict):
        return memo
    mine, anchored = {}, False
    for key, value in memo.items():
        if isinstance(value, tuple) and value and isinstance(value[0], weakref.ref):
            anchored = True
            anchor = value[0]()
            if not isinstance(anchor, torch.Tensor) or \
                    (str(anchor.device), anchor.untyped_storage().data_ptr()) not in storages:
                continue  # another cache's (or a dead tensor's) entry
        mine[key] = value
    return mine if anchored else memo


def walk_cache(cache, memos: bool = True, model: torch.nn.Module | None = None) -> Walk:
    """The cache, then (memos=True) what the kernels' module-level memos keep for it (`_entries_for`): what it owns,
    each block once. model: its parameters and buffers are not the cache's (the rotary tables memo keeps a reference
    to the rotary module's inv_freq)."""
    exclude = [*model.parameters(), *model.buffers()] if model is not None else ()
    alone = walk({"cache": cache}, exclude)
    if not memos:
        return alone
    storages = {(b.device, b.start) for b in alone.blocks if b.kind == "torch"}
    roots = {"cache": cache, **{name: _entries_for(memo, storages) for name, memo in kernel_memos().items()}}
    return walk(roots, exclude)
