"""The numba kernels' on-disk cache is keyed on every source of gear_hf/kernels/cpu (`kernels.cpu.jit`): numba keys
a cached function on its own file only, so a loop inlining a changed helper of another file would load stale code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

numba = pytest.importorskip("numba")

from gear_hf.kernels.cpu import attend, dequant, jit, tail  # noqa: E402


def test_the_key_changes_with_any_source_of_the_folder(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a source")
    key = jit.sources_key(tmp_path)
    assert jit.sources_key(tmp_path) == key and len(key) == 16
    (tmp_path / "notes.txt").write_text("still not a source")
    assert jit.sources_key(tmp_path) == key
    (tmp_path / "b.py").write_text("y = 3\n")  # a callee's file, not the caller's
    changed = jit.sources_key(tmp_path)
    assert changed != key
    (tmp_path / "c.py").write_text("")
    assert jit.sources_key(tmp_path) != changed
    (tmp_path / "c.py").rename(tmp_path / "d.py")
    assert jit.sources_key(tmp_path) != changed


def test_every_cached_kernel_lives_under_the_folders_key():
    expected = Path(jit.cache_dir())
    assert expected.name == f"numba-{numba.__version__}-{jit.sources_key()}"
    kernels = [attend._attend, attend._attend_parallel, dequant._decompress, tail._encode]
    for dispatcher in kernels:
        assert dispatcher._cache is not None and type(dispatcher._cache).__name__ != "NullCache", dispatcher
        path = Path(dispatcher._cache._cache_path)
        assert expected in (path, *path.parents), (dispatcher, path)


def test_other_numba_code_keeps_its_own_cache_location(tmp_path, monkeypatch):
    before = numba.config.CACHE_DIR

    @jit.kernel()
    def add_one(x):
        return x + 1

    assert numba.config.CACHE_DIR == before
    assert add_one(1) == 2
    assert os.path.isdir(jit.cache_dir())


def test_where_the_cache_goes(tmp_path, monkeypatch):
    where = jit.cache_dir.__wrapped__  # (the memoised one was fixed when the kernels were decorated)
    name = f"numba-{numba.__version__}-{jit.sources_key()}"  # (another numba release: a folder of its own)
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "user"))  # NUMBA_CACHE_DIR set: under it
    assert Path(where()) == tmp_path / "user" / name
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    assert Path(where()) == jit.KERNEL_SOURCES / "__pycache__" / name  # the package's own __pycache__
    monkeypatch.setattr(jit, "_writable", lambda folder: False)  # a read-only install: the user's cache folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert Path(where()) == tmp_path / "xdg" / "gear_hf" / name


@pytest.mark.skipif(jit.fcntl is None, reason="no file locks on this OS")
def test_saves_and_loads_of_the_cache_wait_for_the_lock():
    """Processes that compile at once (pytest workers, accelerate ranks) take turns at a function's cache index: a
    load waits while another holder has the folder's lock (flock: another open file description, as another
    process's would be), and goes on once it is released."""
    import threading
    import time

    cache_file = attend._attend._cache._cache_file
    assert isinstance(cache_file, jit._OneWriterAtATime)
    done = threading.Event()
    with open(os.path.join(cache_file._cache_path, ".gear_hf-cache.lock"), "a") as lock:
        jit.fcntl.flock(lock, jit.fcntl.LOCK_EX)
        reader = threading.Thread(target=lambda: (cache_file.load(("no such key",)), done.set()))
        reader.start()
        time.sleep(0.3)
        assert not done.is_set()  # waiting for the lock
        jit.fcntl.flock(lock, jit.fcntl.LOCK_UN)
    reader.join(10)
    assert done.is_set()
