"""Memory as the allocator sees it, during one call: the peak of what was allocated and not yet freed, relative to
the start, and what is still allocated at the end.

* CPU: torch's CPU allocator reports every allocation and free it serves (its `ProfiledCPUMemoryReporter`) to the
  profiler when `profile_memory=True`; those are the ``[memory]`` events of the kineto trace, each with its signed
  size and its time. Their running sum in time order is the bytes allocated during the block and still live: its
  maximum is the peak, its last value what the block left allocated. This sees every tensor storage, intermediate
  ones inside an operator included, whoever holds it. It does not see memory that does not come from torch's
  allocator: numpy's own arrays, numba's (the CPU kernels allocate some), Python objects. A free of a block
  allocated before the block started is not reported (the reporter does not know its size), so pre-existing memory
  freed inside the block cannot lower the figure. (RSS cannot tell methods apart inside one process; tracemalloc sees
  numpy's arrays but none of torch's storages.)
* CUDA: `torch.cuda.reset_peak_memory_stats` then `max_memory_allocated` / `memory_allocated`, relative to
  `memory_allocated` at the start (the caching allocator's own count of bytes handed out to tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AllocatorMeasurement:
    peak_bytes: int = 0  # most bytes allocated and not freed at any moment of the block, relative to its start
    end_bytes: int = 0  # allocated during the block and still allocated at its end
    events: int = 0  # allocator events seen (CPU); 0 on CUDA
    how: str = ""


class AllocatorPeak:
    """`with AllocatorPeak(device) as m: ...`; then m.result (an AllocatorMeasurement)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.result = AllocatorMeasurement()

    def __enter__(self) -> "AllocatorPeak":
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False,
                                    with_stack=False)
            self._profile.__enter__()
        else:
            raise ValueError(f"AllocatorPeak: device {self.device} is not measured (cpu or cuda)")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result = AllocatorMeasurement(
                peak_bytes=torch.cuda.max_memory_allocated(self.device) - self._start,
                end_bytes=torch.cuda.memory_allocated(self.device) - self._start,
                how="torch.cuda.max_memory_allocated - memory_allocated at start")
            return
        self._profile.__exit__(*exc)
        if exc[0] is not None:
            return
        deltas = [(e.start_ns(), e.nbytes()) for e in self._profile.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        deltas.sort(key=lambda item: item[0])  # (a stable sort: same-time events keep the order they were recorded)
        live = peak = 0
        for _, nbytes in deltas:
            live += nbytes
            peak = max(peak, live)
        self.result = AllocatorMeasurement(peak_bytes=peak, end_bytes=live, events=len(deltas),
                                           how="torch.profiler profile_memory: running sum of CPU allocator events")
        self._profile = None  # (the trace is large: drop it)
