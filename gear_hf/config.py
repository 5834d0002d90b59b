"""`GearConfig`: the one description of how a KV cache is compressed.

A frozen dataclass validated at construction, so a bad value fails where it is written, naming the field,
the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any

from .compress.quant import codes_per_byte

METHODS = ("fp16", "kivi", "kcvt", "outlier", "gear-l", "gear")
BITS = (2, 4, 8)
AXES = ("channel", "token")
BACKENDS = ("auto", "torch", "triton")

# Which correction terms each method adds to the quantized backbone.
_USES_QUANT = {"fp16": False, "kivi": True, "kcvt": True, "outlier": True, "gear-l": True, "gear": True}
_USES_OUTLIERS = {"fp16": False, "kivi": False, "kcvt": False, "outlier": True, "gear-l": False, "gear": True}
_USES_LOWRANK = {"fp16": False, "kivi": False, "kcvt": False, "outlier": False, "gear-l": True, "gear": True}


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"GearConfig.{field}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class GearConfig:
    """How keys and values are compressed.

    method:        fp16 | kivi | kcvt | outlier | gear-l | gear  (see DESIGN §2)
    key_bits, value_bits: 2, 4 or 8 (ignored by fp16)
    group_size:    g, tokens per key group (per channel) and channels per value group (per token)
    rank_prefill:  low-rank rank of the prompt chunk; rank_decode: of each decode chunk
    power_iters:   power iterations of the low-rank fit
    outlier_ratio: fraction s of each vector kept exactly (s/2 largest, s/2 smallest)
    buffer_size:   n_b, newest tokens kept in full precision; a multiple of group_size
    sink_tokens:   first tokens of each row never compressed
    key_axis / value_axis: "channel" (groups run along tokens) or "token" (groups run along channels)
    pre_rope:      compress keys before rotary embedding and rotate them when read
    backend:       "auto" (Triton kernels on CUDA when available, else torch), "torch" or "triton" (forced);
                   the environment variable GEAR_HF_BACKEND overrides "auto"
    """

    method: str = "gear"
    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64
    rank_prefill: int = 4
    rank_decode: int = 2
    power_iters: int = 3
    outlier_ratio: float = 0.02
    buffer_size: int = 64
    sink_tokens: int = 0
    key_axis: str = "channel"
    value_axis: str = "token"
    pre_rope: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", self.method, " | ".join(METHODS))
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in BITS:
                _fail(name, value, "2, 4 or 8")
        for name, low in (("group_size", 1), ("rank_prefill", 0), ("rank_decode", 0), ("power_iters", 1),
                          ("sink_tokens", 0), ("buffer_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                _fail(name, value, f"an integer >= {low}")
        if self.compresses:  # codes are packed codes_per_byte(bits) to a byte along each group
            for name in ("key_bits", "value_bits"):
                per_byte = codes_per_byte(getattr(self, name))
                if self.group_size % per_byte:
                    _fail("group_size", self.group_size,
                          f"a multiple of {per_byte} with {name}={getattr(self, name)} ({per_byte} codes per byte)")
        if self.buffer_size % self.group_size:
            if self.buffer_size == _DEFAULT_BUFFER:  # blame what the user wrote, not a default
                _fail("group_size", self.group_size, f"a divisor of buffer_size={self.buffer_size} (the default), "
                      f"or also set buffer_size to a multiple of {self.group_size}")
            _fail("buffer_size", self.buffer_size, f"a positive multiple of group_size={self.group_size}")
        if isinstance(self.outlier_ratio, bool) or not isinstance(self.outlier_ratio, (int, float)) \
                or not 0.0 <= self.outlier_ratio < 1.0:
            _fail("outlier_ratio", self.outlier_ratio, "a number in [0, 1)")
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                _fail(name, getattr(self, name), " | ".join(AXES))
        if self.backend not in BACKENDS:
            _fail("backend", self.backend, " | ".join(BACKENDS))
        if not isinstance(self.pre_rope, bool):
            _fail("pre_rope", self.pre_rope, "True or False")
        if self.uses_lowrank and max(self.rank_prefill, self.rank_decode) == 0:
            _fail("rank_prefill", self.rank_prefill, f"> 0 for method {self.method!r} (or rank_decode > 0)")
        if self.uses_outliers and self.outlier_ratio == 0:
            _fail("outlier_ratio", self.outlier_ratio, f"> 0 for method {self.method!r}")

    # What the method computes -------------------------------------------------------------------------------
    @property
    def compresses(self) -> bool:
        return _USES_QUANT[self.method]

    @property
    def uses_outliers(self) -> bool:
        return _USES_OUTLIERS[self.method]

    @property
    def uses_lowrank(self) -> bool:
        return _USES_LOWRANK[self.method]

    @property
    def coarse_groups(self) -> bool:
        """KCVT: one group per whole channel (keys) / whole token vector (values)."""
        return self.method == "kcvt"

    def replace(self, **changes: Any) -> "GearConfig":
        return dataclasses.replace(self, **changes)

    # Presets --------------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, bits: int | None = None, **overrides: Any) -> "GearConfig":
        """The named method with the paper's defaults; `bits` sets both key_bits and value_bits.

        name: a method ("gear"), or a method with its bits as `describe()` writes them: "gear-2", "kivi-4",
        "gear-l-k4v2" (key_bits=4, value_bits=2)."""
        method, name_bits = parse_preset_name(name)
        fields: dict[str, Any] = {"method": method}
        if name_bits is not None:
            if bits is not None and (bits, bits) != name_bits:
                raise ValueError(f"GearConfig.preset({name!r}, bits={bits!r}): the name already sets the bits; "
                                 f"give preset {method!r} with bits={bits}, or {name!r} alone")
            fields["key_bits"], fields["value_bits"] = name_bits
        elif bits is not None:
            fields["key_bits"] = fields["value_bits"] = bits
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"GearConfig has no field(s) {sorted(unknown)}; fields: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        fields.update(overrides)
        return cls(**fields)

    def describe(self) -> str:
        """The preset name of this config's method and bits ("gear-2", "kivi-k4v2", "fp16"); `preset` reads it."""
        if not self.compresses:
            return "fp16"
        bits = f"{self.key_bits}" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        return f"{self.method}-{bits}"


_DEFAULT_BUFFER = GearConfig.__dataclass_fields__["buffer_size"].default
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
