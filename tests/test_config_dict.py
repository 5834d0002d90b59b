"""A saved GearConfig keeps its meaning when the defaults move (to_dict / from_dict with a format version), every
earlier saved form loads, and `preset(..., bits=)` errors name `bits`."""

from __future__ import annotations

import json

import pytest

from gear_hf import GearConfig
from gear_hf.config import CONFIG_VERSION, DEFAULTS_BY_VERSION, VERSION_KEY


def test_newest_version_holds_todays_defaults():
    """Changing what GearConfig() means must add a new format version (gear_hf/config/saved.py): the newest version's
    flat defaults load as GearConfig(), in the flat form earlier releases wrote and in the nested one."""
    assert GearConfig.from_dict({VERSION_KEY: CONFIG_VERSION, **DEFAULTS_BY_VERSION[CONFIG_VERSION]}) == GearConfig()
    assert GearConfig.from_dict({VERSION_KEY: CONFIG_VERSION}) == GearConfig()
    assert GearConfig.from_dict({VERSION_KEY: CONFIG_VERSION, "advanced": {}}) == GearConfig()


@pytest.mark.parametrize("config", [GearConfig(), GearConfig.preset("gear-2"), GearConfig.recommended(name="smallest"),
                                    GearConfig.preset("kivi", bits=4, group_size=32, backend="torch")])
def test_round_trip_through_json(config):
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved[VERSION_KEY] == CONFIG_VERSION
    assert GearConfig.from_dict(saved) == config


def test_missing_fields_take_the_versions_defaults_not_todays(monkeypatch):
    """A dict of version 1 naming only the method keeps version 1's other settings even if today's defaults move."""
    import gear_hf.config.saved as saved

    moved = dict(DEFAULTS_BY_VERSION[1], key_bits=4, key_bit_allocation="uniform", group_size=64)
    monkeypatch.setattr(saved, "DEFAULTS_BY_VERSION", {1: DEFAULTS_BY_VERSION[1], 2: moved})
    monkeypatch.setattr(saved, "CONFIG_VERSION", 2)
    old = GearConfig.from_dict({VERSION_KEY: 1, "method": "kivi"})
    assert (old.key_bits, old.key_bit_allocation, old.group_size) == (3.125, "query", 128)
    new = GearConfig.from_dict({VERSION_KEY: 2, "method": "kivi"})
    assert (new.key_bits, new.key_bit_allocation, new.group_size) == (4, "uniform", 64)
    nested = GearConfig.from_dict({VERSION_KEY: 1, "method": "kivi", "advanced": {"rotation": "none"}})
    assert (nested.key_bits, nested.rotation, nested.key_buffer) == (3.125, "none", "full")


def test_a_version_1_config_loads_as_version_1s_default_whatever_todays():
    """Config version 2 moved GearConfig()'s buffer to 8-bit keys / 4-bit values: a dict saved by version 1 keeps the
    default it was saved with ("accurate" with the 16-bit buffer)."""
    old = GearConfig.from_dict({VERSION_KEY: 1})
    with pytest.warns(DeprecationWarning, match="former name"):
        accurate = GearConfig.recommended(name="accurate")  # (GearConfig() of config versions 1-4, with their buffers)
    assert old == accurate.replace(key_buffer="full", value_buffer="full") != GearConfig()
    assert (old.key_bits, old.value_axis, old.sink_tokens, old.key_buffer, old.value_buffer) == \
        (3.125, "token", 4, "full", "full")
    saved_v1 = dict(DEFAULTS_BY_VERSION[1], key_bits=3.5)  # what a version-1 gear_hf wrote for "precise"
    assert GearConfig.from_dict({VERSION_KEY: 1, **saved_v1}) == old.replace(key_bits=3.5)
    today = GearConfig.from_dict({VERSION_KEY: CONFIG_VERSION, "method": "kivi"})
    assert today == GearConfig() and (today.key_buffer, today.value_buffer) == ("int8-rotated", "int4")
    assert GearConfig.from_dict({VERSION_KEY: 4}) == accurate != GearConfig()  # (version 5: "steady")


def test_held_buffers_follow_the_buffer_they_are_held_in():
    """`hold` keeps tokens a chunk longer in per-token buffers (2 x buffer_size, following buffer_size), and applies
    to nothing else; 8-bit value statistics apply where values are grouped per token with min/max ranges."""
    default = GearConfig()
    assert (default.buffer_size, default.key_group, default.value_buffer_size, default.key_buffer_size,
            default.held_for, default.value_statistics) == (64, 64, 128, 128, 0.5, "8")
    assert GearConfig(buffer_size=32).value_buffer_size == 64 and GearConfig(buffer_size=32).key_group == 32
    assert default.replace(buffer_size=128).value_buffer_size == 256
    full = default.replace(value_buffer="full")
    assert (full.value_buffer_size, full.key_buffer_size, full.held_for) == (None, None, 1.0)
    assert default.replace(value_axis="channel", range_search="values").value_statistics == "16"
    assert GearConfig(hold="none").replace(buffer_size=128).value_buffer_size is None
    assert GearConfig(hold="values").key_buffer_size is None and GearConfig(hold="values").held_for == 1.0
    assert GearConfig(method="fp16").value_buffer_size is None
    with pytest.raises(ValueError, match=r"hold='keys' is invalid; allowed: none \| values \| both"):
        GearConfig(hold="keys")
    with pytest.raises(ValueError, match=r"value_buffer_size=96 is invalid; allowed: 'auto', None or 2 x buffer_size"):
        GearConfig.from_dict({VERSION_KEY: 5, "value_buffer_size": 96})
    saved = default.to_dict()
    assert (saved["advanced"]["hold"], saved["advanced"]["value_statistics"]) == ("both", "8") and \
        GearConfig.from_dict(saved) == default


@pytest.mark.parametrize("data,match", [
    ({VERSION_KEY: 1, "key_bitz": 3}, r"unknown key\(s\) \['key_bitz'\] for gear_config_version 1"),
    ({VERSION_KEY: CONFIG_VERSION + 1}, rf"gear_config_version={CONFIG_VERSION + 1} is newer than this gear_hf reads; "
                                        r"allowed: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 \(upgrade gear_hf"),
    ({VERSION_KEY: "one"}, r"gear_config_version='one' is invalid; allowed: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10"),
    ({"method": "kivi"}, r"has no 'gear_config_version'"),
    ([("method", "kivi")], r"takes a dict"),
    ({VERSION_KEY: 1, "value_bits": 5}, r"GearConfig.value_bits=5 is invalid"),  # values still validated
    ({VERSION_KEY: 10, "advanced": {"rotaton": "none"}}, r"unknown key\(s\) \['rotaton'\]"),
    ({VERSION_KEY: 10, "advanced": {"rotation": "all"}}, r"GearConfig.rotation='all' is invalid"),
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



def test_every_version_loads_with_the_fields_it_had():
    """A field added later takes, in older versions' entries, the value that keeps their meaning: config versions 1-4
    held no values and no keys a chunk longer (versions 2-3 once loaded with today's "auto" held values: 256 tokens of
    an int4 value buffer), version 5 held values only, version 6 both until the next chunk flushes, version 7 both
    for half a chunk; version 8 centers the key buffer, version 9 both buffers, version 10 the value chunks too."""
    configs = {v: GearConfig.from_dict({VERSION_KEY: v}) for v in DEFAULTS_BY_VERSION}
    held = {v: (c.value_buffer_size, c.key_buffer_size, c.held_for, c.key_buffer_centered, c.value_buffer_centered,
                c.value_chunks_centered) for v, c in configs.items()}
    assert held == {1: (None, None, 1.0, False, False, False), 2: (None, None, 1.0, False, False, False),
                    3: (None, None, 1.0, False, False, False), 4: (None, None, 1.0, False, False, False),
                    5: (128, None, 1.0, False, False, False), 6: (128, 128, 1.0, False, False, False),
                    7: (128, 128, 0.5, False, False, False), 8: (128, 128, 0.5, True, False, False),
                    9: (128, 128, 0.5, True, True, False), 10: (128, 128, 0.5, True, True, True)}
