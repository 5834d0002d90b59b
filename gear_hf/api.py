"""`enable` / `disable`: patch a model instance so that plain `generate()` uses a GEAR cache.

Patching is per instance and fully reversible: each attention module's forward (or accelerate's
`_old_forward`) is swapped for the shared forward, a pre-hook on the base model hands the 2D padding mask
to the cache, and `generate` is wrapped to create a `GearCache` when the caller passes no cache.

A `generate` call that will not use GEAR (`cache_implementation="static"`, `use_cache=False`, a caller's own
non-GEAR cache) says so once per reason and model, and `last_cache()` is then None. `generate(
cache_implementation="gear", cache_config={...})` asks for GEAR the way transformers' quantized cache is asked
for. The wrapper is a method bound to the model, so `copy.deepcopy(model)` generates with the copy.
"""

from __future__ import annotations

import contextlib
import copy
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import AttentionPatch, gear_attention_forward
from .cache import GearCache
from .config import SETTING_NAMES, GearConfig, expect_config
from .config.advanced import ADVANCED_NAMES
from .hf_compat import cache_kwarg, install_cache_implementation_hint, passed_cache
from .step_ref import StepRef

# RoPE variants whose frequencies do not change with the sequence: keys can be rotated when read.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GEAR_CACHE_IMPLEMENTATION = "gear"  # generate(cache_implementation="gear", cache_config={...})
install_cache_implementation_hint()  # that name on a model not enabled: transformers' error says to enable it


@dataclass
class _GearState:
    config: GearConfig
    rotaries: list  # the rotary module of each patched layer (checked against config.pre_rope on every enable)
    modules: list = field(default_factory=list)  # patched attention modules
    hook: object = None
    generate_wrapped: bool = False
    original_generate: object = None  # an instance-level generate we replaced (None: the class's)
    cache_kwarg: str = "cache"
    last_cache: object = None  # the GearCache the last generate used (None when it used none)
    warned: set = field(default_factory=set)  # reasons already warned about (once per model)
    generating: int = 0  # GEAR generate calls in progress (assistant_early_exit drafts inside its own verifier's)


def _check_rope(rotary: torch.nn.Module, config: GearConfig) -> None:
    rope_type = getattr(rotary, "rope_type", "default")
    if config.pre_rope and rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} changes its frequencies with the sequence length, so keys cannot be "
            f"rotated when read; supported with pre_rope=True: {', '.join(STATIC_ROPE_TYPES)} "
            "(or use GearConfig(pre_rope=False))")


def _check_backend(model, config: GearConfig) -> None:
    """A forced backend that cannot serve this model's format here fails now, not inside the first generate."""
    from .backends import resolve
    from .cache.gear_cache import _model_properties

    properties = _model_properties(model)
    if properties is not None:
        resolve(config, *properties)


def _check_config(model, rotaries: list, config: GearConfig) -> None:
    expect_config(config, "config")
    for rotary in rotaries:
        _check_rope(rotary, config)
    _check_backend(model, config)


def _expected_length(model, args, kwargs) -> int | None:
    """Prompt length + min_new_tokens: a length every row is known to reach (None when unknown). max_new_tokens is
    not: generation may stop at an end-of-sequence token, and room reserved for it would be owned for nothing."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(inputs, torch.Tensor) or inputs.ndim != 2:
        return None
    gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("min_new_tokens", getattr(gen_config, "min_new_tokens", None))
    return inputs.shape[1] + new if new else None


def _config_from_cache_config(cache_config: Any, base: GearConfig) -> GearConfig:
    """`generate(cache_implementation="gear", cache_config=...)`: a GearConfig, or a dict of GearConfig settings and
    advanced options plus `preset` (alias `method`, e.g. "gear" or "gear-2"), `recommended` (a name) and `bits`;
    naming neither, the enabled config with those fields changed."""
    if cache_config is None:
        return base
    if isinstance(cache_config, GearConfig):
        return cache_config
    if not isinstance(cache_config, dict):
        raise TypeError(f"cache_config={cache_config!r}: give a dict of GearConfig fields (plus preset, bits) "
                        "or a GearConfig")
    fields = dict(cache_config)
    allowed = {"preset", "method", "bits", "recommended", *SETTING_NAMES, *ADVANCED_NAMES}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"cache_config key(s) {unknown} are not GEAR settings; allowed: {sorted(allowed)}")
    preset, method = fields.pop("preset", None), fields.pop("method", None)
    if preset is not None and method is not None and preset != method:
        raise ValueError(f"cache_config: preset={preset!r} and method={method!r} disagree; give one")
    bits = fields.pop("bits", None)
    name = preset if preset is not None else method
    recommended = fields.pop("recommended", None)
    if recommended is not None:
        if name is not None:
            raise ValueError(f"cache_config: recommended={recommended!r} names a whole configuration; give it or "
                             f"preset={name!r}, not both")
        if bits is not None:
            fields.update(key_bits=bits, value_bits=bits)
        return GearConfig.recommended(name=recommended, **fields)
    if name is not None:
        return GearConfig.preset(name, bits=bits, **fields)
    if bits is not None:
        fields.update(key_bits=bits, value_bits=bits)
    return base.replace(**fields)


def _not_gear_reason(kwargs: dict, gen_config) -> tuple[str, str] | None:
    """(reason key, message) when this generate call will run without a GEAR cache, else None."""
    cache = passed_cache(kwargs)
    if cache is not None and not isinstance(cache, GearCache):
        kind = type(cache).__name__
        return f"cache:{kind}", (f"a {kind} was passed to generate, so it runs with that cache, not GEAR; pass no "
                                 "cache (or a gear_hf.GearCache) to keep GEAR")
    impl = kwargs.get("cache_implementation", getattr(gen_config, "cache_implementation", None))
    if impl is not None and impl != GEAR_CACHE_IMPLEMENTATION:
        return f"impl:{impl}", (f"cache_implementation={impl!r} makes generate build transformers' own cache, not "
                                "GEAR; leave cache_implementation unset (or use cache_implementation='gear', "
                                "cache_config={...}) to keep GEAR")
    if kwargs.get("use_cache", getattr(gen_config, "use_cache", True)) is False:
        return "use_cache", ("use_cache=False: generate keeps no cache at all, so GEAR is not used (every step "
                             "recomputes the whole sequence); drop use_cache=False to keep GEAR")
    return None


def _gear_generate(model, *args, **kwargs):
    """`generate` of a gear_hf-enabled model: a GearCache unless the call asks for something else (then a
    warning, once per reason). Bound to the model, so a deep copy generates with the copy."""
    state: _GearState = model._gear_hf_state
    original = state.original_generate or types.MethodType(type(model).generate, model)
    gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if _speculation(model, kwargs) == "draft":
        # a draft's cache is cropped back over several of its own steps, which compressed chunks cannot undo
        if state.generating:  # assistant_early_exit: the model drafts for itself, inside its own GEAR generate
            key, message = "early_exit", ("assistant_early_exit: this model's draft (its first layers) keeps "
                                          "transformers' own cache, uncompressed; the verifying cache stays GEAR")
        else:
            state.last_cache = None
            key, message = "draft", ("this model drafts for another (assistant_model=): its draft cache is "
                                     "transformers' own, uncompressed; the verifying model's cache stays GEAR")
        if key not in state.warned:
            state.warned.add(key)
            warnings.warn(f"gear_hf: {message}", UserWarning, stacklevel=2)
        return original(*args, **kwargs)
    reason = _not_gear_reason(kwargs, gen_config)
    if reason is not None:
        state.last_cache = None
        key, message = reason
        if key not in state.warned:
            state.warned.add(key)
            warnings.warn(f"gear_hf: {message}", UserWarning, stacklevel=2)
        return original(*args, **kwargs)
    config, model_gen_config = state.config, getattr(model, "generation_config", None)
    if kwargs.get("cache_implementation", getattr(gen_config, "cache_implementation", None)) is not None:
        # cache_implementation="gear": transformers knows no such name, so it must never see it
        cache_config = kwargs.pop("cache_config", getattr(gen_config, "cache_config", None))
        kwargs.pop("cache_implementation", None)
        if kwargs.get("generation_config") is not None and gen_config.cache_implementation is not None:
            kwargs["generation_config"] = gen_config = copy.deepcopy(gen_config)
            gen_config.cache_implementation = gen_config.cache_config = None
        config = _config_from_cache_config(cache_config, state.config)
        _check_config(model, state.rotaries, config)
    if getattr(model_gen_config, "cache_implementation", None) == GEAR_CACHE_IMPLEMENTATION:
        # set on the model's own generation config, which transformers merges into every call: hide it for the call
        saved = model_gen_config.cache_implementation, model_gen_config.cache_config
        model_gen_config.cache_implementation = model_gen_config.cache_config = None
        try:
            return _generate_with(model, state, original, config, args, kwargs)
        finally:
            model_gen_config.cache_implementation, model_gen_config.cache_config = saved
    return _generate_with(model, state, original, config, args, kwargs)


def _check_prompt(args, kwargs) -> None:
    """An empty prompt fails deep in the attention (stock transformers too: "cannot reshape tensor of 0 elements");
    say what is wrong where the call is made."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and inputs.shape[1] == 0 \
            and kwargs.get("inputs_embeds") is None:
        raise ValueError(f"gear_hf: generate got an empty prompt (input_ids of shape {list(inputs.shape)}: 0 tokens "
                         "per row); give at least one token per row (e.g. the tokenizer's BOS token)")


# generate arguments (or generation-config fields) that make it verify drafted tokens and crop the rejected ones
_SPECULATIVE_ARGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _speculation(model, kwargs) -> str | None:
    """"verifier": this call checks drafted tokens (its cache must be croppable); "draft": transformers runs this
    model as another's assistant; else None."""
    gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if getattr(gen_config, "is_assistant", False):
        return "draft"
    if any(kwargs.get(name) is not None or getattr(gen_config, name, None) is not None for name in _SPECULATIVE_ARGS):
        return "verifier"
    return None


def _generate_with(model, state: _GearState, original, config: GearConfig, args, kwargs):
    _check_prompt(args, kwargs)
    cache = passed_cache(kwargs)
    if cache is None:
        cache = GearCache(model, config, expected_length=_expected_length(model, args, kwargs),
                          speculative=_speculation(model, kwargs) == "verifier")
        kwargs[state.cache_kwarg] = cache
    state.last_cache = cache
    state.generating += 1
    try:
        return original(*args, **kwargs)
    finally:
        state.generating -= 1


def _wrap_generate(model, state: _GearState) -> None:
    state.original_generate = model.__dict__.get("generate")  # e.g. another library's wrapper
    model.generate = types.MethodType(_gear_generate, model)
    state.generate_wrapped = True


def _mask_hook(module, args, kwargs):
    cache = passed_cache(kwargs)
    if isinstance(cache, GearCache):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        cache.observe_attention_mask(mask)


def enable(model: torch.nn.Module, config: GearConfig | None = None) -> torch.nn.Module:
    """Make `model` keep its KV cache GEAR-compressed; in place, returns the model.

    Calling it again with another config reconfigures (new caches use the new config); the config is checked
    against the model (RoPE type, backend) each time. Every layer is patched or none: a model whose attention
    modules do not all look as expected is refused (a stock layer handed a GearCache could not cache).
    """
    from gear_hf.patches import spec_for  # the registry imports transformers-free specs only

    config = GearConfig() if config is None else config
    state = getattr(model, "_gear_hf_state", None)
    if state is not None:
        _check_config(model, state.rotaries, config)
        state.config = config
        return model

    spec = spec_for(model)
    modules = spec.attention_modules(model)
    expected = model.config.get_text_config(decoder=True).num_hidden_layers
    usable = [m for m in modules if spec.is_patchable(m)]
    rotaries = [spec.rotary_for(model, m) for m in usable]  # per layer: Gemma 3 has local and global RoPE
    _check_config(model, rotaries, config)
    if not usable:
        raise NotImplementedError(f"{type(model).__name__}: found no {spec.attention_class} module to patch")
    if len(usable) != expected:
        raise RuntimeError(f"{type(model).__name__}: found {len(usable)} patchable {spec.attention_class} modules "
                           f"for {expected} layers; gear_hf patches every layer or none (a layer left stock could "
                           "not keep its tokens in a GearCache)")

    state = _GearState(config=config, rotaries=rotaries)
    for module, rotary in zip(usable, rotaries):
        attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
        original = getattr(module, attr)
        module._gear_hf_patch = AttentionPatch(
            original_forward=original,
            cache_kwarg=cache_kwarg(original),
            rotary_emb=rotary,
            attention_kwargs=spec.attention_kwargs,
            project=spec.project,
            replaced_attr=attr,
            step_ref=StepRef(module),
        )
        module._gear_hf_had_instance_attr = attr in module.__dict__
        setattr(module, attr, types.MethodType(gear_attention_forward, module))
        state.modules.append(module)
    state.cache_kwarg = cache_kwarg(model.forward)
    state.hook = spec.base_model(model).register_forward_pre_hook(_mask_hook, with_kwargs=True)
    if hasattr(model, "generate"):
        _wrap_generate(model, state)
    model._gear_hf_state = state
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `enable` exactly: original forwards, no hook, the previous generate. Warns (and changes nothing) on a
    model that was not enabled."""
    state = getattr(model, "_gear_hf_state", None)
    if state is None:
        warnings.warn(f"gear_hf.disable: this {type(model).__name__} was not enabled (gear_hf.enable), so there was "
                      "nothing to undo", stacklevel=2)
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
        if state.original_generate is not None:
            model.generate = state.original_generate
        else:
            del model.generate
    del model._gear_hf_state
    return model


@contextlib.contextmanager
def enabled(model: torch.nn.Module, config: GearConfig | None = None):
    """`with gear_hf.enabled(model, cfg): ...` — enabled inside, restored to its previous state after."""
    previous = getattr(model, "_gear_hf_state", None)
    previous_config = previous.config if previous is not None else None
    enable(model, config)
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
    """The GearCache the last `generate()` call on this enabled model used, or None (not enabled, no call yet,
    or the last call ran without GEAR: another cache_implementation, use_cache=False, a non-GEAR cache)."""
    state = getattr(model, "_gear_hf_state", None)
    return state.last_cache if state is not None else None
