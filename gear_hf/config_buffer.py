"""GearConfig's buffer fields: the per-token formats of the newest tokens (`key_buffer` / `value_buffer`), values and
keys held a chunk longer (`value_buffer_size` / `key_buffer_size`) and for how long (`held_for`), the values'
statistics, and the fields whose default "auto" follows others."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from .compress.quant import STATS

if TYPE_CHECKING:
    from .config import GearConfig

KEY_BUFFERS = ("full", "int8", "int8-rotated", "int4")
VALUE_BUFFERS = ("full", "final", "int8", "int8-rotated", "int4")
HOLDING_BUFFERS = ("int8", "int8-rotated", "int4")  # buffers per token: tokens held in them a chunk longer


def check_buffers(cfg: "GearConfig", fail: Callable[[str, Any, str], None]) -> None:
    """Raise (through `fail(field, value, allowed)`) on a buffer field that is unknown or does not fit the others."""
    if cfg.key_buffer not in KEY_BUFFERS:
        fail("key_buffer", cfg.key_buffer, " | ".join(KEY_BUFFERS))
    if cfg.value_buffer not in VALUE_BUFFERS:
        fail("value_buffer", cfg.value_buffer, " | ".join(VALUE_BUFFERS))
    if cfg.compresses and cfg.value_buffer == "final" and (cfg.value_axis != "token" or cfg.uses_lowrank
                                                           or cfg.extra_terms):
        fail("value_buffer", cfg.value_buffer, "'full' unless values are grouped per token (value_axis="
             "'token') with no low-rank term or extra term (each value must be stored on its own)")
    if isinstance(cfg.value_statistics, int) and not isinstance(cfg.value_statistics, bool) \
            and str(cfg.value_statistics) in STATS:
        object.__setattr__(cfg, "value_statistics", str(cfg.value_statistics))  # 8 is "8" (lm-eval may pass ints)
    if cfg.value_statistics not in STATS:
        fail("value_statistics", cfg.value_statistics, " | ".join(repr(s) for s in STATS))
    if cfg.compresses and cfg.value_statistics == "8" and (
            cfg.value_axis != "token" or cfg.range_search in ("values", "both") or cfg.value_buffer == "final"):
        fail("value_statistics", cfg.value_statistics, "'16' unless values are grouped per token (value_axis="
             "'token') with min/max ranges (range_search not 'values' / 'both') and a buffer other than 'final'")
    for field in ("key_buffer_centered", "value_buffer_centered", "value_chunks_centered"):
        if not isinstance(getattr(cfg, field), bool):
            fail(field, getattr(cfg, field), "True or False")
    for stream in ("value", "key"):
        _check_held(cfg, stream, fail)
    _check_held_for(cfg, fail)
    if cfg.compresses and cfg.key_buffer_size is not None and cfg.value_buffer_size is None:
        # (the fused kernels read both streams' chunks and buffers from one boundary: keys held, values held)
        fail("key_buffer_size", cfg.key_buffer_size, f"None with value_buffer_size=None (keys are held a chunk longer "
                                                     f"only with their values: value_buffer_size = "
                                                     f"{2 * cfg.buffer_size})")


def _check_held(cfg: "GearConfig", stream: str, fail: Callable[[str, Any, str], None]) -> None:
    """`value_buffer_size` / `key_buffer_size`: None or 2 x buffer_size, held in a per-token buffer."""
    field, buffer = f"{stream}_buffer_size", f"{stream}_buffer"
    held = getattr(cfg, field)
    if held is None:
        return
    if isinstance(held, bool) or not isinstance(held, int) or held != 2 * cfg.buffer_size:
        fail(field, held, f"'auto', None or 2 x buffer_size = {2 * cfg.buffer_size} ({stream}s held one decode chunk "
                          "longer)")
    if cfg.compresses and getattr(cfg, buffer) not in HOLDING_BUFFERS:
        fail(field, held, f"None with {buffer}={getattr(cfg, buffer)!r} ({stream}s are held one chunk longer in a "
                          f"per-token format: {buffer} 'int8', 'int8-rotated' or 'int4')")


def _check_held_for(cfg: "GearConfig", fail: Callable[[str, Any, str], None]) -> None:
    """`held_for`: a fraction of a decode chunk in (0, 1]; below 1 only with keys held as well as values."""
    held_for = cfg.held_for
    if isinstance(held_for, bool) or not isinstance(held_for, (int, float)) or not 0 < held_for <= 1:
        fail("held_for", held_for, "'auto' or a number in (0, 1] (how long a held chunk stays held, in decode chunks "
                                   "of buffer_size tokens)")
    if cfg.compresses and held_for < 1 and cfg.value_buffer_size is not None and cfg.key_buffer_size is None:
        # (values held alone lag their keys by one chunk in every row: the kernels' held-values read)
        fail("held_for", held_for, "1 while values are held and keys are not (key_buffer_size=None): a chunk released "
                                   "early needs keys held too")


def release_after(cfg: "GearConfig") -> int:
    """Tokens buffered after a held chunk that release it: ceil(held_for x buffer_size)."""
    return math.ceil(cfg.held_for * cfg.buffer_size)


def _auto_value_statistics(cfg: "GearConfig") -> str:
    """8-bit value statistics where they apply (values per token, min/max ranges, a buffer other than "final")."""
    return "8" if (cfg.value_axis == "token" and cfg.range_search not in ("values", "both")
                   and cfg.value_buffer != "final") else "16"


def _auto_value_buffer_size(cfg: "GearConfig") -> int | None:
    """Values held a chunk longer wherever the value buffer is per token."""
    return 2 * cfg.buffer_size if cfg.compresses and cfg.value_buffer in HOLDING_BUFFERS else None


def _auto_key_buffer_size(cfg: "GearConfig") -> int | None:
    """Keys held a chunk longer wherever the key buffer is per token and the values are held (after
    value_buffer_size is resolved)."""
    held = cfg.compresses and cfg.key_buffer in HOLDING_BUFFERS and cfg.value_buffer_size is not None
    return 2 * cfg.buffer_size if held else None


def _auto_held_for(cfg: "GearConfig") -> float:
    """Held chunks released half a chunk after they are held where both streams hold them (the buffers then never hold
    more than 1.5 x buffer_size tokens: results/tail "Held chunks released early"), else held until the next chunk
    flushes (values held alone lag their keys by one chunk in every row)."""
    return HELD_FOR if cfg.compresses and cfg.key_buffer_size is not None else 1.0


HELD_FOR = 0.5  # what "auto" gives with both streams held

# fields whose default "auto" is resolved from others: (the fields it depends on, the resolution)
AUTO_FIELDS = {"value_statistics": ({"value_axis", "range_search", "value_buffer"}, _auto_value_statistics),
               "value_buffer_size": ({"buffer_size", "value_buffer", "method"}, _auto_value_buffer_size),
               # (after value_buffer_size: resolved in this order)
               "key_buffer_size": ({"buffer_size", "key_buffer", "value_buffer", "value_buffer_size", "method"},
                                   _auto_key_buffer_size),
               # (after key_buffer_size)
               "held_for": ({"buffer_size", "key_buffer", "value_buffer", "value_buffer_size", "key_buffer_size",
                             "method"}, _auto_held_for)}
