"""Issue 27.6: a saved GearConfig keeps its meaning when the defaults move (to_dict / from_dict with a format
version), and `preset(..., bits=)` errors name `bits`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gear_hf import GearConfig
from gear_hf.config import CONFIG_VERSION, DEFAULTS_BY_VERSION, VERSION_KEY


def test_newest_version_holds_todays_defaults():
    """Changing a GearConfig() default or adding a field must add a new format version (config.py explains)."""
    today = {f.name: f.default for f in dataclasses.fields(GearConfig)}
    assert DEFAULTS_BY_VERSION[CONFIG_VERSION] == today, (
        "GearConfig's fields or defaults changed: add DEFAULTS_BY_VERSION[CONFIG_VERSION + 1] and bump CONFIG_VERSION")


@pytest.mark.parametrize("config", [GearConfig(), GearConfig.preset("gear-2"), GearConfig.recommended(name="compact"),
                                    GearConfig.preset("kivi", bits=4, group_size=32, backend="torch")])
def test_round_trip_through_json(config):
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved[VERSION_KEY] == CONFIG_VERSION
    assert GearConfig.from_dict(saved) == config


def test_missing_fields_take_the_versions_defaults_not_todays(monkeypatch):
    """A dict of version 1 naming only the method keeps version 1's other settings even if today's defaults move."""
    import gear_hf.config as config_module

    moved = dict(DEFAULTS_BY_VERSION[1], key_bits=4, key_bit_allocation="uniform", group_size=64)
    monkeypatch.setattr(config_module, "DEFAULTS_BY_VERSION", {1: DEFAULTS_BY_VERSION[1], 2: moved})
    monkeypatch.setattr(config_module, "CONFIG_VERSION", 2)
    old = GearConfig.from_dict({VERSION_KEY: 1, "method": "kivi"})
    assert (old.key_bits, old.key_bit_allocation, old.group_size) == (3.125, "query", 128)
    new = GearConfig.from_dict({VERSION_KEY: 2, "method": "kivi"})
    assert (new.key_bits, new.key_bit_allocation, new.group_size) == (4, "uniform", 64)


def test_a_version_1_config_loads_as_version_1s_default_whatever_todays():
    """Config version 2 moved GearConfig()'s buffer to 8-bit keys / 4-bit values: a dict saved by version 1 keeps the
    default it was saved with ("accurate" with the 16-bit buffer)."""
    old = GearConfig.from_dict({VERSION_KEY: 1})
    assert old == GearConfig(key_buffer="full", value_buffer="full") != GearConfig()
    assert (old.key_bits, old.value_axis, old.sink_tokens, old.key_buffer, old.value_buffer) == \
        (3.125, "token", 4, "full", "full")
    saved_v1 = dict(DEFAULTS_BY_VERSION[1], key_bits=3.5)  # what a version-1 gear_hf wrote for "precise"
    assert GearConfig.from_dict({VERSION_KEY: 1, **saved_v1}) == GearConfig.recommended(name="precise")
    today = GearConfig.from_dict({VERSION_KEY: CONFIG_VERSION, "method": "kivi"})
    assert today == GearConfig() and (today.key_buffer, today.value_buffer) == ("int8-rotated", "int4")


@pytest.mark.parametrize("data,match", [
    ({VERSION_KEY: 1, "key_bitz": 3}, r"unknown key\(s\) \['key_bitz'\] for gear_config_version 1"),
    ({VERSION_KEY: CONFIG_VERSION + 1}, rf"gear_config_version={CONFIG_VERSION + 1} is newer than this gear_hf reads; "
                                        r"allowed: 1, 2, 3, 4 \(upgrade gear_hf"),
    ({VERSION_KEY: "one"}, r"gear_config_version='one' is invalid; allowed: 1, 2, 3, 4"),
    ({"method": "kivi"}, r"has no 'gear_config_version'"),
    ([("method", "kivi")], r"takes a dict"),
    ({VERSION_KEY: 1, "value_bits": 5}, r"GearConfig.value_bits=5 is invalid"),  # values still validated
])
def test_from_dict_errors_are_clear(data, match):
    with pytest.raises(ValueError, match=match):
        GearConfig.from_dict(data)


@pytest.mark.parametrize("bits", [5, 1, 3.5, True])
def test_preset_bits_error_names_bits(bits):
    with pytest.raises(ValueError) as info:
        GearConfig.preset("gear", bits=bits)
    message = str(info.value)
    assert f"bits={bits!r} is invalid; allowed: 2, 3, 4, 8" in message
    assert "key_bits" not in message.replace("sets both key_bits and value_bits", "") and "query" not in message

