"""The quantized backbone D̂: asymmetric min/max (or range-searched) group quantization, packed codes.

Fields (x [B,H,n,d], g the group, P(m) the bytes of m packed codes, S the allocated widths' sum):
    codes         uint8  [P(n), d] (axis="channel"), [n, P(d rounded up to a packing unit)] (axis="token"),
                         or [n/8, S] bit planes (widths allocated per channel)
    channel_bits  uint8  [1, d] each channel's width (allocated specs), else [0, d]
    scale/minimum side   [n/g, d] (axis="channel") or [n, ceil(d/g)] (axis="token"); with 8-bit statistics
                  uint8: the scale's and the zero point's codes (`quant.stats8`)
"""

from __future__ import annotations

import torch

from .. import quant
from ..allocation import even_channel_bits
from ..spec import check_channel_bits
from .base import DecodeState, EncodeState, Field, Term


def allocated_width_sum(mean_bits: float, d: int) -> int:
    """Bits per token of one (row, head) whose d key channels have widths of mean `mean_bits` (`allocation`)."""
    return int(even_channel_bits(1, 1, d, mean_bits).sum())


def _padded_to_unit(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Value codes [B,H,n,d] padded along channels to whole packing units (only when d is not a multiple)."""
    unit = quant.pack_unit(bits)[0]
    pad = (-codes.shape[-1]) % unit
    return torch.nn.functional.pad(codes, (0, pad)) if pad else codes


class QuantizedBackbone(Term):
    name = "backbone"
    builtin = True

    def active(self, spec) -> bool:
        return True

    def fields(self, spec, n, d, side):
        group = spec.group_for(n, d)
        if spec.allocated:
            codes = (n // quant.PLANE_TOKENS, allocated_width_sum(spec.bits, d))
        elif spec.axis == "channel":
            codes = (quant.packed_length(n, spec.bits), d)
        else:
            unit = quant.pack_unit(spec.bits)[0]
            codes = (n, quant.packed_length(-(-d // unit) * unit, spec.bits))
        stats = (n // group, d) if spec.axis == "channel" else (n, -(-d // group))
        stats_dtype = torch.uint8 if spec.stats == "8" else side
        return (Field("codes", codes, torch.uint8, "codes"),
                Field("channel_bits", (1 if spec.allocated else 0, d), torch.uint8, "scales"),
                Field("scale", stats, stats_dtype, "scales"),
                Field("minimum", stats, stats_dtype, "scales"))

    def quantize(self, st: EncodeState) -> None:
        spec = st.spec
        if st.valid is not None:  # padding takes no part in any statistic
            padding = ~st.valid[:, None, :, None]
            st.exclude = padding.expand(st.x.shape) if st.exclude is None else st.exclude | padding
        check_channel_bits(spec, st.channel_bits)
        bits = spec.bits if st.channel_bits is None else st.channel_bits.unsqueeze(2)  # [B,H,1,d]
        if spec.stats == "8":  # stored as codes; the encode state keeps their values (later terms read floats)
            st.codes, scale_code, zero_code = quant.quantize(st.work, bits, spec.axis, st.group, exclude=st.exclude,
                                                             stats="8")
            st.out["scale"], st.out["minimum"] = scale_code, zero_code
            st.minimum, st.scale = quant.decode_stats8(scale_code, zero_code, quant.top_code(spec.bits))
            return
        if st.quantize_pack is None or spec.range_search or spec.allocated:  # (the accelerated one: min/max, one width)
            st.codes, st.scale, st.minimum = quant.quantize(st.work, bits, spec.axis, st.group, exclude=st.exclude,
                                                            stats_dtype=st.side, range_search=spec.range_search)
        else:
            st.packed, st.scale, st.minimum = st.quantize_pack(st.work, spec.bits, spec.axis, st.group, st.exclude,
                                                               st.side)
            st.codes = quant.unpack_codes(st.packed, spec.bits, spec.pack_dim)[..., : st.d]
        st.out["scale"], st.out["minimum"] = st.scale, st.minimum

    def pack(self, st: EncodeState) -> None:
        spec = st.spec
        B, H, _, d = st.x.shape
        if spec.allocated:
            packed = quant.pack_planes(st.codes, st.channel_bits.unsqueeze(2))
        elif st.packed is not None:  # the accelerated quantizer's bytes, unless a later stage changed codes
            packed = st.packed
        else:
            padded = _padded_to_unit(st.codes, spec.bits) if spec.axis == "token" else st.codes
            packed = quant.pack_codes(padded, spec.bits, spec.pack_dim)
        st.out["codes"] = packed
        st.out["channel_bits"] = st.channel_bits.unsqueeze(2) if st.channel_bits is not None \
            else st.x.new_zeros(B, H, 0, d, dtype=torch.uint8)

    def dequantize(self, ds: DecodeState) -> None:
        spec, chunk = ds.spec, ds.chunk
        codes = ds.codes
        if codes is None:
            if spec.allocated:
                codes = quant.unpack_planes(chunk.codes, chunk.channel_bits)
            else:
                codes = quant.unpack_codes(chunk.codes, spec.bits, spec.pack_dim)[..., : ds.d]
        out = ds.out if ds.direct else None
        scale, minimum = chunk.scale, chunk.minimum
        if spec.stats == "8":
            minimum, scale = quant.decode_stats8(scale, minimum, quant.top_code(spec.bits))
        ds.x = quant.dequantize(codes, scale, minimum, spec.axis, ds.group, ds.d, torch.float32,
                                out=out)  # [B,H,C*n,d]
