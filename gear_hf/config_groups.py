"""How many tokens a chunk holds a multiple of: the groups that run along tokens and whole code bytes (GearConfig's
checks and `GearConfig.recommended` share it)."""

from __future__ import annotations

import math
from typing import Any

from .compress.quant import codes_per_unit  # (codes fill whole units: groups hold them)
from .compress.terms import METHOD_TERMS


def token_granule(fields: dict[str, Any], key_group: int, value_group: int) -> int:
    """Tokens a chunk holds a multiple of, for these groups: every group that runs along tokens (axis "channel") and
    whole code bytes. fields: GearConfig fields (a config's vars, or the dict `recommended` builds one from)."""
    granule = 1
    for prefix, group in (("key", key_group), ("value", value_group)):
        if fields[f"{prefix}_axis"] == "channel":
            unit = code_unit(fields, prefix) if "backbone" in METHOD_TERMS[fields["method"]] else 1
            granule = math.lcm(granule, group, unit)
    return granule


def code_unit(fields: dict[str, Any], prefix: str) -> int:
    """Codes of stream `prefix` ("key"/"value") per packing unit along tokens: widths per channel take bit planes."""
    return codes_per_unit(fields[f"{prefix}_bits"], prefix == "key" and fields["key_bit_allocation"] == "query")
