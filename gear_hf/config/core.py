"""`GearConfig`: how a KV cache is compressed, in ten fields a user sets and one `Advanced` object for the rest.

A frozen dataclass validated at construction, so a bad value fails where it is written, naming the field, the value
and what is allowed. `GearConfig()` is the "balanced" recommendation; `GearConfig.preset("gear-2")` a paper preset;
`GearConfig.recommended("smallest")` a recommendation by purpose (gear_hf/config/presets.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from ..compress.quant import BITS, codes_per_unit
from ..compress.terms import METHOD_TERMS
from .advanced import (
    ADVANCED_NAMES,
    Advanced,
    check,
    effective_held_for,
    effective_value_statistics,
    hold_from_sizes,
    keys_held,
    reject,
    token_granule,
    values_held,
)
from .names import METHODS

BACKENDS = ("auto", "torch", "triton", "numba")  # gear_hf.backends registers exactly these


@dataclass(frozen=True, init=False)
class GearConfig:
    """How keys and values are compressed (GEAR: X ≈ quantized backbone + low-rank L + sparse outliers S).

    method:        fp16 | kivi | kcvt | outlier | gear-l | gear  (fp16 keeps every token; kivi: backbone only;
                   kcvt: one group per whole channel/token; outlier: + S; gear-l: + L; gear: + L + S)
    key_bits, value_bits: 2, 3, 4 or 8; with advanced.key_bit_allocation="query" (the default) key_bits is the
                   mean width of a key channel: a multiple of 1/8 in [1, 8] (e.g. 3.5)
    group_size:    tokens per key group (keys grouped per channel) and channels per value group (values per token)
    buffer_size:   the newest tokens kept out of the compressed chunks; a multiple of the groups along tokens
    sink_tokens:   first tokens of each row never compressed
    rank_prefill, rank_decode: rank of the low-rank term of the prompt chunk / of each decode chunk (gear, gear-l)
    outlier_ratio: fraction of each vector kept exactly (half largest, half smallest; gear, outlier)
    backend:       "auto" (Triton on CUDA tensors, numba on CPU tensors when installed, else torch), "torch",
                   "triton" or "numba"; the environment variable GEAR_HF_BACKEND overrides "auto"
    advanced:      everything else (axes, per-stream groups, key-width allocation, rotation, the buffer's formats,
                   holding, centering, statistics width, range search): `Advanced`'s docstring

    An option of `advanced` may also be given by name (`GearConfig(rotation="none")`, `config.replace(hold="none")`)
    and is read as an attribute (`config.rotation`). Side information (scales, minimums, outliers, factors) is kept
    in 16 bits whatever the model dtype.
    """

    method: str = "kivi"
    key_bits: int | float = 3  # a float only as the mean of allocated widths
    value_bits: int = 3
    group_size: int = 128
    buffer_size: int = 64
    sink_tokens: int = 4
    rank_prefill: int = 4
    rank_decode: int = 2
    outlier_ratio: float = 0.02
    backend: str = "auto"
    advanced: Advanced = Advanced()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        if len(args) > len(names):
            raise TypeError(f"GearConfig takes at most {len(names)} positional arguments ({', '.join(names)})")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"GearConfig got {name!r} twice (positionally and by name)")
            kwargs[name] = value
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in ADVANCED_NAMES}
        sizes = {k: kwargs.pop(k) for k in FORMER_SIZE_NAMES if k in kwargs}
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"GearConfig has no setting(s) {unknown}; settings: {', '.join(names[:-1])}, and the "
                             f"advanced options {', '.join(ADVANCED_NAMES)}")
        advanced = kwargs.pop("advanced", None)
        if advanced is None:
            advanced = Advanced()
        elif not isinstance(advanced, Advanced):
            raise TypeError(f"GearConfig.advanced must be a gear_hf.config.Advanced, got {type(advanced).__name__}")
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, kwargs.get(f.name, f.default))
        if sizes:
            _warn_former_sizes(sizes)
            current = {k: options.get(k, getattr(advanced, k)) for k in ("hold", "key_buffer", "value_buffer")}
            options["hold"] = hold_from_sizes(sizes, buffer_size=self.buffer_size, compresses=self.method != "fp16",
                                              **current)
        object.__setattr__(self, "advanced", dataclasses.replace(advanced, **options) if options else advanced)
        self._check()

    def __getattr__(self, name: str) -> Any:
        # the advanced options read as attributes (only reached when normal lookup fails)
        if name in ADVANCED_NAMES and "advanced" in self.__dict__:
            return getattr(self.__dict__["advanced"], name)
        raise AttributeError(f"'GearConfig' object has no attribute {name!r}")

    def _check(self) -> None:
        if self.method not in METHODS:
            reject("method", self.method, " | ".join(METHODS))
        if isinstance(self.key_bits, float) and self.key_bits.is_integer():
            object.__setattr__(self, "key_bits", int(self.key_bits))  # 4.0 is 4 (lm-eval may pass floats)
        if isinstance(self.value_bits, bool) or self.value_bits not in BITS:
            reject("value_bits", self.value_bits, "2, 3, 4 or 8")
        for name, low in (("group_size", 1), ("rank_prefill", 0), ("rank_decode", 0), ("sink_tokens", 0),
                          ("buffer_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                reject(name, value, f"an integer >= {low}")
        if isinstance(self.outlier_ratio, bool) or not isinstance(self.outlier_ratio, (int, float)) \
                or not 0.0 <= self.outlier_ratio < 1.0:
            reject("outlier_ratio", self.outlier_ratio, "a number in [0, 1)")
        if self.backend not in BACKENDS:
            reject("backend", self.backend, " | ".join(BACKENDS))
        check(self)
        self._check_token_groups()
        if self.uses_lowrank and max(self.rank_prefill, self.rank_decode) == 0:
            reject("rank_prefill", self.rank_prefill, f"> 0 for method {self.method!r} (or rank_decode > 0)")
        if self.uses_outliers and self.outlier_ratio == 0:
            reject("outlier_ratio", self.outlier_ratio, f"> 0 for method {self.method!r}")

    def _check_token_groups(self) -> None:
        """Groups that run along tokens hold whole packing units, and the buffer holds whole groups."""
        for prefix, axis, group, bits in (("key", self.key_axis, self.key_group, self.key_bits),
                                          ("value", self.value_axis, self.value_group, self.value_bits)):
            planes = prefix == "key" and self.key_bit_allocation == "query"
            unit = codes_per_unit(bits, planes)
            packing = (f"stored as bit planes of {unit} tokens" if planes
                       else f"{unit} codes of {bits} bits fill whole bytes")
            if axis == "channel" and self.compresses and not self.coarse_groups:
                for name, group in ((self._group_field(prefix), group),
                                    ("prompt_group_size", self.prompt_group_size or group)):
                    if group % unit:
                        reject(name, group, f"a multiple of {unit} ({prefix}s are grouped along tokens and {packing})")
        if self.buffer_size % self.chunk_granule:
            if self.buffer_size == _DEFAULT_BUFFER:  # blame what the user wrote, not a default
                for prefix, axis, group in (("key", self.key_axis, self.key_group),
                                            ("value", self.value_axis, self.value_group)):
                    if axis == "channel" and self.buffer_size % group:
                        reject(self._group_field(prefix), group, f"a divisor of buffer_size={self.buffer_size} (the "
                                                                 f"default), or also set buffer_size to a multiple of "
                                                                f"{self.chunk_granule}")
            reject("buffer_size", self.buffer_size, f"a positive multiple of {self.chunk_granule} (the groups "
                                                    "along tokens and the code packing)")

    def _group_field(self, prefix: str) -> str:
        """The field that set the key ("key") or value ("value") group: its own, the group_size shorthand, or
        buffer_size where it caps the shorthand (`_shorthand_group`)."""
        if getattr(self, f"{prefix}_group_size"):
            return f"{prefix}_group_size"
        capped = getattr(self, f"{prefix}_axis") == "channel" and self.buffer_size < self.group_size
        return "buffer_size" if capped else "group_size"

    # What the options resolve to ------------------------------------------------------------------------------------
    @property
    def key_group(self) -> int:
        return self.key_group_size or self._shorthand_group(self.key_axis)

    @property
    def value_group(self) -> int:
        return self.value_group_size or self._shorthand_group(self.value_axis)

    def _shorthand_group(self, axis: str) -> int:
        """group_size, for a stream without its own group: along tokens no longer than a decode chunk."""
        return min(self.group_size, self.buffer_size) if axis == "channel" else self.group_size

    def prompt_group(self, stream: str) -> int:
        """The group length of the prompt chunk for stream "key" or "value" (decode chunks: key_group/value_group)."""
        axis, group = (self.key_axis, self.key_group) if stream == "key" else (self.value_axis, self.value_group)
        return self.prompt_group_size if axis == "channel" and self.prompt_group_size else group

    @property
    def chunk_granule(self) -> int:
        """Decode chunks hold a multiple of this many tokens: every group along tokens, whole code bytes."""
        return self._granule(self.key_group, self.value_group)

    @property
    def prompt_granule(self) -> int:
        """The prompt chunk holds a multiple of this many tokens (prompt_group_size where it applies)."""
        return self._granule(self.prompt_group("key"), self.prompt_group("value"))

    def _granule(self, key_group: int, value_group: int) -> int:
        allocated = self.key_bit_allocation == "query"
        return token_granule(self.method, ((self.key_axis, key_group, self.key_bits, allocated),
                                           (self.value_axis, value_group, self.value_bits, False)))

    @property
    def value_buffer_size(self) -> int | None:
        """Tokens the value buffer holds at most: 2 x buffer_size where values are held a chunk longer, else None."""
        return 2 * self.buffer_size if values_held(self) else None

    @property
    def key_buffer_size(self) -> int | None:
        """As value_buffer_size, for keys (held only with their values)."""
        return 2 * self.buffer_size if keys_held(self) else None

    @property
    def held_for(self) -> float:
        """How long a held chunk stays held, in decode chunks (advanced.held_for where keys are held, else 1)."""
        return effective_held_for(self)

    @property
    def value_statistics(self) -> str:
        """The value groups' statistics in use: advanced.value_statistics where 8-bit ones apply, else "16"."""
        return effective_value_statistics(self)

    # What the method computes -------------------------------------------------------------------------------
    @property
    def compresses(self) -> bool:
        return "backbone" in METHOD_TERMS[self.method]

    @property
    def uses_outliers(self) -> bool:
        return "outliers" in METHOD_TERMS[self.method]

    @property
    def uses_lowrank(self) -> bool:
        return "lowrank" in METHOD_TERMS[self.method]

    @property
    def coarse_groups(self) -> bool:
        """KCVT: one group per whole channel (keys) / whole token vector (values)."""
        return self.method == "kcvt"

    def replace(self, **changes: Any) -> "GearConfig":
        """A copy with `changes`: settings and advanced options by name, or a whole `advanced=`."""
        options = {k: changes.pop(k) for k in list(changes) if k in ADVANCED_NAMES or k in FORMER_SIZE_NAMES}
        advanced = changes.pop("advanced", self.advanced)
        return dataclasses.replace(self, advanced=advanced, **changes, **options)

    # Names, presets, recommendations -------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, bits: int | None = None, **overrides: Any) -> "GearConfig":
        """The named method with the paper's settings (GEAR, Kang et al. 2024); `bits` sets key_bits and value_bits.

        name: a method ("gear"), or a method with its bits as `describe()` writes them: "gear-2", "kivi-4",
        "gear-l-k4v2" (key_bits=4, value_bits=2)."""
        from .presets import paper_preset

        return paper_preset(name, bits, overrides)

    @classmethod
    def recommended(cls, bits_per_element: float | str | None = None, *, name: str | None = None,
                    **overrides: Any) -> "GearConfig":
        """A recommendation by purpose: "smallest", "balanced" (= GearConfig()) or "precise" (also positionally:
        recommended("smallest")), or the one owning the most bits per element not above `bits_per_element` at
        every length measured (T = 512, 1024, 4096; bf16; head_dim 64 and 128). Neither: GearConfig()."""
        from .presets import recommendation

        return recommendation(bits_per_element, name, overrides)

    def describe(self) -> str:
        """The preset name of this config's method and bits ("gear-2", "kivi-k4v2", "fp16"); `preset` reads it.
        Keys with allocated widths add "-query-allocated" to the mean (e.g. "kivi-k3.5v3-query-allocated"): a
        description, not a preset name."""
        if not self.compresses:
            return "fp16"
        bits = f"{self.key_bits}" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        return f"{self.method}-{bits}" + ("-query-allocated" if self.key_bit_allocation == "query" else "")

    @property
    def name(self) -> str:
        """What a user calls this configuration: the recommendation or paper preset it is ("balanced", "gear-2"),
        else describe() + " (custom)"."""
        from .presets import name_of

        return name_of(self)

    # Saving and loading ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every setting and advanced option, plus "gear_config_version": JSON-ready; `from_dict` reads it back."""
        from .saved import to_dict

        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GearConfig":
        """The config a `to_dict` of any gear_hf version wrote (a missing field takes the default of the version the
        dict names, not today's). Unknown keys, a missing or newer version raise a ValueError."""
        from .saved import from_dict

        return from_dict(data)


_DEFAULT_BUFFER = GearConfig.__dataclass_fields__["buffer_size"].default
SETTING_NAMES = tuple(f.name for f in dataclasses.fields(GearConfig) if f.name != "advanced")
# the held buffers' sizes as earlier releases set them (value_buffer_size / key_buffer_size: None or 2 x buffer_size):
# still taken by the constructor and `replace`, with a DeprecationWarning, as the `hold` they mean
FORMER_SIZE_NAMES = ("value_buffer_size", "key_buffer_size")


def _warn_former_sizes(sizes: dict[str, Any]) -> None:
    warnings.warn(f"GearConfig({', '.join(f'{k}=...' for k in sizes)}): the held buffers' sizes are now "
                  f"advanced.hold ('none' | 'values' | 'both'; held tokens stay 2 x buffer_size)", DeprecationWarning,
                  stacklevel=4)


def expect_config(value: Any, argument: str) -> None:
    """A TypeError naming `argument` unless value is a GearConfig, with the way to make one from what was given."""
    if isinstance(value, GearConfig):
        return
    hint = {str: f" (a name: GearConfig.preset({value!r}) or GearConfig.recommended({value!r}))",
            dict: " (a dict: GearConfig(**fields), or GearConfig.from_dict(d) for one from to_dict())"}
    raise TypeError(f"{argument} must be a gear_hf.GearConfig, got {type(value).__name__}"
                    + hint.get(type(value), ""))
