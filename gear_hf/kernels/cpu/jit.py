"""`kernel`: numba.njit for this folder's compiled loops, with the on-disk cache keyed on every source file here.

numba keys a cached function on its own file only: a loop in `attend.py` that inlines a changed helper of
`dequant.py` would load its stale machine code (a checkout that changed one file gave other decode bits than a
fresh compile). So every cached kernel of this folder lives in a cache directory named after a hash of all the
folder's sources: any edit here starts a fresh one. The name also carries numba's version: numba drops an index
written by another version and writes its own over it, so two environments of one checkout (`.venv` and
`.venv-vllm` pin different numba releases) sharing a folder would each recompile what the other last saved.

Processes that compile at once (pytest workers, `accelerate launch` ranks, the warm-up's workers) save into one cache:
numba reads a function's index, extends it and writes it back, so two processes saving kernels of one function
together could lose an entry or pair one signature with another's machine code. Every kernel's cache file here
takes an exclusive file lock for each save and load (`_OneWriterAtATime`).

Small helpers are plain `numba.njit` functions, never `inline="always"`: numba's IR inlining types a helper again at
every call site, which made compiling slow (the compression kernel spent 14 of its 18 s in typing); LLVM inlines the
calls anyway when it links the helpers in (decode speed unchanged, measured).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numba
from numba.core.caching import IndexDataCacheFile

try:
    import fcntl
except ImportError:  # (Windows: no file locks; numba's own behaviour)
    fcntl = None

KERNEL_SOURCES = Path(__file__).resolve().parent


def sources_key(folder: Path = KERNEL_SOURCES) -> str:
    """A hash of the names and contents of the .py files in `folder` (16 hex digits)."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


@functools.cache
def cache_dir() -> str:
    """Where the kernels' compiled code goes: a `numba-<numba version>-<sources_key>` folder in NUMBA_CACHE_DIR when
    set, else in this folder's __pycache__ when writable (an installed package may not be), else in the user's cache
    folder."""
    if numba.config.CACHE_DIR:
        base = Path(numba.config.CACHE_DIR)
    else:
        base = KERNEL_SOURCES / "__pycache__"
        if not _writable(base):
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gear_hf"
    return str(base / f"numba-{numba.__version__}-{sources_key()}")


class _OneWriterAtATime(IndexDataCacheFile):
    """numba's cache file of one function, each save and load under an exclusive lock on the cache folder."""

    def _locked(self, method, *args):
        os.makedirs(self._cache_path, exist_ok=True)
        with open(os.path.join(self._cache_path, ".gear_hf-cache.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return method(self, *args)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def save(self, key, data):
        return self._locked(IndexDataCacheFile.save, key, data)

    def load(self, key):
        return self._locked(IndexDataCacheFile.load, key)


def kernel(**options):
    """numba.njit(cache=True, nogil=True, **options), cached under `cache_dir()` (its saves and loads locked where the
    OS has file locks). numba binds a function's cache location when it is decorated, so NUMBA_CACHE_DIR is pointed
    there for that moment only (other numba code of the process keeps its own)."""

    def decorate(func):
        previous = numba.config.CACHE_DIR
        numba.config.CACHE_DIR = cache_dir()
        try:
            dispatcher = numba.njit(cache=True, nogil=True, **options)(func)
        finally:
            numba.config.CACHE_DIR = previous
        cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
        if fcntl is not None and type(cache_file) is IndexDataCacheFile:
            cache_file.__class__ = _OneWriterAtATime
        return dispatcher

    return decorate
