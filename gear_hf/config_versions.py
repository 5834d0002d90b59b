"""The saved format of `GearConfig.to_dict` / `from_dict`: each format version's defaults. Data only (gear_hf.config
imports it)."""

from __future__ import annotations

from typing import Any

# The saved format (`to_dict` / `from_dict`). Each version's defaults are written out, never read from the dataclass:
# changing a GearConfig() default or adding a field means a new version with its own entry here (older entries stay
# as they are, a new field getting the value that keeps an older dict's meaning); tests/test_config_dict.py fails
# until the newest entry matches GearConfig()'s fields and defaults.
VERSION_KEY = "gear_config_version"
CONFIG_VERSION = 10
DEFAULTS_BY_VERSION: dict[int, dict[str, Any]] = {
    1: dict(method="kivi", key_bits=3.125, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
            outlier_ratio=0.02, buffer_size=128, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="full", value_buffer="full", value_statistics="16", value_buffer_size=None,
            key_buffer_size=None, held_for=1.0, key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    2: dict(method="kivi", key_bits=3.125, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
            outlier_ratio=0.02, buffer_size=128, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8", value_buffer="int4", value_statistics="16", value_buffer_size=None,
            key_buffer_size=None, held_for=1.0, key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    3: dict(method="kivi", key_bits=3.125, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
            outlier_ratio=0.02, buffer_size=128, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8", value_buffer="int4", value_statistics="16", value_buffer_size=None,
            key_buffer_size=None, held_for=1.0, key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    4: dict(method="kivi", key_bits=3.125, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
            outlier_ratio=0.02, buffer_size=128, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8-rotated", value_buffer="int4", value_statistics="16", value_buffer_size=None,
            key_buffer_size=None, held_for=1.0, key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    # "steady": a 64-token buffer (key groups along tokens capped at it), values held a chunk longer, 8-bit value
    # statistics; "auto" resolves from the other fields (gear_hf.config_buffer.AUTO_FIELDS)
    5: dict(method="kivi", key_bits=3.125, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
            outlier_ratio=0.02, buffer_size=64, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8-rotated", value_buffer="int4", value_statistics="auto", value_buffer_size="auto",
            key_buffer_size=None, held_for=1.0, key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    # "held": keys held a chunk longer too (key_buffer_size, a new field), paid for by 2.75-bit keys in the chunks
    6: dict(method="kivi", key_bits=2.75, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2, power_iters=3,
            outlier_ratio=0.02, buffer_size=64, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8-rotated", value_buffer="int4", value_statistics="auto", value_buffer_size="auto",
            key_buffer_size="auto", held_for=1.0, key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    # "held-early": both held chunks released half a chunk after they are held (held_for, a new field), which pays
    # for 3-bit keys in the chunks
    7: dict(method="kivi", key_bits=3, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2,
            power_iters=3, outlier_ratio=0.02, buffer_size=64, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8-rotated", value_buffer="int4", value_statistics="auto", value_buffer_size="auto",
            key_buffer_size="auto", held_for="auto", key_buffer_centered=False,
            value_buffer_centered=False, value_chunks_centered=False),
    # "held-centered": "held-early" with its key buffer centered and scaled per channel (key_buffer_centered, a new
    # field)
    8: dict(method="kivi", key_bits=3, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2,
            power_iters=3, outlier_ratio=0.02, buffer_size=64, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8-rotated", value_buffer="int4", value_statistics="auto", value_buffer_size="auto",
            key_buffer_size="auto", held_for="auto", key_buffer_centered=True,
            value_buffer_centered=False, value_chunks_centered=False),
    # "centered": "held-centered" with its value buffer centered per channel too (value_buffer_centered, a new field;
    # the keys' exponents 4 bits a channel)
    9: dict(method="kivi", key_bits=3, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2,
            power_iters=3, outlier_ratio=0.02, buffer_size=64, sink_tokens=4, key_axis="channel", value_axis="token",
            pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
            factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
            key_buffer="int8-rotated", value_buffer="int4", value_statistics="auto", value_buffer_size="auto",
            key_buffer_size="auto", held_for="auto", key_buffer_centered=True, value_buffer_centered=True,
            value_chunks_centered=False),
    # "centered-chunks": "centered-kv" with its value chunks coded by the value buffer's centers too
    # (value_chunks_centered, a new field: no byte more)
    10: dict(method="kivi", key_bits=3, value_bits=3, group_size=128, rank_prefill=4, rank_decode=2,
             power_iters=3, outlier_ratio=0.02, buffer_size=64, sink_tokens=4, key_axis="channel", value_axis="token",
             pre_rope=True, backend="auto", key_group_size=None, value_group_size=None, rotation="values",
             factor_bits=8, range_search="none", prompt_group_size=256, key_bit_allocation="query", extra_terms=(),
             key_buffer="int8-rotated", value_buffer="int4", value_statistics="auto", value_buffer_size="auto",
             key_buffer_size="auto", held_for="auto", key_buffer_centered=True, value_buffer_centered=True,
             value_chunks_centered=True),
}
