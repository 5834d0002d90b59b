"""Memory measured from outside: peak RSS during a call (sampled by a thread; ru_maxrss never goes down, so it
cannot tell methods apart inside one process) and an independent count of the bytes of every tensor reachable
from an object (cross-checks `GearCache.memory_report()`, measures HF's caches)."""

from __future__ import annotations

import threading
import time

import torch


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so that the RSS before a
    measured call does not include what an earlier call freed but the allocator kept."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident set size (bytes) of this process while the block runs, sampled every `interval` s."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.before = self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        release_free_memory()
        self.before = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def tensor_bytes(obj, skip_types: tuple = ()) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` through attributes, dicts, lists and tuples,
    and through tensor subclasses' inner tensors (quanto's packed tensors). Independent of any memory report."""
    seen_objs: set[int] = set()
    storages: dict[tuple, int] = {}

    def visit(x, depth=0):
        if depth > 12 or id(x) in seen_objs:
            return
        seen_objs.add(id(x))
        if isinstance(x, torch.Tensor):
            inner = getattr(x, "__tensor_flatten__", None)
            if inner is not None and type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                names, _ = x.__tensor_flatten__()
                for name in names:
                    visit(getattr(x, name), depth + 1)
                return
            if x.numel() == 0:
                return
            storage = x.untyped_storage()
            storages[(storage.data_ptr(), x.device.type)] = storage.nbytes()
            return
        if isinstance(x, (torch.nn.Module, type)) or isinstance(x, skip_types) or callable(x) and not hasattr(x, "__dict__"):
            return
        if isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                visit(v, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (str, bytes, int, float)):
            for v in vars(x).values():
                visit(v, depth + 1)

    visit(obj)
    return sum(storages.values())
