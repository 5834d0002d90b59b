"""`--model_args` of the `gear_hf` lm-eval model: split the GEAR keys from the Hugging Face ones, convert and
validate them, and reject unknown keys with a message naming the key and what is allowed.

GEAR keys: `preset` (alias `method`), `recommended` (a `GearConfig.recommended` name), `bits` (sets key_bits and
value_bits) and every `GearConfig` field.
A GearConfig field whose name HFLM also uses is spelled `gear_<field>`: `gear_backend=torch|triton|numba|auto`
(`backend=` stays lm-eval's causal/seq2seq switch).
lm-eval's CLI has already turned "2" into 2 and "false" into False; the Python API may pass strings.
Both are accepted; anything else is an error naming the key, the value and the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any

from gear_hf.config import BITS, GearConfig
from gear_hf.config.advanced import Advanced

# every setting and advanced option by name (a model_args key each)
_GEAR_FIELDS = {f.name: f for f in (*dataclasses.fields(GearConfig), *dataclasses.fields(Advanced))
                if f.name != "advanced"}
# GEAR keys that are not GearConfig fields.
_GEAR_EXTRA = {"preset": "str", "recommended": "str", "bits": "int"}

# Keyword arguments that HFLM does not name but forwards to `from_pretrained` (its **kwargs), allowed here.
FROM_PRETRAINED_KEYS = frozenset({
    "attn_implementation", "device_map", "low_cpu_mem_usage", "load_in_8bit", "load_in_4bit",
    "bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "use_safetensors",
    "variant", "cache_dir", "local_files_only", "token", "offload_state_dict", "offload_buffers",
    "use_kernels", "key_mapping",
})
# Keys that lm-eval itself adds to every model's arguments (from --batch_size, --device, ...).
_LM_EVAL_ADDED = frozenset({"batch_size", "max_batch_size", "device"})


class ModelArgsError(ValueError):
    """A bad `--model_args` entry of the gear_hf model."""


# Not a GearConfig key: whether the model runs an untimed warm-up generate before timing (model.py).
WARMUP_KEY = "gear_warmup"


def convert_flag(key: str, value: Any) -> bool:
    """true/false from the CLI (already a bool) or the Python API ("false", 0, ...); else a ModelArgsError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise _bad(key, value, "true or false")


def _hflm_params() -> set[str]:
    from lm_eval.models.huggingface import HFLM

    params = inspect.signature(HFLM.__init__).parameters
    return {n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _gear_key_map() -> dict[str, str]:
    """model_args key -> GearConfig field (or "preset"/"bits"); colliding fields get a `gear_` prefix."""
    hf = _hflm_params()
    keys = {name: name for name in _GEAR_EXTRA}
    for name in _GEAR_FIELDS:
        keys[f"gear_{name}" if name in hf else name] = name
    return keys


def gear_keys() -> list[str]:
    return list(_gear_key_map())


def hf_keys() -> list[str]:
    return sorted(_hflm_params() | FROM_PRETRAINED_KEYS | _LM_EVAL_ADDED)


def other_keys() -> list[str]:
    """Keys that are neither GEAR config keys nor HFLM's: gear_warmup."""
    return [WARMUP_KEY]


def _type_name(key: str) -> str:
    if key in _GEAR_EXTRA:
        return _GEAR_EXTRA[key]
    t = _GEAR_FIELDS[key].type
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _bad(key: str, value: Any, allowed: str) -> ModelArgsError:
    return ModelArgsError(f"gear_hf --model_args: {key}={value!r} is invalid; allowed: {allowed}")


def _convert(key: str, value: Any) -> Any:
    kind = _type_name(key)
    if kind == "int | None":  # key_group_size, prompt_group_size: "None" (as the CLI may leave it) or an integer
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        kind = "int"
    if kind == "bool":
        return convert_flag(key, value)
    if kind == "int":
        if isinstance(value, bool):
            raise _bad(key, value, "an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _bad(key, value, "an integer")
    if kind == "int | float":  # key_bits: a whole number, or a mean such as 3.5 (allocated key widths)
        number = _number(key, value)
        return int(number) if number.is_integer() else number
    if kind == "float":
        return _number(key, value)
    if kind == "str":
        if isinstance(value, str):
            return value.strip()
        if isinstance(value, int) and not isinstance(value, bool):  # lm-eval's CLI turns "8" into 8: as written
            return str(value)
        raise _bad(key, value, "a string")
    return value


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _bad(key, value, "a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise _bad(key, value, "a number")


def _unknown(key: str) -> ModelArgsError:
    known = gear_keys() + other_keys() + hf_keys()
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ModelArgsError(
        f"gear_hf --model_args: unknown key {key!r}{hint}. GEAR keys: {', '.join(gear_keys() + other_keys())}. "
        f"Model keys (lm-eval hf): {', '.join(hf_keys())}.")


def parse_gear_args(args: dict[str, Any]) -> GearConfig:
    """GearConfig from the GEAR keys of `args` (all other keys are ignored here)."""
    keys = _gear_key_map()
    gear = {}
    for key, value in args.items():
        if key in keys:
            field = keys[key]
            try:
                gear[field] = _convert(field, value)
            except ModelArgsError as e:
                raise ModelArgsError(str(e).replace(f" {field}=", f" {key}=", 1)) from None
    preset = gear.pop("preset", None)
    method = gear.pop("method", None)
    recommended = gear.pop("recommended", None)
    if preset is not None and method is not None and preset != method:
        raise ModelArgsError(f"gear_hf --model_args: preset={preset!r} and method={method!r} disagree; give one")
    if recommended is not None and (preset is not None or method is not None):
        raise ModelArgsError(f"gear_hf --model_args: recommended={recommended!r} names a whole configuration; give it "
                             f"or preset/method, not both (fields such as buffer_size= may be added to either)")
    name = preset if preset is not None else method if method is not None else GearConfig.method
    name_key = "preset" if preset is not None else "method"
    bits = gear.pop("bits", None)
    if bits is not None and ("key_bits" in gear or "value_bits" in gear):
        raise ModelArgsError("gear_hf --model_args: give bits, or key_bits/value_bits, not both")
    if bits is not None and bits not in BITS:  # bits sets value_bits too, so a mean such as 3.5 is no bits= value
        raise _bad("bits", bits, f"{', '.join(map(str, BITS))} (sets key_bits and value_bits)")
    try:
        both_bits = {"key_bits": bits, "value_bits": bits} if bits is not None else {}
        if recommended is not None:  # a frontier pick, fields changed
            return GearConfig.recommended(name=recommended, **gear, **both_bits)
        if preset is None and method is None:  # nothing named: the recommended default GearConfig(), fields changed
            return GearConfig(**gear, **both_bits)
        return GearConfig.preset(name, bits=bits, **gear)
    except ValueError as e:
        message = str(e)
        message = message.replace("GearConfig.preset name ", f"{name_key}=")  # e.g. preset='gear2' ... did you mean
        message = message.replace("GearConfig.recommended name=", "recommended=")
        for key, field in keys.items():
            if key != field:
                message = message.replace(f"GearConfig.{field}=", f"{key}=")
        raise ModelArgsError(f"gear_hf --model_args: {message}") from None


def config_name(args: dict[str, Any]) -> str | None:
    """How the GEAR keys of `args` named the configuration, for the results: "recommended=smallest" or "default"
    (no preset, method or recommended: GearConfig(), the recommended "accurate"; fields may be changed); None for
    a preset or method, which `GearConfig.describe()` names ("gear-2")."""
    keys = _gear_key_map()
    named = {keys[k]: v for k, v in args.items() if k in keys}
    if "recommended" in named:
        return f"recommended={str(named['recommended']).strip()}"
    if "preset" in named or "method" in named:
        return None
    return "default"


def split_model_args(args: dict[str, Any], *, strict: bool = True) -> tuple[GearConfig, dict[str, Any]]:
    """(GearConfig, the remaining HFLM keyword arguments). Unknown keys raise ModelArgsError when strict."""
    config = parse_gear_args(args)
    keys = _gear_key_map()
    rest = {k: v for k, v in args.items() if k not in keys and k not in other_keys()}
    for key, value in rest.items():  # e.g. backend=triton meant for GEAR, not HFLM's causal/seq2seq switch
        prefixed = f"gear_{key}"
        if prefixed in keys and isinstance(value, str):
            try:
                GearConfig(**{key: value})
            except (ValueError, TypeError):
                continue
            raise ModelArgsError(f"gear_hf --model_args: {key}={value!r} is a GEAR value: write {prefixed}={value} "
                                 f"({key}= is lm-eval's own {key} argument)")
    if strict:
        allowed = set(hf_keys())
        for key in rest:
            if key not in allowed:
                raise _unknown(key)
    # Paths and names stay strings (lm-eval's CLI turns "pretrained=123" into an int).
    for key in ("pretrained", "tokenizer", "gguf_file", "revision", "peft", "delta", "subfolder"):
        if key in rest and isinstance(rest[key], (int, float)) and not isinstance(rest[key], bool):
            rest[key] = str(rest[key])
    return config, rest
