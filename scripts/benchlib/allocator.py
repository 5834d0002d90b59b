"""Memory as the allocator sees it, during one call: the peak of what was allocated and not yet freed, relative to
the start, and what is still allocated at the end.

* CPU: torch's CPU allocator reports every allocation and free it serves (its `ProfiledCPUMemoryReporter`) to the
  profiler when `profile_memory=True`; those are the ``[memory]`` events of the kineto trace, each with its signed
  size, address and time. Their running sum in time order is the bytes allocated during the block and still live: its
  maximum is the peak, its last value what the block left allocated. Only blocks allocated inside the block are
  counted (each event carries its address): freeing memory allocated before it (an earlier call's module-level
  memo, replaced now) does not lower the figure. This sees every tensor storage, intermediate ones inside an
  operator included, whoever holds it. It does not see memory that does not come from torch's allocator: numpy's
  own arrays, numba's, Python objects. (RSS cannot tell methods apart inside one process; tracemalloc sees
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
        from torch._C._profiler import _EventType

        events, stack = [], list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
            stack.extend(node.children)
        events.sort(key=lambda e: e[0])  # (stable: same-time events keep the order they were recorded in)
        live_blocks: dict[int, int] = {}  # address -> size of the blocks allocated inside the block, still live
        live = peak = 0
        for _, ptr, size in events:
            if size > 0:
                live_blocks[ptr] = size
                live += size
                peak = max(peak, live)
            elif ptr in live_blocks:  # (a free of a block allocated before the block is not counted)
                live -= live_blocks.pop(ptr)
        self.result = AllocatorMeasurement(peak_bytes=peak, end_bytes=live, events=len(events),
                                           how="torch.profiler profile_memory: CPU allocator events, blocks "
                                               "allocated inside the block")
        self._profile = None  # (the trace is large: drop it)
