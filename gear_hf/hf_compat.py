"""Spellings that differ across the supported transformers versions (imports nothing from transformers).

The cache argument of forwards: transformers 5.24 attention/decoder forwards take `cache=`, up to 5.22
`past_key_values=`, older attention forwards `past_key_value=`. A replacement forward bypasses HF's
deprecation wrapper, so gear_hf accepts every spelling and hands the original forward the one it takes.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # 5.24 / <=5.22 / older spellings


def cache_kwarg(fn: Callable) -> str:
    """The cache argument name `fn` (a forward, or a bound `model.forward`) takes."""
    params = inspect.signature(fn).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    raise NotImplementedError(f"{getattr(fn, '__qualname__', fn)} takes none of {CACHE_KWARGS}; "
                              "this transformers version is not supported")


def model_cache_kwarg(model) -> str:
    """The cache argument name of `model.forward` (what to pass a cache as: `model(ids, **{name: cache})`)."""
    return cache_kwarg(model.forward)


def passed_cache(kwargs: dict[str, Any]) -> Any:
    """The cache given in `kwargs` under any spelling, or None."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """Remove every spelling of the cache argument from `kwargs`; return the cache given (or None)."""
    found = None
    for name in CACHE_KWARGS:
        value = kwargs.pop(name, None)
        found = value if found is None else found
    return found


GEAR_HINT = ("gear_hf: cache_implementation='gear' works on a model that gear_hf.enable(model) has patched (this "
             "one is not: call gear_hf.enable(model) first, or pass cache=gear_hf.GearCache(model))")


def install_cache_implementation_hint() -> None:
    """Add GEAR_HINT to transformers' error for cache_implementation="gear" on a model gear_hf has not enabled.

    transformers has no registry of cache_implementation names: `GenerationConfig.validate` (5.17 and 5.24) checks
    a fixed tuple and raises "Invalid `cache_implementation` (gear). Choose one of: ...". An enabled model's generate
    takes "gear" away before transformers sees it; on any other model the only hook is that method, so it is
    wrapped once, at class level, to re-raise that one error with the hint (every other outcome unchanged)."""
    from transformers import GenerationConfig

    validate = GenerationConfig.validate
    if getattr(validate, "_gear_hf_hint", False):
        return

    def validate_with_hint(self, *args, **kwargs):
        try:
            return validate(self, *args, **kwargs)
        except ValueError as err:
            if getattr(self, "cache_implementation", None) == "gear" and GEAR_HINT not in str(err):
                raise ValueError(f"{err}. {GEAR_HINT}") from err
            raise

    validate_with_hint._gear_hf_hint = True
    validate_with_hint.__wrapped__ = validate
    validate_with_hint.__doc__ = validate.__doc__
    GenerationConfig.validate = validate_with_hint
