"""Preset names as tables and `GearConfig.describe()` write them: "gear", "gear-2", "kivi-4", "gear-l-k4v2"."""

from __future__ import annotations

import difflib
import re
from typing import Any

from ..compress.quant import BITS
from ..compress.terms import METHOD_TERMS

METHODS = tuple(METHOD_TERMS)
_BITS_RE = re.compile(r"(?:(\d+)|k(\d+)v(\d+))")


def parse_preset_name(name: Any) -> tuple[str, tuple[int, int] | None]:
    """("gear", None) for "gear"; ("gear", (2, 2)) for "gear-2"; ("gear-l", (4, 2)) for "gear-l-k4v2".
    An unknown name raises a ValueError with the closest valid spelling."""
    text = name.strip().lower() if isinstance(name, str) else name
    if text in METHODS:
        return text, None
    if isinstance(text, str):
        method, _, tail = text.rpartition("-")
        match = _BITS_RE.fullmatch(tail)
        if method in METHODS and method != "fp16" and match:
            key, value = (int(match[1]),) * 2 if match[1] else (int(match[2]), int(match[3]))
            bad = [b for b in (key, value) if b not in BITS]
            if not bad:
                return method, (key, value)
            raise ValueError(f"GearConfig.preset name {name!r}: {bad[0]} bits is invalid; allowed bits: "
                             f"{', '.join(map(str, BITS))}")
    spellings = [*METHODS, *(f"{m}-{b}" for m in METHODS if m != "fp16" for b in BITS)]
    close = difflib.get_close_matches(text if isinstance(text, str) else "", spellings, n=1, cutoff=0.5)
    hint = ""
    if close:
        method, bits = parse_preset_name(close[0])
        hint = f" (did you mean {close[0]!r}, i.e. preset={method!r}" + (f", bits={bits[0]})" if bits else ")")
    raise ValueError(f"GearConfig.preset name {name!r} is invalid{hint}; allowed: METHOD or METHOD-BITS or "
                     f"METHOD-kBITSvBITS, METHOD one of {' | '.join(METHODS)}, BITS one of "
                     f"{', '.join(map(str, BITS))} (e.g. gear-2, kivi-4, gear-k4v2)")
