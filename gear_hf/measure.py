"""What one `generate` run did, measured from outside the model: decode step times and agreement with a
reference run (shared by the demo and the benchmark scripts)."""

from __future__ import annotations

import time


class StepClock:
    """A logits processor that only notes when each step's logits arrive (the first right after prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def decode(self) -> tuple[int, float]:
        """(decode steps, their seconds): everything after the prefill step."""
        return len(self.times) - 1, (self.times[-1] - self.times[0]) if len(self.times) > 1 else 0.0

    def step_seconds(self) -> list[float]:
        """Duration of each decode step (between consecutive logits)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


def matched_prefix(a: list[int], b: list[int]) -> int:
    """Greedy tokens identical before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
