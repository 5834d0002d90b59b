"""`Advanced`: the research options behind `GearConfig`'s user fields, grouped in one documented object.

Its defaults are `GearConfig()`'s (the "balanced" recommendation); the paper presets use `PAPER_ADVANCED`. Every
option is validated here against the others and the user fields (`check`), naming the option, the value and what is
allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..compress.quant import BITS, PLANE_TOKENS, STATS, codes_per_unit
from ..compress.spec import FACTOR_BITS
from ..compress.terms import METHOD_TERMS, registered_terms

if TYPE_CHECKING:
    from .core import GearConfig

ROTATIONS = ("none", "keys", "values", "both")
AXES = ("channel", "token")
KEY_BIT_ALLOCATIONS = ("uniform", "query")
KEY_BUFFERS = ("full", "int8", "int8-rotated", "int4")
VALUE_BUFFERS = ("full", "final", "int8", "int8-rotated", "int4")
HOLDING_BUFFERS = ("int8", "int8-rotated", "int4")  # per-token buffers: tokens can stay in them a chunk longer
HOLDS = ("none", "values", "both")


@dataclass(frozen=True)
class Advanced:
    """Research options (beyond the paper's knobs). Defaults: what `GearConfig()` uses.

    Axes and groups
      key_axis / value_axis: "channel" (groups run along tokens) or "token" (groups run along channels); the paper
                   groups keys per channel and values per token (DESIGN §2)
      key_group_size / value_group_size: the key group (tokens) / value group (channels) when they differ from
                   group_size; None = group_size, capped at buffer_size for a stream grouped along tokens
      prompt_group_size: tokens per group in the prompt chunk for the streams grouped along tokens; None = their
                   decode group (the prompt is compressed once: longer groups there cost less side information)
    Backbone
      key_bit_allocation: "uniform" (every key channel key_bits wide) or "query" (each row's key channels get 1-8
                   bits, chosen from the queries seen so far times the key ranges, key_bits being the mean; stored
                   as bit planes). Needs key_axis="channel", no outliers, keys not rotated
      rotation:    "none" | "keys" | "values" | "both": an orthonormal Walsh–Hadamard rotation along head_dim before
                   compressing, undone at reconstruction
      range_search: "none" | "keys" | "values" | "both": each group's range chosen among clipped candidates for the
                   least squared error instead of its min/max (same stored format)
      value_statistics: "8" (an 8-bit scale on a 2^(1/8) grid and an 8-bit zero point per value group where values
                   are grouped per token with min/max ranges and a buffer other than "final"; 16-bit elsewhere) or
                   "16" (always 16-bit)
      pre_rope:    compress keys before rotary embedding and rotate them when read
    GEAR terms
      factor_bits: 8 (int8 low-rank factors with a 16-bit scale per column) or 16
      power_iters: power iterations of the low-rank fit
      extra_terms: registered terms beyond GEAR's (gear_hf.compress.terms.register_term), both streams
    The newest tokens (the buffer of buffer_size tokens)
      key_buffer:  "full" (the model's dtype, the paper), "int8-rotated" (8 bits a token after a Walsh–Hadamard
                   rotation along head_dim, 16-bit scale and minimum), "int8" (unrotated) or "int4"
      value_buffer: as key_buffer, or "final" (each value stored on arrival in its chunk's format: values grouped per
                   token with no low-rank term)
      hold:        "none", "values" or "both": which streams stay in their per-token buffer one decode chunk longer
                   (the newest buffer_size..2 x buffer_size tokens are read at 8/4 bits rather than at key_bits /
                   value_bits). Applies to a stream whose buffer is per token (int8, int8-rotated, int4); keys are
                   held only with their values
      held_for:    with both streams held, how long a held chunk stays held, in decode chunks (0, 1]: it is
                   compressed once ceil(held_for x buffer_size) newer tokens are buffered (values held alone: 1)
      key_buffer_centered / value_buffer_centered: a per-token buffer codes each token centered per channel (keys
                   also scaled by a power of two), fitted to the row's prompt, so a bias such as Qwen2's sets no
                   token's range. Ignored for a "full" buffer
      value_chunks_centered: the value chunks coded by the value buffer's centers too (no byte more). Ignored where
                   the value buffer is not centered
    """

    key_axis: str = "channel"
    value_axis: str = "token"
    key_group_size: int | None = None
    value_group_size: int | None = None
    prompt_group_size: int | None = 256
    key_bit_allocation: str = "query"
    rotation: str = "values"
    range_search: str = "none"
    value_statistics: str = "8"
    pre_rope: bool = True
    factor_bits: int = 8
    power_iters: int = 3
    extra_terms: tuple[str, ...] = ()
    key_buffer: str = "int8-rotated"
    value_buffer: str = "int4"
    hold: str = "both"
    held_for: float = 0.5
    key_buffer_centered: bool = True
    value_buffer_centered: bool = True
    value_chunks_centered: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.extra_terms, (list, str)):
            object.__setattr__(self, "extra_terms", (self.extra_terms,) if isinstance(self.extra_terms, str)
                               else tuple(self.extra_terms))
        if isinstance(self.value_statistics, int) and not isinstance(self.value_statistics, bool):
            object.__setattr__(self, "value_statistics", str(self.value_statistics))  # 8 is "8" (lm-eval ints)
        for name, allowed in (("key_axis", AXES), ("value_axis", AXES), ("key_bit_allocation", KEY_BIT_ALLOCATIONS),
                              ("rotation", ROTATIONS), ("range_search", ROTATIONS), ("value_statistics", STATS),
                              ("key_buffer", KEY_BUFFERS), ("value_buffer", VALUE_BUFFERS), ("hold", HOLDS)):
            if getattr(self, name) not in allowed:
                reject(name, getattr(self, name), " | ".join(map(repr if name == "value_statistics" else str, allowed)))
        for name in ("key_group_size", "value_group_size", "prompt_group_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                reject(name, value, "None or an integer >= 1")
        if isinstance(self.power_iters, bool) or not isinstance(self.power_iters, int) or self.power_iters < 1:
            reject("power_iters", self.power_iters, "an integer >= 1")
        if isinstance(self.factor_bits, bool) or self.factor_bits not in FACTOR_BITS:
            reject("factor_bits", self.factor_bits, "16 or 8")
        for name in ("pre_rope", "key_buffer_centered", "value_buffer_centered", "value_chunks_centered"):
            if not isinstance(getattr(self, name), bool):
                reject(name, getattr(self, name), "True or False")
        held_for = self.held_for
        if isinstance(held_for, bool) or not isinstance(held_for, (int, float)) or not 0 < held_for <= 1:
            reject("held_for", held_for, "a number in (0, 1] (decode chunks of buffer_size tokens)")
        extra = [t.name for t in registered_terms() if not t.builtin]
        for name in self.extra_terms:
            if name not in extra:
                reject("extra_terms", self.extra_terms, f"names of registered extra terms ({extra or 'none'}; "
                                                        "gear_hf.compress.terms.register_term)")


# The paper's settings (GEAR, Kang et al. 2024) for what the paper does not set, with int8 low-rank factors (the
# paper keeps fp16; factor_bits=16 restores it): int8 factors move gear-2/gear-4's attention-output error < 0.3%.
PAPER_ADVANCED = Advanced(prompt_group_size=None, key_bit_allocation="uniform", rotation="none",
                          value_statistics="16", key_buffer="full", value_buffer="full", hold="none", held_for=1.0,
                          key_buffer_centered=False, value_buffer_centered=False, value_chunks_centered=False)

ADVANCED_NAMES = tuple(f.name for f in fields(Advanced))


def reject(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"GearConfig.{field}={value!r} is invalid; allowed: {allowed}")


# -- what the options resolve to, given the user fields -----------------------------------------------------------
def values_held(cfg: "GearConfig") -> bool:
    return cfg.compresses and cfg.advanced.hold != "none" and cfg.advanced.value_buffer in HOLDING_BUFFERS


def keys_held(cfg: "GearConfig") -> bool:
    return values_held(cfg) and cfg.advanced.hold == "both" and cfg.advanced.key_buffer in HOLDING_BUFFERS


def effective_held_for(cfg: "GearConfig") -> float:
    """held_for where keys are held too; values held alone stay until the next chunk flushes (they lag their keys
    by one chunk in every row, which the kernels' held-values read assumes)."""
    return cfg.advanced.held_for if keys_held(cfg) else 1.0


def effective_value_statistics(cfg: "GearConfig") -> str:
    """8-bit value statistics where they apply (values per token, min/max ranges, a buffer other than "final")."""
    a = cfg.advanced
    applies = a.value_axis == "token" and a.range_search not in ("values", "both") and a.value_buffer != "final"
    return a.value_statistics if applies else "16"


def hold_from_sizes(sizes: dict[str, Any], *, buffer_size: int, hold: str, compresses: bool, key_buffer: str,
                    value_buffer: str) -> str:
    """`hold` from the held buffers' sizes as earlier releases set them (`value_buffer_size` / `key_buffer_size`: None,
    2 x buffer_size or "auto", which held a stream where its buffer is per token, keys only with held values); a size
    not given keeps what `hold` says of its stream."""
    held = {"value": hold != "none", "key": hold == "both"}
    buffers = {"value": value_buffer, "key": key_buffer}
    for name, size in sizes.items():
        stream = name.split("_")[0]
        if size == "auto":
            held[stream] = compresses and buffers[stream] in HOLDING_BUFFERS
        elif size is not None and (isinstance(size, bool) or size != 2 * buffer_size):
            reject(name, size, f"'auto', None or 2 x buffer_size = {2 * buffer_size}")
        else:
            held[stream] = size is not None
    if sizes.get("key_buffer_size", "auto") == "auto":  # ("auto", or not given: keys follow their values)
        held["key"] = held["key"] and held["value"]
    if held["key"] and not held["value"]:
        reject("key_buffer_size", sizes["key_buffer_size"], "None with value_buffer_size=None (keys are held a chunk "
                                                            "longer only with their values)")
    return "both" if held["key"] else "values" if held["value"] else "none"


def release_after(cfg: "GearConfig") -> int:
    """Tokens buffered after a held chunk that release it: ceil(held_for x buffer_size)."""
    return math.ceil(cfg.held_for * cfg.buffer_size)


def token_granule(method: str, streams: tuple[tuple[str, int, float, bool], ...]) -> int:
    """Tokens a chunk holds a multiple of: every group that runs along tokens and whole code bytes.
    streams: (axis, group, bits, allocated) of keys and values."""
    granule = 1
    for axis, group, bits, allocated in streams:
        if axis == "channel":
            unit = codes_per_unit(bits, allocated) if "backbone" in METHOD_TERMS[method] else 1
            granule = math.lcm(granule, group, unit)
    return granule


def check(cfg: "GearConfig") -> None:
    """Options that must fit the user fields and each other (the config being built)."""
    a = cfg.advanced
    if a.prompt_group_size is not None and cfg.coarse_groups:
        reject("prompt_group_size", a.prompt_group_size, "None for method 'kcvt' (one group per whole channel)")
    key_bits = cfg.key_bits
    if a.key_bit_allocation == "query":
        if isinstance(key_bits, bool) or not isinstance(key_bits, (int, float)) or not 1 <= key_bits <= 8 \
                or key_bits * PLANE_TOKENS != int(key_bits * PLANE_TOKENS):
            reject("key_bits", key_bits, "a multiple of 1/8 in [1, 8] (the mean bits of a key channel with "
                                         "key_bit_allocation='query')")
    elif isinstance(key_bits, bool) or key_bits not in BITS:
        reject("key_bits", key_bits, "2, 3, 4 or 8 (or, with key_bit_allocation='query', a mean such as 3.5)")
    if a.key_bit_allocation == "query" and cfg.compresses:
        for field, value, bad, allowed in (
                ("key_axis", a.key_axis, a.key_axis != "channel", "'channel'"),
                ("method", cfg.method, cfg.uses_outliers, "a method without outliers (kivi, kcvt, gear-l)"),
                ("rotation", a.rotation, a.rotation in ("keys", "both"), "'none' or 'values'")):
            if bad:
                reject(field, value, f"{allowed} with key_bit_allocation='query' (widths per key channel; "
                                     "key_bit_allocation='uniform' for one width)")
    if cfg.compresses and a.value_buffer == "final" and (a.value_axis != "token" or cfg.uses_lowrank or a.extra_terms):
        reject("value_buffer", a.value_buffer, "'full' unless values are grouped per token (value_axis='token') with "
                                               "no low-rank term or extra term (each value must be stored on its own)")
