"""Methods by name and one timed greedy `generate` with each: ``dynamic`` (transformers' DynamicCache),
``hf-quanto-int2/4`` and ``hf-hqq-int2/4`` (transformers' QuantizedCache; skipped with a line when the backend is
not installed), gear_hf presets ``fp16``, ``kivi-2``, ``gear-4``, ... (`GearConfig.preset` names) and the frontier's
picks ``rec-balanced`` (= GearConfig()), ``rec-smallest``, ``rec-precise`` (``rec-`` + a `GearConfig.recommended` name)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gear_hf.hf_compat import model_cache_kwarg
from gear_hf.measure import StepClock
from gear_hf.warmup import CompileWatch

from .memory import PeakRSS

GEAR_PRESETS = ("fp16", "kivi-2", "kcvt-2", "outlier-2", "gear-l-2", "gear-2",
                "kivi-4", "kcvt-4", "outlier-4", "gear-l-4", "gear-4")
HF_METHODS = ("hf-quanto-int2", "hf-quanto-int4", "hf-hqq-int2", "hf-hqq-int4")


RECOMMENDED_PREFIX = "rec-"


def gear_config(name: str):
    """GearConfig of a preset name ('gear-2', 'kivi-4', 'fp16', ...) or of 'rec-' + a recommended name
    ('rec-balanced' = GearConfig()); a bad name exits with the reason."""
    from gear_hf import GearConfig

    try:
        if name.startswith(RECOMMENDED_PREFIX):
            return GearConfig.recommended(name=name[len(RECOMMENDED_PREFIX):])
        return GearConfig.preset(name)
    except ValueError as err:
        raise SystemExit(f"--methods: {err}") from err


def method_bits(name: str) -> int | None:
    if name in ("dynamic", "fp16") or name.startswith(RECOMMENDED_PREFIX):  # (recommended: key and value bits differ)
        return None
    return int(name.rsplit("-", 1)[1].replace("int", ""))


def check_method(name: str) -> str:
    if name == "dynamic" or name in HF_METHODS:
        return name
    gear_config(name)  # raises SystemExit on a bad name
    return name


def select_methods(listed: str | None, default) -> tuple[list[str], list[str]]:
    """(methods to run, HF methods skipped because their backend is not installed) from a comma list or the
    default; unknown names raise."""
    methods = [check_method(m.strip()) for m in listed.split(",") if m.strip()] if listed else list(default)
    skipped = [m for m in methods if m in HF_METHODS and not hf_backend_available(m.split("-")[1])]
    return [m for m in methods if m not in skipped], skipped


def hf_backend_available(backend: str) -> bool:
    import importlib.util

    module = {"quanto": "optimum.quanto", "hqq": "hqq"}[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def make_hf_quantized_cache(model, name: str, residual_length: int = 128, group_size: int = 64):
    """transformers' QuantizedCache for 'hf-quanto-int2' etc. (its defaults: per-token axes, post-RoPE)."""
    from transformers import QuantizedCache

    _, backend, bits = name.split("-")
    return QuantizedCache(backend=backend, config=model.config, nbits=int(bits.replace("int", "")),
                          q_group_size=group_size, residual_length=residual_length)


def is_gear(method: str) -> bool:
    return method != "dynamic" and method not in HF_METHODS


def warm_up(model, input_ids: torch.Tensor, method: str):
    """Untimed generates with `method` before the timed ones, so that their tokens/s exclude kernel compilation
    (numba / Triton compile on first use) and first-call set-up: `gear_hf.measure.warm_up_generates`' lengths, from
    row 0's tokens. Returns a `gear_hf.measure.WarmUp` (their seconds, and of them numba's compiling)."""
    from gear_hf.measure import WarmUp, max_positions, warm_up_generates, warm_up_ids

    start, compile_seconds, compiled = time.perf_counter(), 0.0, 0
    runs = warm_up_generates(gear_config(method) if is_gear(method) else None, max_positions(model))
    for prompt, new in runs:
        result = run_generate(model, warm_up_ids(input_ids, prompt), method, new)
        compile_seconds, compiled = compile_seconds + result.compile_seconds, compiled + result.kernels_compiled
    return WarmUp(time.perf_counter() - start, compile_seconds, compiled, sum(new for _, new in runs))


@dataclass
class GenerateResult:
    tokens: torch.Tensor  # [B, new]
    decode_steps: int
    decode_seconds: float
    prefill_seconds: float
    peak_rss: int
    rss_before: int
    cache: object
    step_seconds: list = field(default_factory=list)
    compile_seconds: float = 0.0  # numba compiling kernels during this generate (0 after a warm-up)
    kernels_compiled: int = 0


@torch.no_grad()
def run_generate(model, input_ids: torch.Tensor, method: str, max_new_tokens: int, *, force_length: bool = True,
                 tokenizer=None, stop_strings=None, attention_mask=None, hf_residual: int = 128) -> GenerateResult:
    """One greedy `generate` with `method`'s cache; decode timing from the step clock."""
    from transformers import LogitsProcessorList

    import gear_hf

    kwargs: dict = {}
    if method in HF_METHODS:
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        kwargs[model_cache_kwarg(model)] = make_hf_quantized_cache(model, method, residual_length=hf_residual)
    elif method == "dynamic":
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
    else:
        gear_hf.enable(model, gear_config(method))
    if force_length:
        kwargs["min_new_tokens"] = max_new_tokens
    if stop_strings:
        kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    clock = StepClock()
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    start = time.perf_counter()
    with PeakRSS() as rss, CompileWatch() as watch:
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]),
                             **kwargs)
    steps, seconds = clock.decode()
    prefill = (clock.times[0] - start) if clock.times else float("nan")
    cache = kwargs.get(model_cache_kwarg(model))
    if cache is None and gear_hf.is_enabled(model):
        cache = gear_hf.last_cache(model)
    return GenerateResult(out[:, input_ids.shape[1]:], steps, seconds, prefill, rss.peak, rss.before, cache,
                          clock.step_seconds(), watch.seconds, watch.count)
