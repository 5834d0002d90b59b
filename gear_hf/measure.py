"""What one `generate` run did, measured from outside the model: decode step times, agreement with a reference
run, the untimed warm-up that keeps kernel compilation out of tokens/s (shared by the demo, lm-eval and the
benchmark scripts), and the bits per element a cache owns over a decode run (RECOMMENDED's bits, tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass


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
    """(prompt tokens, new tokens) of the first warm-up generate (`warm_up_generates`): a prompt long enough to
    compress a prompt chunk (the sinks, one prompt granule and a few buffered tokens) and enough new tokens to flush
    the buffer into a decode chunk. None or no compression: a short generate (first-call set-up only)."""
    if config is None or not config.compresses:
        return 8, 2
    return config.sink_tokens + config.prompt_granule + 8, config.buffer_size + 1


# a prompt chunk longer than this keeps its outliers' token indices in 16 bits instead of 8 (`outliers.index_dtype`):
# other argument types, so other compiled kernels (prompts past 32,768 tokens take 32-bit ones: not warmed up)
WIDE_INDEX_TOKENS = 256


def warm_up_generates(config, max_positions: int | None = None) -> list[tuple[int, int]]:
    """(prompt tokens, new tokens) of each warm-up generate that together run every kernel a generate with GearConfig
    `config` can reach (short of prompts past 32,768 tokens): `warm_up_lengths`, then a prompt whose chunk is longer
    than WIDE_INDEX_TOKENS, one decode step; those longer than a model's `max_positions` left out (it reaches
    neither)."""
    runs = [warm_up_lengths(config)]
    if config is not None and config.compresses:
        runs.append((config.sink_tokens + WIDE_INDEX_TOKENS + config.prompt_granule + config.buffer_size, 2))
    return [run for run in runs if max_positions is None or sum(run) <= max_positions] or runs[:1]


def max_positions(model) -> int | None:
    """The longest sequence a model's config allows (`max_position_embeddings` of its text config), None if unset."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def warm_up_ids(input_ids, prompt: int):
    """The last `prompt` tokens of input_ids' row 0 ([1, prompt]; under left padding a row ends with real tokens),
    repeated from its start where the row is shorter (what a warm-up's tokens are does not matter, their count does)."""
    row = input_ids[0]
    if row.numel() < prompt:
        row = row.repeat(-(-prompt // row.numel()))
    return row[-prompt:][None]


@dataclass
class WarmUp:
    """What the untimed warm-up generates cost: their seconds, and of them the seconds numba spent compiling kernels
    (`gear_hf.warmup.CompileWatch`; 0 when they were compiled before, e.g. by `python -m gear_hf.warmup`), and the
    new tokens they generated (per row, all of them together)."""

    seconds: float
    compile_seconds: float
    kernels_compiled: int
    tokens: int = 0


def warm_up(model, input_ids, config=None, **generate_kwargs) -> WarmUp:
    """Untimed greedy generates before timed ones, so that their tokens/s exclude kernel compilation (numba on CPU and
    Triton on CUDA compile on first use) and first-call set-up: `warm_up_generates(config)`, each from
    `warm_up_ids(input_ids, prompt)` ([B, T] on the model's device), the model as it is (enabled with `config`, or
    stock for None). generate_kwargs: e.g. pad_token_id. The kernels' types depend on neither the batch nor padding,
    so the timed generates compile nothing more (`tests/test_warmup.py`)."""
    import torch

    from .warmup import CompileWatch

    start = time.perf_counter()
    runs = warm_up_generates(config, max_positions(model))
    with CompileWatch() as watch, torch.no_grad():
        for prompt, new in runs:
            ids = warm_up_ids(input_ids, prompt)
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, **generate_kwargs)
    return WarmUp(time.perf_counter() - start, watch.seconds, watch.count, sum(new for _, new in runs))


FOOTPRINT_KV_HEADS = {64: 3, 128: 8}  # SmolLM2's KV heads on d=64, Llama-3-8B's on d=128 (4 for other head_dims)
FOOTPRINT_LAYERS = {64: 30, 128: 32}  # ... and their layers (`layers=` for a model-shaped cache)


def owned_bits_over_decode(gear_config, head_dim: int, prompt: int, until: int, seed: int = 0,
                           layers: int = 1) -> dict:
    """What a bf16 cache of `layers` identical layers owns over a decode run: a `prompt`-token prompt, then one token
    per step to T=`until`, through `GearCache.store` + `compress_pending` (no attention read: the bytes do not depend
    on the values, so keys, values and queries are random; without a read no kernel state is built). Returns
    {"mean_owned", "max_owned", "mean_held"} of memory_report()'s bits/element over T = prompt .. until-1, and
    "max_slack", the largest (owned - held) / held.

    layers: 1 charges the cache's per-token bookkeeping (the positions, 8 bytes a token, kept once for all layers)
    to one layer: +0.17 bit/element on SmolLM2's 3 heads of d=64, +0.03 on 8 heads of d=128, an upper bound; a
    model's own layer count (FOOTPRINT_LAYERS) spreads it as a generate does (each step costs `layers` times more)."""
    import torch
    from transformers import LlamaConfig

    from .cache import GearCache

    heads = FOOTPRINT_KV_HEADS.get(head_dim, 4)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=heads * head_dim * 3, num_attention_heads=heads * 3,
                         num_key_value_heads=heads, head_dim=head_dim)
    cache = GearCache(config, gear_config)
    g = torch.Generator().manual_seed(seed)

    def step(q: int) -> None:
        k, v = (torch.randn(1, heads, q, head_dim, generator=g).bfloat16() for _ in range(2))
        query = torch.randn(1, heads * 3, q, head_dim, generator=g).bfloat16()
        for layer in range(layers):  # (every layer the same tokens: the bytes do not depend on them)
            cache.store(layer, k, v, query=query)
            cache.compress_pending(layer)

    owned, held, slack = [], [], []
    with torch.no_grad():
        step(prompt)
        for _ in range(prompt, until):
            report = cache.memory_report()
            owned.append(report["bits_per_element"])
            held.append(report["held_bits_per_element"])
            slack.append((report["owned_bytes"] - report["held_bytes"]) / report["held_bytes"])
            step(1)
    return {"mean_owned": sum(owned) / len(owned), "max_owned": max(owned), "mean_held": sum(held) / len(held),
            "max_slack": max(slack)}


BUDGET_LENGTHS = (512, 1024, 4096)  # prompt lengths a recommendation's bits hold at
BUDGET_STEPS = 128  # decode steps averaged after each prompt
BUDGET_HEAD_DIMS = (64, 128)


def owned_bits_budget(gear_config) -> dict:
    """What `GearConfig.recommended`'s bits promise: the mean bits/element owned over the BUDGET_STEPS decode steps
    after a prompt of each BUDGET_LENGTHS tokens, on each BUDGET_HEAD_DIMS (bf16): {(head_dim, T): mean} and
    "budget", the largest."""
    means = {(d, t): owned_bits_over_decode(gear_config, d, t, t + BUDGET_STEPS)["mean_owned"]
             for d in BUDGET_HEAD_DIMS for t in BUDGET_LENGTHS}
    return {**means, "budget": max(means.values())}
