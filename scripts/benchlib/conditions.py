"""What a benchmark result depends on (CPU model, cores, threads, versions, load average before and after,
whether the machine was shared), printed and written with every result."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


@dataclass
class Conditions:
    extra: dict = field(default_factory=dict)
    load_before: tuple = field(default_factory=load_average)
    load_after: tuple | None = None
    started: float = field(default_factory=time.time)

    def finish(self) -> "Conditions":
        self.load_after = load_average()
        return self

    def as_dict(self) -> dict:
        import transformers

        cores = os.cpu_count() or 1
        load = max(self.load_before[0], (self.load_after or self.load_before)[0])
        return {
            "cpu": cpu_model(), "cores": cores, "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "load_avg_1m_before": round(self.load_before[0], 2),
            "load_avg_1m_after": round((self.load_after or self.load_before)[0], 2),
            # Our own process adds about torch_threads to the load: more than that means someone else ran too.
            "machine_shared": bool(load > torch.get_num_threads() + 0.5),
            "wall_s": round(time.time() - self.started, 1),
            **self.extra,
        }

    def markdown(self) -> str:
        d = self.as_dict()
        shared = ("**the machine was shared** (load average above this process's threads: timings are noisy; "
                  "compare ratios measured side by side, not absolute numbers)" if d["machine_shared"]
                  else "machine not visibly shared")
        extra = ", ".join(f"{k}={v}" for k, v in self.extra.items())
        return (f"Conditions: {d['cpu']} ({d['cores']} cores), torch threads {d['torch_threads']}, torch {d['torch']}, "
                f"transformers {d['transformers']}, Python {d['python']}; load average (1 min) {d['load_avg_1m_before']} "
                f"before / {d['load_avg_1m_after']} after: {shared}. {extra}. Wall time {d['wall_s']} s.")


def print_conditions(cond: Conditions) -> None:
    print(cond.markdown(), flush=True)
