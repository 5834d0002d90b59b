"""How many threads a kernel call with independent shares of work may use (`launch`: `attend._attend_parallel`,
`paged._paged_parallel`): as many as torch uses (`torch.get_num_threads()`, the count the model's own operations run
on between the kernels), at most one per share, and only where numba runs parallel kernels safely:

* through a thread-safe numba threading layer (OpenMP or TBB): calls may come from several Python threads at once
  (a server's); numba's fallback layer, "workqueue", aborts the process on concurrent launches;
* not in a process forked from this one (GNU OpenMP does not survive a fork).

Elsewhere every call runs on the calling thread alone. (Python threads do not do: unboxing a kernel's arguments
holds the GIL, and split over two threads the fused attention ran slower than on one.)
"""

from __future__ import annotations

import contextlib
import importlib
import os

import numba
import torch

_forked = False


def _after_fork() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):  # (POSIX; elsewhere processes are spawned, not forked)
    os.register_at_fork(after_in_child=_after_fork)

_THREADSAFE: list[bool] = []  # (worked out once)


def threadsafe_layer() -> bool:
    """numba's parallel kernels will run on OpenMP or TBB: the layer NUMBA_THREADING_LAYER names (default: the first
    of tbb, omp, workqueue that loads) is one of them and its library loads."""
    wanted = str(numba.config.THREADING_LAYER).lower()
    candidates = {"default": ("tbbpool", "omppool"), "threadsafe": ("tbbpool", "omppool"), "safe": ("tbbpool",),
                  "forksafe": ("tbbpool", "omppool"), "tbb": ("tbbpool",), "omp": ("omppool",)}.get(wanted, ())
    for module in candidates:
        try:
            importlib.import_module(f"numba.np.ufunc.{module}")
            return True
        except Exception:  # (a layer whose library does not load, however it fails: not available)
            continue
    return False


def parts(shares: int) -> int:
    """Threads for a call of `shares` independent shares: min(shares, torch's threads, numba's), 1 where a parallel
    call is not safe (module docstring)."""
    wanted = min(shares, torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if wanted <= 1 or _forked:
        return 1
    if not _THREADSAFE:
        _THREADSAFE.append(threadsafe_layer())
    return wanted if _THREADSAFE[0] else 1


@contextlib.contextmanager
def using(count: int):
    """numba's parallel kernels launched from this thread use `count` threads inside the block (as before after),
    and torch keeps its own count: on the OpenMP layer numba's count is OpenMP's, which torch reads too (numba's first
    call of a process launches its layer at numba's default, the machine's cores, and restoring that default would
    leave torch on every core after a user chose fewer). torch's count is read first, before that launch."""
    torch_threads = torch.get_num_threads()
    previous = numba.get_num_threads()
    numba.set_num_threads(count)
    try:
        yield
    finally:
        numba.set_num_threads(previous)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def launch(serial, parallel, args: tuple, shares: int):
    """serial(*args), or parallel(*args, count) on `count = parts(shares)` threads where that is more than one (a
    kernel whose shares are independent and whose parallel form computes each as the serial one does)."""
    count = parts(shares)
    if count > 1:
        with using(count):
            return parallel(*args, count)
    return serial(*args)
