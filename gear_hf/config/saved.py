"""The saved form of a `GearConfig` (`to_dict` / `from_dict`) and how every earlier form still loads.

`to_dict` writes {"gear_config_version": N, the ten settings, "advanced": {the options}}. Dicts written by earlier
gear_hf releases are flat (every field at the top, four of them possibly "auto"); they load to the configuration
they meant then, through `DEFAULTS_BY_VERSION` (each version's defaults, as changes from the one before) and
`_from_flat`. The history of the default, version by version, is docs/changelog.md.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .advanced import ADVANCED_NAMES, Advanced, hold_from_sizes

if TYPE_CHECKING:
    from .core import GearConfig

VERSION_KEY = "gear_config_version"
# A new version only when GearConfig()'s meaning changes (a default or a new option), with its entry below.
CONFIG_VERSION = 10

_V1 = dict(method="kivi", key_bits=3.125, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
           outlier_ratio=0.02, buffer_size=128, sink_tokens=4, key_axis="channel", value_axis="token", pre_rope=True,
           backend="auto", key_group_size=None, value_group_size=None, rotation="values", factor_bits=8,
           range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(), key_buffer="full",
           value_buffer="full", value_statistics="16", value_buffer_size=None, key_buffer_size=None, held_for=1.0,
           key_buffer_centered=False, value_buffer_centered=False, value_chunks_centered=False)
_CHANGES = {  # version: what its defaults changed from the previous version's (docs/changelog.md says why)
    2: dict(key_buffer="int8", value_buffer="int4"),
    3: dict(),
    4: dict(key_buffer="int8-rotated"),
    5: dict(buffer_size=64, value_statistics="auto", value_buffer_size="auto"),
    6: dict(key_bits=2.75, key_buffer_size="auto"),
    7: dict(key_bits=3, held_for="auto"),
    8: dict(key_buffer_centered=True),
    9: dict(value_buffer_centered=True),
    10: dict(value_chunks_centered=True),
}
DEFAULTS_BY_VERSION: dict[int, dict[str, Any]] = {1: _V1}
for _version, _changes in _CHANGES.items():
    DEFAULTS_BY_VERSION[_version] = {**DEFAULTS_BY_VERSION[_version - 1], **_changes}


def to_dict(config: "GearConfig") -> dict[str, Any]:
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "advanced"}
    return {VERSION_KEY: CONFIG_VERSION, **settings, "advanced": dataclasses.asdict(config.advanced)}


def from_dict(data: dict[str, Any]) -> "GearConfig":
    from .core import SETTING_NAMES, GearConfig

    if not isinstance(data, dict):
        raise ValueError(f"GearConfig.from_dict takes a dict (from GearConfig.to_dict()), not {type(data).__name__}")
    fields = dict(data)
    version = fields.pop(VERSION_KEY, None)
    known = ", ".join(map(str, DEFAULTS_BY_VERSION))
    if version is None:
        raise ValueError(f"GearConfig.from_dict: the dict has no {VERSION_KEY!r} (GearConfig.to_dict() writes it; "
                         f"known versions: {known}; add {VERSION_KEY!r}: {CONFIG_VERSION} for a dict written for this "
                         f"gear_hf)")
    if isinstance(version, bool) or version not in DEFAULTS_BY_VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > CONFIG_VERSION
        raise ValueError(f"GearConfig.from_dict: {VERSION_KEY}={version!r} is "
                         f"{'newer than this gear_hf reads' if newer else 'invalid'}; allowed: {known}"
                         + (" (upgrade gear_hf to read it)" if newer else ""))
    if "advanced" in fields:  # the nested form to_dict writes
        advanced = fields.pop("advanced")
        if not isinstance(advanced, dict):
            raise ValueError(f"GearConfig.from_dict: 'advanced' must be a dict of options, not "
                             f"{type(advanced).__name__}")
        unknown = sorted(set(fields) - set(SETTING_NAMES)) + sorted(set(advanced) - set(ADVANCED_NAMES))
        if unknown:
            raise ValueError(f"GearConfig.from_dict: unknown key(s) {unknown}; settings: {', '.join(SETTING_NAMES)}; "
                             f"advanced: {', '.join(ADVANCED_NAMES)}")
        flat_defaults = DEFAULTS_BY_VERSION[version]
        base = _from_flat(flat_defaults)
        return GearConfig(**{**{n: getattr(base, n) for n in SETTING_NAMES}, **fields},
                          advanced=dataclasses.replace(base.advanced, **advanced))
    defaults = DEFAULTS_BY_VERSION[version]
    unknown = sorted(set(fields) - set(defaults))
    if unknown:
        raise ValueError(f"GearConfig.from_dict: unknown key(s) {unknown} for {VERSION_KEY} {version}; "
                         f"keys: {VERSION_KEY}, {', '.join(defaults)}")
    return _from_flat({**defaults, **fields})


def _from_flat(fields: dict[str, Any]) -> "GearConfig":
    """A configuration from the flat fields of versions 1-10 (also the former recommendation names): the held
    buffer sizes become `hold`, "auto" takes what it resolved to then (the options' own rules)."""
    from .core import GearConfig

    fields = dict(fields)
    sizes = {k: fields.pop(k, None) for k in ("value_buffer_size", "key_buffer_size")}
    fields["hold"] = hold_from_sizes(sizes, buffer_size=fields["buffer_size"], hold="none",
                                     compresses=fields["method"] != "fp16", key_buffer=fields["key_buffer"],
                                     value_buffer=fields["value_buffer"])
    if fields.get("held_for") == "auto":
        fields["held_for"] = Advanced.held_for
    if fields.get("value_statistics") == "auto":
        fields["value_statistics"] = "8"
    return GearConfig(**fields)
