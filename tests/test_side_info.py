"""3-bit packing, outlier count and exactness, 16-bit side information, 8-bit
factors, the Walsh–Hadamard rotation, separate key/value group sizes."""

from __future__ import annotations

import types

import pytest
import torch

import gear_hf
from gear_hf.cache import GearCache
from gear_hf.compress import (
    ChunkSpec,
    compress,
    decompress,
    hadamard,
    outliers_per_vector,
    pack_codes,
    quant,
    rotate,
    select_outliers,
    side_dtype,
    unpack_codes,
)


def _x(B=1, H=2, n=64, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, n, d, generator=g)
    x[..., 3] *= 12
    return x.to(dtype)


@pytest.mark.parametrize("dim", [-1, -2])
def test_3_bit_codes_round_trip_in_3_bytes_per_8(dim):
    codes = torch.randint(0, 8, (2, 3, 16, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_codes(codes, 3, dim)
    assert packed.shape[dim] == codes.shape[dim] * 3 // 8
    assert torch.equal(unpack_codes(packed, 3, dim), codes)


def test_3_bit_layout_is_a_2_bit_plane_then_a_1_bit_plane():
    codes = torch.tensor([[1, 7, 2, 4, 0, 3, 6, 5]], dtype=torch.uint8)
    b0, b1, b2 = pack_codes(codes, 3, -1)[0].tolist()
    assert b0 == 1 | (3 << 2) | (2 << 4) | (0 << 6)
    assert b1 == 0 | (3 << 2) | (2 << 4) | (1 << 6)
    assert b2 == 0b11001010  # high bits of 1,7,2,4,0,3,6,5 -> 0,1,0,1,0,0,1,1 (bit j = code j)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(codes[:, :4], 3, -1)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_3_bits_sit_between_2_and_4(axis):
    x = _x()
    errors = []
    for bits in (2, 3, 4):
        spec = ChunkSpec(bits, axis, 32, 0.0, 0)
        c = compress(x, spec)
        errors.append(float((decompress(c, spec, 64, 64, torch.float32) - x).norm() / x.norm()))
        assert c.codes.numel() == x.numel() * bits // 8
    assert errors[0] > errors[1] > errors[2]


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("ratio", [0.01, 0.02, 0.05])
@pytest.mark.parametrize("n", [64, 1024])
def test_stored_sparse_count_follows_the_ratio(axis, ratio, n):
    """round(ratio * numel) entries to within one per vector; no per-vector minimum of one."""
    x = _x(n=n)
    chunk = compress(x, ChunkSpec(2, axis, 64, ratio, 0))
    vectors = x.shape[1] * (64 if axis == "channel" else n)
    stored = chunk.sparse_values.numel()
    assert stored == chunk.sparse_index.numel()
    assert abs(stored - round(ratio * x.numel())) <= vectors / 2 + 1
    assert outliers_per_vector(16, 0.02) == 0  # a short vector keeps none
    assert chunk.sparse_index.dtype == (torch.uint8 if (n if axis == "channel" else 64) <= 256 else torch.int16)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("factor_bits", [16, 8])
def test_side_information_is_16_bit_whatever_the_model_dtype(model_dtype, factor_bits):
    x = _x(dtype=model_dtype)
    chunk = compress(x, ChunkSpec(2, "channel", 32, 0.02, 2, factor_bits=factor_bits))
    side = torch.float16 if model_dtype == torch.float16 else torch.bfloat16
    assert side_dtype(model_dtype) == side
    assert chunk.scale.dtype == chunk.minimum.dtype == chunk.sparse_values.dtype == side
    if factor_bits == 16:
        assert chunk.lowrank_a.dtype == chunk.lowrank_b.dtype == side
        assert chunk.lowrank_a_scale.numel() == 0
    else:
        assert chunk.lowrank_a.dtype == chunk.lowrank_b.dtype == torch.int8
        assert chunk.lowrank_a_scale.dtype == chunk.lowrank_b_scale.dtype == side
        assert chunk.lowrank_a_scale.shape == (1, 2, 1, 2)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("factor_bits", [8, 16])  # 8: the presets' default
def test_cache_stores_side_information_in_16_bits(model_dtype, factor_bits):
    config = gear_hf.GearConfig.preset("gear", bits=2, group_size=16, buffer_size=16, factor_bits=factor_bits)
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config)
    k, v = _x(n=40, d=64, dtype=model_dtype), _x(n=40, d=64, seed=1, dtype=model_dtype)
    cache.store_and_read(0, k, v)
    factors = ("lowrank_a", "lowrank_b") if factor_bits == 16 else ("lowrank_a_scale", "lowrank_b_scale")
    for stream in (cache.layers[0].key_stream, cache.layers[0].value_stream):
        for name in ("scale", "minimum", "sparse_values", *factors):
            assert stream.prefill.fields[name].dtype == torch.bfloat16, name
        if factor_bits == 8:
            assert stream.prefill.fields["lowrank_a"].dtype == stream.prefill.fields["lowrank_b"].dtype == torch.int8
        assert stream.buffer.data.dtype == model_dtype  # full-precision tokens stay in the model dtype


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_outliers_are_exact_in_the_model_dtype(model_dtype, axis):
    """D̂ + S equals x at the chosen entries (the reconstruction rounded to the model dtype, no low rank), except
    where every admissible D̂ lies on a rounding midpoint of x's grid and S has no finer step (then one ulp off)."""
    x = _x(n=128, dtype=model_dtype) * 7
    spec = ChunkSpec(2, axis, 32, 0.05, 0)
    _, _, mask = select_outliers(x, axis, 0.05)
    y = decompress(compress(x, spec), spec, 128, 64, model_dtype)
    assert mask.sum() == 768
    exact = y[mask] == x[mask]
    assert exact.float().mean() >= 0.99, int((~exact).sum())
    ulp = (torch.nextafter(x[mask].abs(), torch.tensor(float("inf"), dtype=model_dtype)) - x[mask].abs()).float()
    assert ((y[mask].float() - x[mask].float()).abs() <= ulp).all()
    plain = ChunkSpec(2, axis, 32, 0.0, 0)  # without S, those entries are far off
    plain_error = (decompress(compress(x, plain), plain, 128, 64, model_dtype)[mask].float() - x[mask].float()).norm()
    assert plain_error > 100 * (y[mask].float() - x[mask].float()).norm()


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for d in (16, 64, 128):
        h = hadamard(d)
        assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-6) and torch.equal(h, h.T)
    x = _x()
    assert torch.allclose(rotate(rotate(x)), x, atol=1e-5, rtol=1e-6)
    x48 = torch.randn(3, 48)  # not a power of two: three blocks of 16
    assert torch.allclose(hadamard(48) @ hadamard(48).T, torch.eye(48), atol=1e-6)
    assert torch.allclose(rotate(x48), x48 @ hadamard(48), atol=1e-6)
    assert torch.allclose(rotate(rotate(x48)), x48, atol=1e-5)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_rotation_is_undone_at_decompress(axis):
    """8-bit codes, no outliers: the reconstruction is x to quantization precision in the original basis, and
    the stored codes are those of the rotated x."""
    x = _x()
    spec = ChunkSpec(8, axis, 32, 0.0, 0, rotate=True)
    chunk = compress(x, spec)
    y = decompress(chunk, spec, 64, 64, torch.float32)
    assert float((y - x).norm() / x.norm()) < 5e-3
    codes, _, _ = quant.quantize(rotate(x), 8, axis, 32, stats_dtype=torch.bfloat16)
    assert torch.equal(chunk.codes, codes)


def test_rotation_spreads_an_outlier_channel_for_per_token_values():
    x = _x()  # channel 3 is 12x larger: per-token groups follow it
    errs = {}
    for rot in (False, True):
        spec = ChunkSpec(2, "token", 64, 0.0, 0, rotate=rot)
        errs[rot] = float((decompress(compress(x, spec), spec, 64, 64, torch.float32) - x).norm() / x.norm())
    assert errs[True] < errs[False]


def test_8_bit_factors_cost_half_and_keep_the_correction():
    x = _x(n=128)
    spec16, spec8 = ChunkSpec(2, "channel", 32, 0.0, 4), ChunkSpec(2, "channel", 32, 0.0, 4, factor_bits=8)
    kivi = ChunkSpec(2, "channel", 32, 0.0, 0)
    err = {s: float((decompress(compress(x, s), s, 128, 64, torch.float32) - x).norm()) for s in (spec16, spec8, kivi)}
    assert err[spec8] < err[kivi] and err[spec8] <= err[spec16] * 1.02
    c16, c8 = compress(x, spec16), compress(x, spec8)
    bytes_of = lambda c: sum(t.numel() * t.element_size() for t in (c.lowrank_a, c.lowrank_b, c.lowrank_a_scale,
                                                                      c.lowrank_b_scale))
    assert bytes_of(c8) < 0.6 * bytes_of(c16)


def test_rotated_pre_rope_keys_come_back_in_the_original_basis():
    """With rotation on, the cache hands the attention keys (before RoPE) and values in the original basis,
    over prompt chunk, decode chunks and buffer (RoPE is then applied to them by the attention)."""
    config = gear_hf.GearConfig(method="kivi", key_bits=8, value_bits=8, group_size=16, buffer_size=16,
                                key_bit_allocation="uniform", prompt_group_size=None,
                                rotation="both", sink_tokens=0, key_buffer="full", value_buffer="full")
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config)
    k, v = _x(n=70), _x(n=70, seed=1)
    keys, values = cache.store_and_read(0, k[:, :, :40], v[:, :, :40])
    for t in range(40, 70):
        keys, values = cache.store_and_read(0, k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert cache.decode_chunks == [2] and cache.buffer_len == [6]
    for got, want in ((keys, k), (values, v)):
        assert float((got - want).norm() / want.norm()) < 5e-3


def test_separate_key_and_value_group_sizes():
    config = gear_hf.GearConfig(method="kivi", key_bits=3, value_bits=2, key_group_size=32, value_group_size=64,
                                key_bit_allocation="uniform", prompt_group_size=None, value_axis="token",
                                buffer_size=32, sink_tokens=0)  # (values per token: their groups run along channels)
    assert (config.key_group, config.value_group, config.chunk_granule) == (32, 64, 32)
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config)
    k, v = _x(n=100), _x(n=100, seed=1)
    cache.store_and_read(0, k, v)
    layer = cache.layers[0]
    assert cache.prefill_len == [96]
    assert layer.key_stream.prefill.fields["scale"].shape == (1, 2, 3, 64)  # 96 tokens / 32
    assert layer.value_stream.prefill.fields["scale"].shape == (1, 2, 96, 1)  # 64 channels / 64
    assert layer.key_stream.prefill.fields["codes"].shape == (1, 2, 96 * 3 // 8, 64)
    with pytest.raises(ValueError, match="key_group_size=12"):
        gear_hf.GearConfig(key_bits=3, key_group_size=12, buffer_size=24, value_axis="token")
    assert gear_hf.GearConfig.preset("gear", bits=2).rotation == "none"  # the paper presets stay the paper's


@pytest.mark.parametrize("overrides,word", [(dict(rotation="keys"), "rotation"), (dict(rotation="both"), "rotation")])
def test_fused_kernel_declines_what_it_does_not_read(overrides, word):
    """The fused decode kernel reads every storage option but key outliers of rotated keys: that one names itself,
    so the cache takes the torch reference path for it (and stays correct)."""
    from gear_hf.backends.triton_backend import fused_supported

    assert fused_supported(gear_hf.GearConfig.preset("gear", bits=2), 64, 1) is None
    for supported in (dict(key_bits=3), dict(value_bits=3), dict(rotation="values"), dict(factor_bits=8),
                      dict(key_group_size=32)):
        assert fused_supported(gear_hf.GearConfig.preset("gear", bits=2, **supported), 64, 1) is None, supported
    reason = fused_supported(gear_hf.GearConfig.preset("gear", bits=2, **overrides), 64, 1)
    assert reason is not None and word in reason


def test_recommendations_by_purpose():
    from gear_hf.config import RECOMMENDED

    GearConfig = gear_hf.GearConfig
    assert GearConfig() == GearConfig.recommended() == GearConfig.recommended("balanced")  # the default
    assert [n for n, _, _, _ in RECOMMENDED] == ["smallest", "balanced", "precise"]
    bits = [b for _, b, _, _ in RECOMMENDED]
    assert bits == sorted(bits)
    for name, b, _, fields in RECOMMENDED:
        config = GearConfig.recommended(name=name)
        assert GearConfig.recommended(b) == config and config.name == name
        assert config == GearConfig().replace(**fields)  # the default's format, other widths
    assert GearConfig.recommended(3.5).name == "smallest" and GearConfig.recommended(100).name == "precise"
    default = GearConfig()  # keys allocated by the queries, values per token, the buffer coded
    assert (default.key_bits, default.value_bits, default.value_axis, default.range_search, default.rotation,
            default.key_buffer, default.value_buffer, default.buffer_size, default.sink_tokens) == \
        (3, 3, "token", "none", "values", "int8-rotated", "int4", 64, 4)
    small = GearConfig.recommended("smallest", buffer_size=16)  # key groups, held chunks follow the buffer
    assert (small.key_group, small.value_buffer_size, small.key_buffer_size, small.held_for) == (16, 32, 32, 0.5)
    with pytest.raises(ValueError, match=r"bits_per_element=2.5 is invalid; allowed: a number >= 2.91"):
        GearConfig.recommended(2.5)
    for bad in ("tiny", None):
        with pytest.raises(ValueError, match="tiny|smallest"):
            GearConfig.recommended(name=bad or "tiny")
    with pytest.raises(ValueError, match="not both"):
        GearConfig.recommended(3.5, name="smallest")
    for bad in (True, [3.5], float("nan")):  # not a number of bits: named, with what is allowed (no TypeError)
        with pytest.raises(ValueError, match="bits_per_element=.*a number >= 2.91.*smallest"):
            GearConfig.recommended(bad)
    # the paper's presets stay the paper's whatever the defaults
    paper = GearConfig.preset("gear", bits=2)
    assert (paper.rotation, paper.factor_bits, paper.key_group, paper.buffer_size) == ("none", 8, 64, 64)
    assert paper.name == "gear-2" and GearConfig(key_bits=4).name == "kivi-k4v3-query-allocated (custom)"


def test_former_recommendation_names_still_load_as_they_were():
    """Each former name loads (with a DeprecationWarning) to what it gave; the former defaults equal the saved
    versions they were."""
    GearConfig = gear_hf.GearConfig

    def former(name, **overrides):
        with pytest.warns(DeprecationWarning, match=f"recommended\\({name!r}\\) is a former name"):
            return GearConfig.recommended(name, **overrides)

    for name, version in (("accurate", 4), ("steady", 5), ("held", 6), ("held-early", 7), ("centered", 8),
                          ("centered-kv", 9), ("centered-chunks", 10)):
        assert former(name) == GearConfig.from_dict({"gear_config_version": version}), name
    assert former("centered-chunks") == GearConfig()
    steady = former("steady")
    assert (steady.buffer_size, steady.key_group, steady.value_buffer_size, steady.value_statistics,
            steady.key_buffer_size) == (64, 64, 128, "8", None)
    held = former("held")
    assert (held.value_buffer_size, held.key_buffer_size, held.key_bits, held.held_for) == (128, 128, 2.75, 1.0)
    compact = former("compact")  # values per channel; the prompt chunk alone in 256-token groups
    assert (compact.value_axis, compact.key_group, compact.value_group, compact.prompt_group_size,
            compact.buffer_size, compact.key_bits, compact.key_bit_allocation, compact.value_statistics) == \
        ("channel", 128, 128, 256, 128, 2.5, "query", "16")
    lean = former("lean")  # values per channel with searched ranges, keys 2.875 bits
    assert (lean.key_bits, lean.value_axis, lean.range_search, lean.value_buffer) == (2.875, "channel", "values",
                                                                                      "int4")
    assert former("gear-4").factor_bits == 16 and former("small").buffer_size == 128
    assert former("held-early", buffer_size=16).value_buffer_size == 32


@pytest.mark.parametrize("which", ["none", "keys", "values", "both"])
def test_range_search_reaches_the_streams_it_names(which):
    """range_search="values" searches the value groups' ranges only (keys keep min/max), and so on; the cache then
    holds what compress returns for that spec."""
    from gear_hf.cache.layer import stream_specs

    config = gear_hf.GearConfig(method="kivi", key_bits=2, value_bits=2, group_size=32, buffer_size=32,
                                key_bit_allocation="uniform", prompt_group_size=None,
                                sink_tokens=0, rotation="none", range_search=which,
                                value_chunks_centered=False)  # (the value chunk as compress gives it)
    for stream in ("key", "value"):
        expected = which in ("both", stream + "s")
        assert all(spec.range_search == expected for spec in stream_specs(config, stream))
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config)
    k, v = _x(n=64), _x(n=64, seed=1)
    cache.store_and_read(0, k, v)
    layer = cache.layers[0]
    for x, stream, spec in ((k, layer.key_stream, stream_specs(config, "key")[0]),
                            (v, layer.value_stream, stream_specs(config, "value")[0])):
        assert torch.equal(stream.prefill.fields["scale"], compress(x, spec).scale)
    with pytest.raises(ValueError, match="range_search='value'"):
        gear_hf.GearConfig(range_search="value")
    assert gear_hf.GearConfig.preset("gear", bits=2).range_search == "none"  # the paper presets stay the paper's
