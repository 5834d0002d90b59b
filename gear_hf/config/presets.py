"""Named configurations: the paper presets ("gear-2", "kivi-4", ...) and three recommendations by purpose.

Each recommendation's `bits` is the most it owns per element over a generation (bf16; the mean of the 128 decode
steps after a prompt of T = 512, 1024 or 4096 tokens, head_dim 64 and 128, the largest of those six:
`gear_hf.measure.owned_bits_budget`, checked by tests/test_footprint.py), so `recommended(bits_per_element=b)` owns
<= b at each of those lengths. Their next-token fidelity: results/recommended/ (`python scripts/bench_recommended.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

from ..compress.quant import BITS
from .advanced import ADVANCED_NAMES, PAPER_ADVANCED, token_granule
from .core import SETTING_NAMES, GearConfig
from .names import parse_preset_name

# The paper's settings (GEAR, Kang et al. 2024): `preset` starts from these, whatever GearConfig()'s defaults.
PAPER_SETTINGS: dict[str, Any] = dict(key_bits=4, value_bits=4, group_size=64, rank_prefill=4, rank_decode=2,
                                      outlier_ratio=0.02, buffer_size=64, sink_tokens=0)

# (name, bits owned at most, what it is for, its settings over GearConfig()'s), smallest first
RECOMMENDED: tuple[tuple[str, float, str, dict[str, Any]], ...] = (
    ("smallest", 2.91, "the least memory: 2-bit chunks (2.3-2.9 bits owned)", dict(key_bits=2, value_bits=2)),
    ("balanced", 3.79, "GearConfig(): matches 4-bit KIVI's next-token error at ~0.7x its bytes", dict()),
    ("precise", 4.67, "closest to the uncompressed model: 4-bit chunks", dict(key_bits=4, value_bits=4)),
)
DEFAULT_RECOMMENDED = "balanced"


def recommended_config(name: str) -> GearConfig:
    fields = next(f for n, _, _, f in RECOMMENDED if n == name)
    return GearConfig(**fields)


def recommendation(bits_per_element: Any, name: str | None, overrides: dict[str, Any]) -> GearConfig:
    """GearConfig.recommended: by name, by budget, or the default."""
    if isinstance(bits_per_element, str):  # recommended("smallest"): a name
        bits_per_element, name = (None, bits_per_element) if name is None else (bits_per_element, name)
    if bits_per_element is not None and name is not None:
        raise ValueError("GearConfig.recommended takes bits_per_element or name, not both")
    names = [n for n, _, _, _ in RECOMMENDED]
    smallest = RECOMMENDED[0][1]
    if bits_per_element is not None and (isinstance(bits_per_element, bool) or not isinstance(
            bits_per_element, (int, float)) or math.isnan(bits_per_element)):
        raise ValueError(f"GearConfig.recommended bits_per_element={bits_per_element!r} is invalid; allowed: a number "
                         f">= {smallest} (what 'smallest' owns), or a name: {' | '.join(names)}")
    if name is None and bits_per_element is None:
        name = DEFAULT_RECOMMENDED
    if name is not None:
        if name in LEGACY_RECOMMENDED:
            warnings.warn(f"GearConfig.recommended({name!r}) is a former name, kept so that code written for it still "
                          f"runs; the recommendations are now {', '.join(names)} (docs/changelog.md)",
                          DeprecationWarning, stacklevel=3)
            return _legacy(name).replace(**overrides)
        if name not in names:
            raise ValueError(f"GearConfig.recommended name={name!r} is invalid; allowed: {' | '.join(names)}")
    else:
        fitting = [n for n, bits, _, _ in RECOMMENDED if bits <= bits_per_element]
        if not fitting:
            raise ValueError(f"GearConfig.recommended bits_per_element={bits_per_element!r} is invalid; allowed: a "
                             f"number >= {smallest} (the least a recommendation owns at T = 512 to 4096 tokens)")
        name = fitting[-1]
    return recommended_config(name).replace(**overrides)


def paper_preset(name: str, bits: int | None, overrides: dict[str, Any]) -> GearConfig:
    """GearConfig.preset: the named method with the paper's settings."""
    method, name_bits = parse_preset_name(name)
    if bits is not None and (isinstance(bits, bool) or bits not in BITS):
        raise ValueError(f"GearConfig.preset({name!r}, bits={bits!r}): bits={bits!r} is invalid; allowed: "
                         f"{', '.join(map(str, BITS))} (bits sets both key_bits and value_bits)")
    fields: dict[str, Any] = {**PAPER_SETTINGS, "method": method}
    if name_bits is not None:
        if bits is not None and (bits, bits) != name_bits:
            raise ValueError(f"GearConfig.preset({name!r}, bits={bits!r}): the name already sets the bits; "
                             f"give preset {method!r} with bits={bits}, or {name!r} alone")
        fields["key_bits"], fields["value_bits"] = name_bits
    elif bits is not None:
        fields["key_bits"] = fields["value_bits"] = bits
    unknown = set(overrides) - set(SETTING_NAMES) - set(ADVANCED_NAMES) - {"advanced"}
    if unknown:
        raise ValueError(f"GearConfig has no setting(s) {sorted(unknown)}; settings: {', '.join(SETTING_NAMES)}, "
                         f"advanced options: {', '.join(ADVANCED_NAMES)}")
    return GearConfig(**fields, advanced=PAPER_ADVANCED).replace(**overrides)


@functools.lru_cache(maxsize=64)  # (memory_report asks every step; GearConfig is frozen)
def name_of(config: GearConfig) -> str:
    """The recommendation or paper preset `config` is, else its description marked custom."""
    for name, _, _, _ in RECOMMENDED:
        if recommended_config(name) == config:
            return name
    description = config.describe()
    try:
        if paper_preset(description, None, {}) == config:
            return description
    except ValueError:  # a description that is no preset name ("...-query-allocated")
        pass
    return f"{description} (custom)"


# Former recommendation names (flat fields over the paper's, as they were offered): they still load, with a
# DeprecationWarning, and are no longer offered.
_ALLOCATED = dict(method="kivi", key_bit_allocation="query", rotation="values", group_size=128, sink_tokens=4,
                  prompt_group_size=256)
_COMPACT = dict(_ALLOCATED, value_axis="channel", range_search="values")
_HELD_EARLY = dict(_ALLOCATED, key_bits=3, value_bits=3, key_buffer="int8-rotated", value_buffer="int4", buffer_size=64,
                   value_buffer_size="auto", value_statistics="auto", key_buffer_size="auto", held_for="auto")
LEGACY_RECOMMENDED: dict[str, dict[str, Any]] = {
    "small": dict(method="kivi", key_bits=2, value_bits=2, rotation="values", range_search="values", group_size=128,
                  sink_tokens=4),
    "compact": dict(_COMPACT, key_bits=2.5, value_bits=2),
    "lean": dict(_COMPACT, key_bits=2.875, value_bits=3, key_buffer="int8-rotated", value_buffer="int4"),
    "held": dict(_ALLOCATED, key_bits=2.75, value_bits=3, key_buffer="int8-rotated", value_buffer="int4",
                 buffer_size=64, value_buffer_size="auto", value_statistics="auto", key_buffer_size="auto",
                 held_for=1.0),
    "held-early": _HELD_EARLY,
    "centered": dict(_HELD_EARLY, key_buffer_centered=True),
    "centered-kv": dict(_HELD_EARLY, key_buffer_centered=True, value_buffer_centered=True),
    "centered-chunks": dict(_HELD_EARLY, key_buffer_centered=True, value_buffer_centered=True,
                            value_chunks_centered=True),
    "steady": dict(_ALLOCATED, key_bits=3.125, value_bits=3, key_buffer="int8-rotated", value_buffer="int4",
                   buffer_size=64, value_buffer_size="auto", value_statistics="auto"),
    "accurate": dict(_ALLOCATED, key_bits=3.125, value_bits=3, key_buffer="int8-rotated", value_buffer="int4"),
    "kivi-4": dict(method="kivi", key_bits=4, value_bits=4),
    "gear-4": dict(method="gear", key_bits=4, value_bits=4, factor_bits=16),
}
# (the former "balanced" and "precise" are names again, for other configurations: their old fields load from a dict
# written with them, not by name)


def _legacy(name: str) -> GearConfig:
    from .saved import _from_flat

    fields = {**PAPER_SETTINGS, **dataclasses.asdict(PAPER_ADVANCED), "value_buffer_size": None,
              "key_buffer_size": None, **LEGACY_RECOMMENDED[name]}
    del fields["hold"]
    if "buffer_size" not in LEGACY_RECOMMENDED[name]:  # the paper's 64, or whole longer groups
        groups = (fields["key_group_size"] or fields["group_size"], fields["value_group_size"] or fields["group_size"])
        allocated = fields["key_bit_allocation"] == "query"
        granule = token_granule(fields["method"], ((fields["key_axis"], groups[0], fields["key_bits"], allocated),
                                                   (fields["value_axis"], groups[1], fields["value_bits"], False)))
        fields["buffer_size"] = math.lcm(PAPER_SETTINGS["buffer_size"], granule)
    return _from_flat(fields)
