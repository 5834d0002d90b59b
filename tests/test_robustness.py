"""Robustness: property tests of the compression engine and edge cases through real `generate` calls.

Property tests (hypothesis, random shapes/dtypes/bits): packing is exact; dequantized values lie within half a
step of the input outside the outliers (plus float32 rounding); each vector keeps exactly the configured number of
outliers; the low-rank fit's error does not grow with the rank.
Model-level (tiny random models, CPU, seconds): NaN/inf keys or values raise a clear error; empty prompts and
prompts longer than max_position_embeddings behave as stock; beam search and sampling; 100 generate calls retain
no memory; fp16 values large enough that the low-rank factors exceed the fp16 range stay finite.

Two engine limitations found here were pinned by strict xfails and have since been fixed in the engine (their
tests now pass plainly): group statistics rounded to nearest in bf16 clamped a group's top entry up to ~1 step
away, and the low-rank initial bases were not nested across ranks.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch

import gear_hf
from gear_hf.compress import (
    ChunkSpec,
    compress,
    dequantize,
    lowrank_fit,
    outliers_per_vector,
    pack_codes,
    quantize,
    select_outliers,
    unpack_codes,
)
from memory_count import live_tensors
from tiny_models import VOCAB, prompts, tiny_model

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FAST = settings(max_examples=40, deadline=None)


def _data(seed: int, shape, dtype, spread: float, offset: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * spread + offset
    x[..., 0] *= 8  # a wide channel, as keys have
    return x.to(dtype)


# -- engine properties ------------------------------------------------------------------------------------------

@FAST
@given(bits=st.sampled_from([2, 4, 8]), dim=st.sampled_from([-1, -2]), a=st.integers(1, 3), b=st.integers(1, 5),
       c=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_is_exact(bits, dim, a, b, c, seed):
    per_byte = 8 // bits
    shape = [a, b, c * per_byte, c * per_byte + (0 if dim == -2 else 0)]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits, dim)
    assert packed.dtype == torch.uint8 and packed.shape[dim] == shape[dim] // per_byte
    assert torch.equal(unpack_codes(packed, bits, dim), codes)


@FAST
@given(bits=st.sampled_from([2, 4, 8]), axis=st.sampled_from(["channel", "token"]), dtype=st.sampled_from(DTYPES),
       heads=st.integers(1, 3), groups=st.integers(1, 3), group=st.sampled_from([8, 16, 32]),
       d=st.sampled_from([16, 24, 64]), ratio=st.sampled_from([0.0, 0.02, 0.1]),
       spread=st.floats(1e-2, 1e3), offset=st.floats(-100, 100), seed=st.integers(0, 2**31 - 1))
def test_dequantized_within_half_a_step_outside_outliers(bits, axis, dtype, heads, groups, group, d, ratio, spread,
                                                         offset, seed):
    """|x̂ - x| <= step/2 outside the outliers, where `step` is the stored scale, plus float32 rounding. The
    stats are stored in the cache dtype, rounded so that they still cover the group's range (minimum <= min,
    minimum + (2^b - 1) * step >= max): no entry is clamped, whatever the dtype and bit width."""
    n = groups * group
    x = _data(seed, (1, heads, n, d), dtype, spread, offset)
    _, _, mask = select_outliers(x, axis, ratio)
    codes, scale, minimum = quantize(x, bits, axis, group, exclude=mask)
    y = dequantize(codes, scale, minimum, axis, group, d, torch.float32)
    if axis == "channel":
        step = scale.float().repeat_interleave(group, dim=2)
    else:
        step = scale.float().repeat_interleave(group, dim=3)[..., :d]
    bound = step / 2 + 1e-6 * x.float().abs().amax()
    err = (y - x.float()).abs()
    assert (err[~mask] <= bound[~mask]).all(), float((err - bound)[~mask].max())


def test_bf16_8_bit_top_of_group_within_half_a_step():
    """Was a strict xfail: the scale stored in bf16 was rounded to nearest, so at 8 bits the top of a group was
    clamped up to ~1 step away; now a scale that falls short of the range is stepped up one ulp."""
    worst = 0.0
    for seed in range(30):
        x = (torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(seed)) * 3 + 5).to(torch.bfloat16)
        codes, scale, minimum = quantize(x, 8, "channel", 64)
        y = dequantize(codes, scale, minimum, "channel", 64, 64, torch.float32)
        worst = max(worst, float(((y - x.float()).abs() / scale.float().repeat_interleave(64, dim=2)).max()))
    assert worst <= 0.5 + 1e-3, worst


@FAST
@given(axis=st.sampled_from(["channel", "token"]), n=st.integers(2, 130), d=st.integers(2, 70),
       ratio=st.sampled_from([0.01, 0.02, 0.05, 0.2, 0.5]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_outlier_count_per_vector_is_as_configured(axis, n, d, ratio, dtype, seed):
    x = _data(seed, (2, 2, n, d), dtype, 1.0, 0.0)
    index, slot_used, mask = select_outliers(x, axis, ratio)
    length = n if axis == "channel" else d
    k = outliers_per_vector(length, ratio)
    per_vector = mask.sum(dim=2 if axis == "channel" else 3)
    assert (per_vector == k).all()
    assert bool(slot_used.all())
    # the chosen entries are the j largest and k-j smallest of their vector, for the j leaving the narrowest range
    vec = (x.float().transpose(-1, -2) if axis == "channel" else x.float())
    vmask = mask.transpose(-1, -2) if axis == "channel" else mask
    if k:
        ordered = vec.sort(dim=-1).values  # [.., L]
        L = ordered.shape[-1]
        best = torch.stack([ordered[..., L - 1 - j] - ordered[..., k - j] for j in range(k + 1)], -1).amin(-1)
        kept = vec.masked_fill(vmask, float("nan"))
        width = kept.nan_to_num(float("-inf")).amax(-1) - kept.nan_to_num(float("inf")).amin(-1)
        assert (width <= best).all()


def _lowrank_error(R: torch.Tensor, rank: int, iters: int = 3) -> float:
    A, B = lowrank_fit(R, rank, iters)
    return float((R - A.float() @ B.float().transpose(-1, -2)).norm())


@FAST
@given(n=st.integers(4, 80), d=st.integers(4, 70), decay=st.floats(0.0, 3.0), seed=st.integers(0, 2**31 - 1))
def test_lowrank_error_does_not_grow_with_rank(n, d, decay, seed):
    """The initial bases are nested across ranks (span of rank r inside rank r+1), so the projection error cannot
    grow with the rank; float32 rounding only."""
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(1, 1, n, d, generator=g) * torch.logspace(0, -decay, d)
    errors = [_lowrank_error(R, r) for r in range(0, min(n, d, 8) + 1)]
    assert errors[0] == pytest.approx(float(R.norm()))
    for low, high in zip(errors, errors[1:]):
        assert high <= low * (1 + 1e-5) + 1e-6


def test_lowrank_error_strictly_non_increasing_in_rank():
    """Was a strict xfail: the initial bases of ranks r and r+1 were not nested; now they are (randn(r, d).T)."""
    g = torch.Generator().manual_seed(59)
    n, d = int(torch.randint(4, 80, (1,), generator=g)), int(torch.randint(4, 70, (1,), generator=g))
    R = torch.randn(1, 1, n, d, generator=g) * torch.logspace(0, -float(torch.rand(1, generator=g) * 3), d)
    errors = [_lowrank_error(R, r) for r in range(1, min(n, d, 8) + 1)]
    assert all(b <= a for a, b in zip(errors, errors[1:])), errors


# -- through a model --------------------------------------------------------------------------------------------

SMALL = dict(group_size=8, buffer_size=8)  # tiny prompts reach compression at prefill and every 8 tokens


def _gen(model, ids, mask=None, **kwargs):
    kwargs.setdefault("max_new_tokens", 8)
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                              pad_token_id=0, **kwargs)


@pytest.mark.parametrize("stream", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_keys_or_values_raise_through_generate(stream, bad):
    model = tiny_model("llama2")
    ids, _ = prompts(1, length=24)
    proj = model.model.layers[1].self_attn.k_proj if stream == "key" else model.model.layers[1].self_attn.v_proj
    with torch.no_grad():
        proj.weight[0, :] = bad
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("gear", bits=2, **SMALL)):
        with pytest.raises(ValueError, match=r"non-finite keys/values \(NaN or inf\)"):
            _gen(model, ids)


def test_empty_prompt_behaves_as_stock():
    model = tiny_model("llama3")
    empty = torch.empty(1, 0, dtype=torch.long)

    def outcome(fn):
        try:
            return ("ok", fn().tolist())
        except Exception as err:  # stock's own error, whatever it is, must be ours too
            return ("error", type(err).__name__, str(err))

    stock_empty = outcome(lambda: _gen(model, empty))
    stock_none = outcome(lambda: model.generate(max_new_tokens=6, do_sample=False, pad_token_id=0))
    for config in (gear_hf.GearConfig.preset("fp16"), gear_hf.GearConfig.preset("gear", bits=2, **SMALL)):
        with gear_hf.enabled(model, config):
            ours_empty = outcome(lambda: _gen(model, empty))  # a clear error naming the empty prompt's shape
            assert ours_empty[:2] == ("error", "ValueError") and "[1, 0]" in ours_empty[2], (ours_empty, stock_empty)
            ours = outcome(lambda: model.generate(max_new_tokens=6, do_sample=False, pad_token_id=0))
        assert ours[0] == stock_none[0]
        if config.method == "fp16":
            assert ours == stock_none


def test_prompt_longer_than_max_position_embeddings_behaves_as_stock():
    model = tiny_model("qwen2")
    limit = model.config.max_position_embeddings
    ids = torch.randint(3, VOCAB, (1, limit + 70), generator=torch.Generator().manual_seed(3))
    stock = _gen(model, ids, max_new_tokens=6, min_new_tokens=6)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        assert torch.equal(_gen(model, ids, max_new_tokens=6, min_new_tokens=6), stock)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("gear", bits=4)):
        out = _gen(model, ids, max_new_tokens=6, min_new_tokens=6, output_scores=True, return_dict_in_generate=True)
        cache = gear_hf.last_cache(model)
    assert out.sequences.shape == stock.shape
    assert all(torch.isfinite(s).all() for s in out.scores)
    assert cache.get_seq_length() == limit + 70 + 5 and int(cache.positions.max()) == limit + 70 + 4


def test_beam_search_and_sampling_as_stock_and_finite_when_compressed():
    model = tiny_model("llama3")
    ids, mask = prompts(2, length=21)
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, min_new_tokens=10)
    stock_beams = _gen(model, ids, mask, **beams)
    torch.manual_seed(7)
    stock_sample = _gen(model, ids, mask, do_sample=True, top_k=8, max_new_tokens=10, min_new_tokens=10)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        assert torch.equal(_gen(model, ids, mask, **beams), stock_beams)
        torch.manual_seed(7)
        assert torch.equal(_gen(model, ids, mask, do_sample=True, top_k=8, max_new_tokens=10, min_new_tokens=10),
                           stock_sample)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("gear", bits=2, **SMALL)):
        out = _gen(model, ids, mask, output_scores=True, return_dict_in_generate=True, **beams)
        assert out.sequences.shape == stock_beams.shape
        assert torch.isfinite(out.sequences_scores).all()
        torch.manual_seed(7)
        sampled = _gen(model, ids, mask, do_sample=True, top_k=8, max_new_tokens=10, min_new_tokens=10)
        assert sampled.shape == stock_sample.shape and int(sampled.max()) < VOCAB


def test_100_generate_calls_retain_no_memory():
    model = tiny_model("mistral")  # sliding window too
    ids, mask = prompts(2, length=21)
    samples = {}
    tracemalloc.start()
    try:
        with gear_hf.enabled(model, gear_hf.GearConfig.preset("gear", bits=2, **SMALL)):
            for call in range(1, 101):
                _gen(model, ids, mask, max_new_tokens=12)
                if call in (20, 60, 100):
                    count, nbytes = live_tensors()
                    samples[call] = (count, nbytes, tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    (c20, b20, p20), (c60, _, _), (c100, b100, p100) = samples[20], samples[60], samples[100]
    assert c100 == c20 and c60 == c20, samples  # live tensors (the last cache is kept by design: one)
    assert b100 == b20, samples  # their bytes
    assert p100 - p20 < 64 * 1024, samples  # Python allocations: no per-call growth (80 calls)


def test_fp16_values_beyond_fp16_range_in_lowrank_factors_are_clamped():
    """fp16 values whose quantization residual is large and coherent: every token has -6e4 and +6e4 in two
    channels and ~0 elsewhere, so 2-bit levels sit at ±2e4 and the residual is ±2e4 on every other channel of
    every token. Its right factor B = Rᵀ A (A orthonormal) is ~2e4·sqrt(n) > 65504 in fp32; stored in fp16 it
    must be clamped to the finite range, in the engine and through a generate call on an fp16 model."""
    fmax = torch.finfo(torch.float16).max
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 64, 16, generator=g) * 50
    x[..., 0], x[..., 1] = -6e4, 6e4
    x = x.to(torch.float16)
    spec = ChunkSpec(bits=2, axis="token", group=8, outlier_ratio=0.0, rank=2)
    unclamped = compress(x.float(), spec).lowrank_b
    assert unclamped.abs().max() > fmax  # the case under test really happens
    chunk = compress(x, spec)
    assert torch.isfinite(chunk.lowrank_b).all() and torch.isfinite(chunk.lowrank_a).all()
    assert float(chunk.lowrank_b.float().abs().max()) == fmax  # clamped, not inf

    model = tiny_model("qwen2", dtype=torch.float16)  # q/k/v bias: values are set through the bias
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(1e-3)
            attn.v_proj.bias.zero_()
            attn.v_proj.bias.view(-1, attn.head_dim)[:, 0] = -6e4
            attn.v_proj.bias.view(-1, attn.head_dim)[:, 1] = 6e4
            attn.o_proj.weight.mul_(1e-5)  # keep the residual stream in range
    ids, _ = prompts(1, length=40)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("gear-l", bits=2, factor_bits=16, **SMALL)):
        out = _gen(model, ids, max_new_tokens=10, min_new_tokens=10, output_scores=True,
                   return_dict_in_generate=True)
        cache = gear_hf.last_cache(model)
    streams = [layer.value_stream for layer in cache.layers]
    assert max(float(s.prefill.fields["lowrank_b"].float().abs().max()) for s in streams) == fmax
    for s in streams:
        for store in (s.prefill, s.decode):
            for name, t in store.fields.items():
                if t.is_floating_point():
                    assert torch.isfinite(t).all(), name
    assert all(torch.isfinite(s).all() for s in out.scores)


def test_initial_bases_are_nested_for_every_rank():
    """torch's CPU normal fill changes with the count drawn: the bases must still share their first columns
    (a rank-1 and a rank-2 basis once differed, and the fit error grew with the rank: n=9, d=13, seed 273)."""
    from gear_hf.compress.lowrank import _initial_basis

    for d in (13, 64, 128):
        widest = _initial_basis(d, 9, torch.device("cpu"))
        for rank in range(1, 9):
            assert torch.equal(_initial_basis(d, rank, torch.device("cpu")), widest[:, :rank])
    g = torch.Generator().manual_seed(273)
    R = torch.randn(1, 1, 9, 13, generator=g) * torch.logspace(0, -1.0, 13)
    errors = [_lowrank_error(R, r) for r in range(0, 9)]
    assert all(high <= low * (1 + 1e-5) + 1e-6 for low, high in zip(errors, errors[1:])), errors
