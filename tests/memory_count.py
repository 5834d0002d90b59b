"""An independent count of the memory a cache holds, for the memory_report tests (test_cache, test_key_allocation),
and of the tensors alive in the process (test_inference_mode, test_robustness)."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import torch


def _is_tensor(o) -> bool:
    try:
        return isinstance(o, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose object is gone (numba's compiler leaves some): not a tensor
        return False


def live_tensors() -> tuple[int, int]:
    """(tensors alive in the process, bytes of their distinct storages), after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on every object touches deprecated torch module attributes)
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if _is_tensor(o)]
    storages = {}
    for t in tensors:
        try:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except RuntimeError:
            pass
    return len(tensors), sum(storages.values())


def tensors_reachable(obj, seen=None):
    """Independent count: every tensor reachable from the cache's attributes (storage-deduplicated), and every numpy
    array the kernels keep that is not a view of one of those storages (prepared copies)."""
    seen = {} if seen is None else seen
    arrays = {}
    stack, visited = [obj], set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            seen[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, np.ndarray):
            if o.nbytes:
                arrays[o.__array_interface__["data"][0]] = o.nbytes
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and type(o).__module__.startswith("gear_hf"):
            stack.extend(vars(o).values())
    spans = [(start, start + n) for start, n in seen.items()]
    owned = sum(n for at, n in arrays.items() if not any(lo <= at < hi for lo, hi in spans))
    return sum(seen.values()) + owned
