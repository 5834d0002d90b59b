"""An independent count of the memory a cache holds, for the memory_report tests (test_cache, test_key_allocation)."""

from __future__ import annotations

import torch


def tensors_reachable(obj, seen=None):
    """Independent count: every tensor reachable from the cache's attributes (storage-deduplicated)."""
    seen = {} if seen is None else seen
    stack, visited = [obj], set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            seen[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and type(o).__module__.startswith("gear_hf"):
            stack.extend(vars(o).values())
    return sum(seen.values())
