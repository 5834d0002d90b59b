"""The fused CPU attention over several threads (`gear_hf.kernels.cpu.threads`): as many as torch uses, one per
(row, KV head) pair at most, only through a thread-safe numba threading layer and not in a forked child; the same
output bits as on one thread."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

import numba  # noqa: E402

import gear_hf  # noqa: E402
from gear_hf.kernels.cpu import attend, threads  # noqa: E402
from gear_hf.warmup import tiny_model  # noqa: E402


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for the test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _parallel_here() -> bool:
    return threads.threadsafe_layer() and numba.config.NUMBA_NUM_THREADS >= 2


def test_threads_follow_torch_and_the_shares(torch_threads):
    torch_threads(1)
    assert threads.parts(6) == 1
    torch_threads(2)
    assert threads.parts(1) == 1
    assert threads.parts(6) == (2 if _parallel_here() else 1)


def test_an_unsafe_threading_layer_runs_serially(torch_threads, monkeypatch):
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "workqueue")
    assert not threads.threadsafe_layer()
    monkeypatch.setattr(threads, "_THREADSAFE", [False])
    torch_threads(2)
    assert threads.parts(4) == 1


def test_a_forked_child_runs_serially(torch_threads):
    torch_threads(2)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it would use, then leave at once
        os.write(write, str(threads.parts(4)).encode())
        os._exit(0)
    os.close(write)
    answer = os.read(read, 16).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == "1"


@pytest.mark.skipif(not _parallel_here(), reason="no thread-safe numba threading layer or a single core")
def test_numba_threads_are_restored():
    before = numba.get_num_threads()
    with threads.using(1):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before


@pytest.mark.skipif(not _parallel_here(), reason="no thread-safe numba threading layer or a single core")
def test_torch_keeps_its_thread_count_after_a_parallel_kernel(torch_threads):
    """On numba's OpenMP layer numba's thread count is OpenMP's, which torch reads: a user who set torch to fewer
    threads than numba's default keeps them after a kernel ran on more."""

    @numba.njit(parallel=True)
    def add_one(values):
        for i in numba.prange(values.shape[0]):
            values[i] += 1

    torch_threads(1)
    values = np.zeros(64)
    with threads.using(2):
        add_one(values)
    assert (values == 1).all()
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(not _parallel_here(), reason="no thread-safe numba threading layer or a single core")
@pytest.mark.parametrize("dtype, name", [("float32", "balanced"), ("bfloat16", "gear-2")])
def test_the_parallel_attention_gives_the_serial_bits(dtype, name, torch_threads, monkeypatch):
    from gear_hf.warmup import shipped_config

    config = shipped_config(name)
    model = tiny_model(dtype)
    ids = torch.randint(3, 128, (3, 300), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :17], mask[2, :40] = 0, 0
    calls, serial = [], [True]
    parallel, real_parts = attend._attend_parallel, threads.parts
    monkeypatch.setattr(attend, "_attend_parallel", lambda *args: calls.append(args[-1]) or parallel(*args))
    monkeypatch.setattr(threads, "parts", lambda shares: 1 if serial[0] else real_parts(shares))
    torch_threads(2)
    logits = {}
    for mode in ("serial", "parallel"):
        serial[0] = mode == "serial"
        with gear_hf.enabled(model, config), torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=config.buffer_size + 20,
                                 min_new_tokens=config.buffer_size + 20, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        logits[mode] = torch.stack(out.logits)
    assert calls and set(calls) == {2}  # (9 (row, KV head) pairs over 2 threads, on the parallel run only)
    assert torch.equal(logits["serial"], logits["parallel"])
