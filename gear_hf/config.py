"""`GearConfig`: the one description of how a KV cache is compressed.

A frozen dataclass validated at construction, so a bad value fails where it is written, naming the field,
the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .backends import BACKEND_NAMES as BACKENDS
from .compress.quant import BITS, PLANE_TOKENS
from .compress.spec import FACTOR_BITS
from .compress.terms import METHOD_TERMS, registered_terms
from .config_buffer import AUTO_FIELDS, check_buffers
from .config_groups import code_unit, token_granule
from .config_versions import CONFIG_VERSION, DEFAULTS_BY_VERSION, VERSION_KEY  # (also gear_hf.config's names)
from .preset_names import METHODS, parse_preset_name  # (parse_preset_name: also gear_hf.config's)
from .recommended import DEFAULT_RECOMMENDED, RECOMMENDED  # (RECOMMENDED: also gear_hf.config's)

ROTATIONS = ("none", "keys", "values", "both")
AXES = ("channel", "token")
KEY_BIT_ALLOCATIONS = ("uniform", "query")


# The paper's settings (GEAR, Kang et al. 2024): `preset` starts from these, whatever GearConfig()'s defaults.
# Low-rank factors are stored in int8 (the paper keeps them in fp16; factor_bits=16 restores that): measured on
# SmolLM2 captures, int8 factors move the attention-output error of gear-2/gear-4/gear-l-2/gear-l-4 by < 0.3%
# (issue 9's rule for a default: < 2%) and save 0.53 bits/element on d=64 heads (docs/results.md, "Accuracy per byte").
PAPER_FIELDS: dict[str, Any] = dict(key_bits=4, value_bits=4, group_size=64, rank_prefill=4, rank_decode=2,
                                    power_iters=3, outlier_ratio=0.02, buffer_size=64, sink_tokens=0,
                                    key_axis="channel", value_axis="token", pre_rope=True, key_group_size=None,
                                    value_group_size=None, rotation="none", factor_bits=8, range_search="none",
                                    prompt_group_size=None, key_bit_allocation="uniform", key_buffer="full",
                                    value_buffer="full", value_statistics="16", value_buffer_size=None,
                                    key_buffer_size=None, key_buffer_centered=False, value_buffer_centered=False,
                                    value_chunks_centered=False)


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"GearConfig.{field}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class GearConfig:
    """How keys and values are compressed.

    method:        fp16 | kivi | kcvt | outlier | gear-l | gear  (see DESIGN §2)
    key_bits, value_bits: 2, 3, 4 or 8 (ignored by fp16); with key_bit_allocation="query", key_bits is the mean
                   width of a key channel: a multiple of 1/8 in [1, 8] (e.g. 3.5)
    key_bit_allocation: "uniform" (every key channel key_bits wide) or "query" (beyond GEAR: each row's key
                   channels get 1-8 bits, chosen when the row's first chunk is compressed, where the queries seen
                   so far times the key ranges make an error cost most; compress/allocation.py; stored as bit
                   planes, which the torch path and the fused kernel read). Needs key_axis="channel", no outliers,
                   keys not rotated.
    group_size:    g, tokens per key group (per channel) and channels per value group (per token): the shorthand
                   for both of the next two
    key_group_size / value_group_size: the key group (tokens) / value group (channels) when they differ;
                   None = group_size, capped at buffer_size for a stream grouped along tokens (a decode chunk holds
                   buffer_size tokens; `key_group` / `value_group` give the group in use)
    prompt_group_size: tokens per group in the prompt chunk, for the streams grouped along tokens (keys; values
                   with value_axis="channel"); None = their decode group. The prompt chunk is compressed once, so
                   longer groups there cost less side information without a longer buffer (the buffer holds
                   whole decode groups only); the prompt's tail past a whole prompt group goes to decode chunks.
    rank_prefill:  low-rank rank of the prompt chunk; rank_decode: of each decode chunk
    power_iters:   power iterations of the low-rank fit
    outlier_ratio: fraction s of each vector kept exactly (s/2 largest, s/2 smallest)
    buffer_size:   n_b, newest tokens kept out of the chunks (in key_buffer / value_buffer's format); a multiple of
                   the groups along tokens
    sink_tokens:   first tokens of each row never compressed
    key_buffer:    how the buffer holds keys until their chunk is compressed: "full" (the model's dtype, the paper),
                   "int8-rotated" (beyond GEAR; the default: 8 bits per token after a Walsh–Hadamard rotation along
                   head_dim, with a 16-bit scale and minimum, before RoPE: the rotation spreads a few large channels,
                   which would set an unrotated token's whole range, e.g. Qwen2.5's), "int8" (the same unrotated:
                   config versions 2-3's default) or "int4" (4 bits per token after the rotation); re-quantized in the
                   chunk's format when the chunk is compressed; fp16 ignores both (it keeps every token)
    value_buffer:  "full" (the model's dtype), "int8" / "int8-rotated" / "int4" (as key_buffer's) or "final" (beyond
                   GEAR: each value stored on arrival in the format its chunk stores, moved into the chunk unchanged:
                   no second rounding; needs values grouped per token with no low-rank term)
    value_buffer_size: "auto" (the default: 2 x buffer_size where value_buffer is per token, else None), None
                   (values leave the buffer with their keys) or 2 x buffer_size (beyond GEAR): values stay
                   in value_buffer's per-token format one decode chunk longer than their keys, so the newest
                   buffer_size..2 x buffer_size values are buffered while keys flush every buffer_size tokens
                   (results/tail); the held chunk is compressed from its buffered codes at the next flush (or
                   earlier: held_for). Needs a per-token value_buffer ("int8", "int8-rotated" or "int4"). "auto" is
                   resolved when the config is made (the field then holds the number; `replace` re-resolves it)
    key_buffer_size: None (keys leave the buffer every buffer_size tokens), 2 x buffer_size (beyond GEAR: keys stay
                   in key_buffer's per-token format one decode chunk longer too, like values with value_buffer_size:
                   the newest decode chunk's keys are read at 8 bits rather than at key_bits: results/tail),
                   or "auto" (the default: 2 x buffer_size where key_buffer is per token and values are held,
                   else None; resolved as value_buffer_size is). Needs a per-token key_buffer and value_buffer_size
                   (keys are held only with their values)
    held_for:      how long a held chunk stays held, in decode chunks (beyond GEAR): it is compressed once
                   ceil(held_for x buffer_size) newer tokens are buffered after it, so the buffer never holds more
                   than buffer_size + that - 1 tokens (the buffer's bits peak right before a chunk leaves it; fewer
                   tokens buffered pay for wider keys). 1.0: until the next chunk flushes (config versions 5-6);
                   below 1 only with keys held too. "auto" (the default): 0.5 where both streams are held, else 1.0;
                   resolved as value_buffer_size is. Ignored where nothing is held
    key_buffer_centered / value_buffer_centered: (beyond GEAR) a per-token buffer codes each token centered per
                   channel (keys also scaled by a power of two), fitted to the row's prompt: a bias such as Qwen2's sets
                   no token's range (gear_hf/channel_centers.py; 2.5 / 1 bytes a row, head, channel). Ignored for "full"
    value_chunks_centered: (beyond GEAR) the value chunks coded centered by the value buffer's centers too (no byte
                   more; the kernels attend every value centered, then add the centers once). Ignored where the value
                   buffer is not centered
    key_axis / value_axis: "channel" (groups run along tokens) or "token" (groups run along channels)
    pre_rope:      compress keys before rotary embedding and rotate them when read
    rotation:      "none" | "keys" | "values" | "both": an orthonormal Walsh–Hadamard rotation along head_dim
                   before compressing (of the stored pre-RoPE keys), undone at reconstruction (before RoPE)
    factor_bits:   16 (low-rank factors in 16 bits) or 8 (int8, one 16-bit absmax scale per column)
    value_statistics: "auto" (the default: "8" where it applies, else "16"; resolved when the config is made, as
                   value_buffer_size's), "16" (each value group's scale and minimum in 16 bits) or "8" (beyond GEAR:
                   an 8-bit scale on a 2^(1/8) grid and an 8-bit zero point, `compress.quant.stats8`: 0.25
                   bit/element less on d=64 heads; values grouped per token, min/max ranges; compressed by the torch
                   oracle, read by it, the numba CPU kernels and the Triton kernels)
    range_search:  "none" | "keys" | "values" | "both": choose each quantization group's range (scale, minimum)
                   among clipped candidates for the least squared error of its entries instead of its min/max
                   (beyond GEAR; same stored format)
    Side information (scales, minimums, outlier values, factors) is stored in 16 bits whatever the model
    dtype: bf16 for fp32/bf16 models, fp16 for fp16 models.
    backend:       "auto" (Triton kernels on CUDA tensors, numba CPU kernels on CPU tensors, when installed;
                   else torch), "torch", "triton" or "numba" (forced); GEAR_HF_BACKEND overrides "auto"
    """

    # defaults: RECOMMENDED[DEFAULT_RECOMMENDED] (checked by tests/test_side_info.py); presets: PAPER_FIELDS
    method: str = "kivi"
    key_bits: int | float = 3  # a float only as the mean of allocated widths (key_bit_allocation="query")
    value_bits: int = 3
    group_size: int = 128
    rank_prefill: int = 4
    rank_decode: int = 2
    power_iters: int = 3
    outlier_ratio: float = 0.02
    buffer_size: int = 64
    sink_tokens: int = 4
    key_axis: str = "channel"
    value_axis: str = "token"
    pre_rope: bool = True
    backend: str = "auto"
    key_group_size: int | None = None
    value_group_size: int | None = None
    rotation: str = "values"
    factor_bits: int = 8  # int8 factors moved gear-2's attention-output error by < 0.1% (docs/results.md)
    range_search: str = "none"
    prompt_group_size: int | None = 256
    key_bit_allocation: str = "query"
    extra_terms: tuple[str, ...] = ()  # registered terms beyond GEAR's (gear_hf.compress.terms), both streams
    key_buffer: str = "int8-rotated"
    value_buffer: str = "int4"
    value_statistics: str = "auto"
    value_buffer_size: int | str | None = "auto"
    key_buffer_size: int | str | None = "auto"
    held_for: float | str = "auto"
    key_buffer_centered: bool = True
    value_buffer_centered: bool = True
    value_chunks_centered: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", self.method, " | ".join(METHODS))
        for name, (_, resolve) in AUTO_FIELDS.items():  # (before the checks: they see the resolved value)
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, resolve(self))
        if self.key_bit_allocation not in KEY_BIT_ALLOCATIONS:
            _fail("key_bit_allocation", self.key_bit_allocation, " | ".join(KEY_BIT_ALLOCATIONS))
        if isinstance(self.key_bits, float) and self.key_bits.is_integer():
            object.__setattr__(self, "key_bits", int(self.key_bits))  # 4.0 is 4 (lm-eval may pass floats)
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            if name == "key_bits" and self.key_bit_allocation == "query":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 8 \
                        or value * PLANE_TOKENS != int(value * PLANE_TOKENS):
                    _fail(name, value, "a multiple of 1/8 in [1, 8] (the mean bits of a key channel with "
                                       "key_bit_allocation='query')")
            elif isinstance(value, bool) or value not in BITS:
                _fail(name, value, "2, 3, 4 or 8" + (" (or, with key_bit_allocation='query', a mean such as 3.5)"
                                                     if name == "key_bits" else ""))
        for name, low in (("group_size", 1), ("rank_prefill", 0), ("rank_decode", 0), ("power_iters", 1),
                          ("sink_tokens", 0), ("buffer_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                _fail(name, value, f"an integer >= {low}")
        for name in ("key_group_size", "value_group_size", "prompt_group_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                _fail(name, value, "None (= group_size) or an integer >= 1" if name != "prompt_group_size" else
                      "None (= the decode groups) or an integer >= 1")
        if self.rotation not in ROTATIONS:
            _fail("rotation", self.rotation, " | ".join(ROTATIONS))
        if isinstance(self.factor_bits, bool) or self.factor_bits not in FACTOR_BITS:
            _fail("factor_bits", self.factor_bits, "16 or 8")
        self._check_extra_terms()
        if self.range_search not in ROTATIONS:
            _fail("range_search", self.range_search, " | ".join(ROTATIONS))
        if self.prompt_group_size is not None and self.coarse_groups:
            _fail("prompt_group_size", self.prompt_group_size, "None for method 'kcvt' (one group per whole channel)")
        self._check_token_groups()
        if isinstance(self.outlier_ratio, bool) or not isinstance(self.outlier_ratio, (int, float)) \
                or not 0.0 <= self.outlier_ratio < 1.0:
            _fail("outlier_ratio", self.outlier_ratio, "a number in [0, 1)")
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                _fail(name, getattr(self, name), " | ".join(AXES))
        if self.backend not in BACKENDS:
            _fail("backend", self.backend, " | ".join(BACKENDS))
        if self.key_bit_allocation == "query" and self.compresses:
            for field, value, bad, allowed in (
                    ("key_axis", self.key_axis, self.key_axis != "channel", "'channel'"),
                    ("method", self.method, self.uses_outliers, "a method without outliers (kivi, kcvt, gear-l)"),
                    ("rotation", self.rotation, self.rotation in ("keys", "both"), "'none' or 'values'")):
                if bad:
                    _fail(field, value, f"{allowed} with key_bit_allocation='query' (widths per key channel; "
                                        "key_bit_allocation='uniform' for one width)")
        if not isinstance(self.pre_rope, bool):
            _fail("pre_rope", self.pre_rope, "True or False")
        check_buffers(self, _fail)
        if self.uses_lowrank and max(self.rank_prefill, self.rank_decode) == 0:
            _fail("rank_prefill", self.rank_prefill, f"> 0 for method {self.method!r} (or rank_decode > 0)")
        if self.uses_outliers and self.outlier_ratio == 0:
            _fail("outlier_ratio", self.outlier_ratio, f"> 0 for method {self.method!r}")

    def _check_extra_terms(self) -> None:
        if isinstance(self.extra_terms, (list, str)):
            object.__setattr__(self, "extra_terms", (self.extra_terms,) if isinstance(self.extra_terms, str)
                               else tuple(self.extra_terms))
        extra = [t.name for t in registered_terms() if not t.builtin]
        for name in self.extra_terms:
            if name not in extra:
                _fail("extra_terms", self.extra_terms, f"names of registered extra terms ({extra or 'none'}; "
                                                       "gear_hf.compress.terms.register_term)")

    def _check_token_groups(self) -> None:
        """Groups that run along tokens hold whole packing units, and the buffer holds whole groups."""
        for prefix, axis, group, bits in (("key", self.key_axis, self.key_group, self.key_bits),
                                          ("value", self.value_axis, self.value_group, self.value_bits)):
            unit = code_unit(vars(self), prefix)
            planes = prefix == "key" and self.key_bit_allocation == "query"
            packing = (f"stored as bit planes of {unit} tokens" if planes
                       else f"{unit} codes of {bits} bits fill whole bytes")
            if axis == "channel" and self.compresses and not self.coarse_groups:
                for name, group in ((self._group_field(prefix), group),
                                    ("prompt_group_size", self.prompt_group_size or group)):
                    if group % unit:
                        _fail(name, group, f"a multiple of {unit} ({prefix}s are grouped along tokens and {packing})")
        if self.buffer_size % self.chunk_granule:
            if self.buffer_size == _DEFAULT_BUFFER:  # blame what the user wrote, not a default
                for prefix, axis, group in (("key", self.key_axis, self.key_group),
                                            ("value", self.value_axis, self.value_group)):
                    if axis == "channel" and self.buffer_size % group:
                        _fail(self._group_field(prefix), group, f"a divisor of buffer_size={self.buffer_size} (the "
                                                                f"default), or also set buffer_size to a multiple of "
                                                                f"{self.chunk_granule}")
            _fail("buffer_size", self.buffer_size, f"a positive multiple of {self.chunk_granule} (the groups "
                                                  "along tokens and the code packing)")

    def _group_field(self, prefix: str) -> str:
        """The field that set the key ("key") or value ("value") group: its own, the group_size shorthand, or
        buffer_size where it caps the shorthand (`_shorthand_group`)."""
        if getattr(self, f"{prefix}_group_size"):
            return f"{prefix}_group_size"
        capped = getattr(self, f"{prefix}_axis") == "channel" and self.buffer_size < self.group_size
        return "buffer_size" if capped else "group_size"

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
        return token_granule(vars(self), key_group, value_group)

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
        """A copy with `changes`; a field that holds what "auto" gave it is resolved again when a field it depends on
        changes (held values follow the buffer they are held in)."""
        for name, (depends_on, resolve) in AUTO_FIELDS.items():
            if name not in changes and changes.keys() & depends_on and getattr(self, name) == resolve(self):
                changes[name] = "auto"
        return dataclasses.replace(self, **changes)

    # Presets --------------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, bits: int | None = None, **overrides: Any) -> "GearConfig":
        """The named method with the paper's defaults; `bits` sets both key_bits and value_bits.

        name: a method ("gear"), or a method with its bits as `describe()` writes them: "gear-2", "kivi-4",
        "gear-l-k4v2" (key_bits=4, value_bits=2)."""
        method, name_bits = parse_preset_name(name)
        if bits is not None and (isinstance(bits, bool) or bits not in BITS):
            raise ValueError(f"GearConfig.preset({name!r}, bits={bits!r}): bits={bits!r} is invalid; allowed: "
                             f"{', '.join(map(str, BITS))} (bits sets both key_bits and value_bits)")
        fields: dict[str, Any] = {**PAPER_FIELDS, "method": method}
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

    @classmethod
    def recommended(cls, bits_per_element: float | str | None = None, *, name: str | None = None,
                    **overrides: Any) -> "GearConfig":
        """What the measured frontier says to pick (RECOMMENDED): the configuration owning the most bits per element
        not above `bits_per_element`, or the one called `name` (also taken positionally: recommended("lean"));
        neither: the default (= GearConfig()).

        The bits are what the cache owns on average over a bf16 generation from T=1024 to 4096, on head_dim 64 (per-
        group side information weighs more on smaller heads; at shorter T the buffer of up to buffer_size 16-bit
        tokens weighs more: see RECOMMENDED's comment)."""
        if isinstance(bits_per_element, str):  # recommended("lean"): a name
            bits_per_element, name = (None, bits_per_element) if name is None else (bits_per_element, name)
        if bits_per_element is not None and name is not None:
            raise ValueError("GearConfig.recommended takes bits_per_element or name, not both")
        if bits_per_element is not None and (isinstance(bits_per_element, bool) or not isinstance(
                bits_per_element, (int, float)) or math.isnan(bits_per_element)):
            _fail("recommended bits_per_element", bits_per_element,
                  f"a number >= {RECOMMENDED[0][1]} (the cheapest measured configuration), or a name: "
                  + " | ".join(n for n, _, _ in RECOMMENDED))
        names = [n for n, _, _ in RECOMMENDED]
        if name is None and bits_per_element is None:
            name = DEFAULT_RECOMMENDED
        if name is not None:
            if name not in names:
                _fail("recommended name", name, " | ".join(names))
            fields = next(f for n, _, f in RECOMMENDED if n == name)
        else:
            fitting = [f for _, bits, f in RECOMMENDED if bits <= bits_per_element]
            if not fitting:
                _fail("recommended bits_per_element", bits_per_element,
                      f"a number >= {RECOMMENDED[0][1]} (the cheapest measured configuration)")
            fields = fitting[-1]
        merged = {**PAPER_FIELDS, **fields, **overrides}
        if "buffer_size" not in overrides and "buffer_size" not in fields:  # the paper's 64, or whole longer groups
            groups = (merged["key_group_size"] or merged["group_size"],
                      merged["value_group_size"] or merged["group_size"])
            merged["buffer_size"] = math.lcm(PAPER_FIELDS["buffer_size"], token_granule(merged, *groups))
        return cls(**merged)

    # Saving and loading ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, plus "gear_config_version" (CONFIG_VERSION): JSON-ready; `from_dict` reads it back to the
        same config in any later gear_hf, whatever GearConfig()'s defaults have become by then."""
        return {VERSION_KEY: CONFIG_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GearConfig":
        """The config a `to_dict` wrote. A field missing from `data` takes the default of the format version the
        dict names (DEFAULTS_BY_VERSION), not today's GearConfig() default, so a saved config keeps its meaning when
        the defaults move. Unknown keys, a missing or newer version raise a ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"GearConfig.from_dict takes a dict (from GearConfig.to_dict()), not "
                             f"{type(data).__name__}")
        fields = dict(data)
        version = fields.pop(VERSION_KEY, None)
        known = ", ".join(map(str, DEFAULTS_BY_VERSION))
        if version is None:
            raise ValueError(f"GearConfig.from_dict: the dict has no {VERSION_KEY!r} (GearConfig.to_dict() writes it; "
                             f"known versions: {known}; add {VERSION_KEY!r}: {CONFIG_VERSION} for a dict written "
                             f"for this gear_hf)")
        if isinstance(version, bool) or version not in DEFAULTS_BY_VERSION:
            newer = isinstance(version, int) and not isinstance(version, bool) and version > CONFIG_VERSION
            raise ValueError(f"GearConfig.from_dict: {VERSION_KEY}={version!r} is "
                             f"{'newer than this gear_hf reads' if newer else 'invalid'}; allowed: {known}"
                             + (" (upgrade gear_hf to read it)" if newer else ""))
        defaults = DEFAULTS_BY_VERSION[version]
        unknown = sorted(set(fields) - set(defaults))
        if unknown:
            raise ValueError(f"GearConfig.from_dict: unknown key(s) {unknown} for {VERSION_KEY} {version}; "
                             f"keys: {VERSION_KEY}, {', '.join(defaults)}")
        return cls(**{**defaults, **fields})

    def describe(self) -> str:
        """The preset name of this config's method and bits ("gear-2", "kivi-k4v2", "fp16"); `preset` reads it.
        Keys with allocated widths add "-query-allocated" to the mean (e.g. "kivi-k3.5v3-query-allocated"): a
        description, not a preset name."""
        if not self.compresses:
            return "fp16"
        bits = f"{self.key_bits}" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        return f"{self.method}-{bits}" + ("-query-allocated" if self.key_bit_allocation == "query" else "")


_DEFAULT_BUFFER = GearConfig.__dataclass_fields__["buffer_size"].default


def expect_config(value: Any, argument: str) -> None:
    """A TypeError naming `argument` unless value is a GearConfig, with the way to make one from what was given."""
    if isinstance(value, GearConfig):
        return
    hint = {str: f" (a name: GearConfig.preset({value!r}) or GearConfig.recommended(name={value!r}))",
            dict: " (a dict: GearConfig(**fields), or GearConfig.from_dict(d) for one from to_dict())"}
    raise TypeError(f"{argument} must be a gear_hf.GearConfig, got {type(value).__name__}"
                    + hint.get(type(value), ""))
