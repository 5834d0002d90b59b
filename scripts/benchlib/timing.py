"""Median milliseconds of a call: CUDA events on a GPU, the wall clock elsewhere (only to exercise a script)."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
