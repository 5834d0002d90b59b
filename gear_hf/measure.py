"""What one `generate` run did, measured from outside the model: decode step times, agreement with a reference
run, and the untimed warm-up that keeps kernel compilation out of tokens/s (shared by the demo, lm-eval and the
benchmark scripts)."""

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


def warm_up_lengths(config) -> tuple[int, int]:
    """(prompt tokens, new tokens) of a warm-up generate that runs once every kernel a generate with GearConfig
    `config` can reach: a prompt long enough to compress a prompt chunk (the sinks, one prompt granule and a few
    buffered tokens) and enough new tokens to flush the buffer into a decode chunk. None or no compression: a
    short generate (first-call set-up only)."""
    if config is None or not config.compresses:
        return 8, 2
    return config.sink_tokens + config.prompt_granule + 8, config.buffer_size + 1


def warm_up(model, input_ids, config=None, **generate_kwargs) -> float:
    """Seconds of one untimed greedy generate before timed ones, so that their tokens/s exclude kernel compilation
    (numba on CPU and Triton on CUDA compile on first use) and first-call set-up: the last `warm_up_lengths(config)`
    tokens of input_ids' row 0 ([B, T] on the model's device; under left padding a row ends with real tokens), the
    model as it is (enabled with `config`, or stock for None). generate_kwargs: e.g. pad_token_id."""
    import torch

    prompt, new = warm_up_lengths(config)
    ids = input_ids[:1, -prompt:]
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, **generate_kwargs)
    return time.perf_counter() - start
