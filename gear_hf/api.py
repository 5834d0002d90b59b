"""`enable` / `disable`: patch a model instance so that plain `generate()` uses a GEAR cache.

Patching is per instance and fully reversible: each attention module's forward (or accelerate's
`_old_forward`) is swapped for the shared forward, a pre-hook on the base model hands the 2D padding mask
to the cache, and `generate` is wrapped to create a `GearCache` when the caller passes no cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from dataclasses import dataclass, field

import torch

from .attention import CACHE_KWARGS, AttentionPatch, gear_attention_forward
from .cache import GearCache
from .config import GearConfig

# RoPE variants whose frequencies do not change with the sequence: keys can be rotated when read.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class _GearState:
    config: GearConfig
    modules: list = field(default_factory=list)  # patched attention modules
    hook: object = None
    generate_wrapped: bool = False
    cache_kwarg: str = "cache"
    last_cache: object = None  # the GearCache generate created last (kept until the next call / disable)


def _cache_kwarg(fn) -> str:
    params = inspect.signature(fn).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    raise NotImplementedError(f"{getattr(fn, '__qualname__', fn)} takes none of {CACHE_KWARGS}; "
                              "this transformers version is not supported")


def _check_rope(rotary: torch.nn.Module, config: GearConfig) -> None:
    rope_type = getattr(rotary, "rope_type", "default")
    if config.pre_rope and rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} changes its frequencies with the sequence length, so keys cannot be "
            f"rotated when read; supported with pre_rope=True: {', '.join(STATIC_ROPE_TYPES)} "
            "(or use GearConfig(pre_rope=False))")


def _expected_length(model, args, kwargs) -> int | None:
    """Prompt length + new tokens, a sizing hint for the cache (None when unknown)."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(inputs, torch.Tensor) or inputs.ndim != 2:
        return None
    gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(gen_config, "max_new_tokens", None))
    if new is None:
        max_length = kwargs.get("max_length", getattr(gen_config, "max_length", None))
        return max_length
    return inputs.shape[1] + new


def _wrap_generate(model, state: _GearState) -> None:
    original = model.generate  # bound method of the class

    @functools.wraps(original)
    def generate(*args, **kwargs):
        gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        has_cache = any(kwargs.get(name) is not None for name in CACHE_KWARGS)
        wants_other = getattr(gen_config, "cache_implementation", None) or kwargs.get("cache_implementation")
        use_cache = kwargs.get("use_cache", getattr(gen_config, "use_cache", True))
        if not has_cache and not wants_other and use_cache is not False:
            cache = GearCache(model, state.config, expected_length=_expected_length(model, args, kwargs))
            kwargs[state.cache_kwarg] = cache
            state.last_cache = cache
        return original(*args, **kwargs)

    model.generate = generate
    state.generate_wrapped = True


def _mask_hook(module, args, kwargs):
    cache = next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)
    if isinstance(cache, GearCache):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        cache.observe_attention_mask(mask)


def enable(model: torch.nn.Module, config: GearConfig | None = None, *, strict: bool = True) -> torch.nn.Module:
    """Make `model` keep its KV cache GEAR-compressed; in place, returns the model.

    Calling it again with another config reconfigures (new caches use the new config).
    strict: refuse (raise) when the model does not look exactly as expected — fewer attention modules than
    layers, or an attention module without the projections the shared forward uses; with strict=False
    those modules are left stock with a warning.
    """
    from gear_hf.patches import spec_for  # the registry imports transformers-free specs only

    config = GearConfig() if config is None else config
    if not isinstance(config, GearConfig):
        raise TypeError(f"config must be a gear_hf.GearConfig, got {type(config).__name__}")
    state = getattr(model, "_gear_hf_state", None)
    if state is not None:
        state.config = config
        return model

    spec = spec_for(model)
    modules = spec.attention_modules(model)
    expected = model.config.get_text_config(decoder=True).num_hidden_layers
    usable = [m for m in modules if spec.is_patchable(m)]
    rotaries = [spec.rotary_for(model, m) for m in usable]  # per layer: Gemma 3 has local and global RoPE
    for rotary in rotaries:
        _check_rope(rotary, config)
    if not usable:
        raise NotImplementedError(f"{type(model).__name__}: found no {spec.attention_class} module to patch")
    if len(usable) != expected:
        message = (f"{type(model).__name__}: found {len(usable)} patchable {spec.attention_class} modules for "
                   f"{expected} layers")
        if strict:
            raise RuntimeError(message + " (pass strict=False to patch only those)")
        warnings.warn(message + "; the others keep a stock cache path", stacklevel=2)

    state = _GearState(config=config)
    for module, rotary in zip(usable, rotaries):
        attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
        original = getattr(module, attr)
        module._gear_hf_patch = AttentionPatch(
            original_forward=original,
            cache_kwarg=_cache_kwarg(original),
            rotary_emb=rotary,
            attention_kwargs=spec.attention_kwargs,
            project=spec.project,
            replaced_attr=attr,
        )
        module._gear_hf_had_instance_attr = attr in module.__dict__
        setattr(module, attr, types.MethodType(gear_attention_forward, module))
        state.modules.append(module)
    state.cache_kwarg = _cache_kwarg(model.forward)
    state.hook = spec.base_model(model).register_forward_pre_hook(_mask_hook, with_kwargs=True)
    if hasattr(model, "generate"):
        _wrap_generate(model, state)
    model._gear_hf_state = state
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `enable` exactly: original forwards, no hook, the class's own generate. No-op if not enabled."""
    state = getattr(model, "_gear_hf_state", None)
    if state is None:
        return model
    for module in state.modules:
        patch: AttentionPatch = module._gear_hf_patch
        if module._gear_hf_had_instance_attr:
            setattr(module, patch.replaced_attr, patch.original_forward)
        else:
            delattr(module, patch.replaced_attr)
        del module._gear_hf_patch, module._gear_hf_had_instance_attr
    state.hook.remove()
    if state.generate_wrapped:
        del model.generate
    del model._gear_hf_state
    return model


@contextlib.contextmanager
def enabled(model: torch.nn.Module, config: GearConfig | None = None, *, strict: bool = True):
    """`with gear_hf.enabled(model, cfg): ...` — enabled inside, restored to its previous state after."""
    previous = getattr(model, "_gear_hf_state", None)
    previous_config = previous.config if previous is not None else None
    enable(model, config, strict=strict)
    try:
        yield model
    finally:
        if previous is None:
            disable(model)
        else:
            model._gear_hf_state.config = previous_config


def is_enabled(model: torch.nn.Module) -> bool:
    return getattr(model, "_gear_hf_state", None) is not None


def last_cache(model: torch.nn.Module) -> GearCache | None:
    """The GearCache that the last plain `generate()` call on this enabled model created, or None."""
    state = getattr(model, "_gear_hf_state", None)
    return state.last_cache if state is not None else None
