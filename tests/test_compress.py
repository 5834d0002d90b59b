"""The pure-torch engine: exact packing, quantization bounds, fixed-count outliers, padding, low rank."""

from __future__ import annotations

import pytest
import torch

from gear_hf.compress import (
    ChunkSpec,
    compress,
    decompress,
    dequantize,
    lowrank_fit,
    outliers_per_vector,
    pack_codes,
    quantize,
    select_outliers,
    unpack_codes,
)


def _x(B=2, H=3, n=128, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, n, d, generator=g)
    x[..., 3] *= 12  # an outlier channel, as keys have
    return x.to(dtype)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [-1, -2])
def test_pack_unpack_round_trip_is_exact(bits, dim):
    codes = torch.randint(0, 1 << bits, (2, 3, 16, 24), dtype=torch.uint8)
    packed = pack_codes(codes, bits, dim)
    assert packed.shape[dim] == codes.shape[dim] * bits // 8
    assert torch.equal(unpack_codes(packed, bits, dim), codes)


def test_pack_is_low_bits_first():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 2, -1).item() == 1 | (2 << 2) | (3 << 4)


@pytest.mark.parametrize("axis,group", [("channel", 32), ("token", 32), ("token", 48), ("channel", 128)])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantized_within_half_a_step(axis, group, bits):
    x = _x(n=128, d=64)
    codes, scale, minimum = quantize(x, bits, axis, group)
    y = dequantize(codes, scale, minimum, axis, group, 64, torch.float32)
    if axis == "channel":
        step = scale.repeat_interleave(group, dim=2)
    else:
        step = scale.repeat_interleave(group, dim=3)[..., :64]
    assert ((y - x).abs() <= step / 2 + 1e-5).all()


def _adversarial(stats_dtype, seed=0):
    """x [1,6,32,40] float32, one family of groups per head, and an exclusion mask that empties some groups of
    16 along both axes: random; large offset with tiny spread; negative; straddling 0; all equal; random with
    10% excluded. Values are representable in stats_dtype's range."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(6, 32, 40, generator=g)
    big = 2e4 if stats_dtype == torch.float16 else 3e5
    x = torch.stack([r[0] * 3, big + r[1] * 1e-2, -300 + r[2] * 7, r[3] * 1e-3, torch.full_like(r[4], 3.14159),
                     r[5] * 40 + 11])[None]
    exclude = torch.zeros_like(x, dtype=torch.bool)
    exclude[0, 5] = torch.rand(32, 40, generator=g) < 0.1
    exclude[0, 5, :16, :16] = True  # channels 0-15 of tokens 0-15: empty key groups and empty value groups
    return x, exclude


@pytest.mark.parametrize("axis,group", [("channel", 16), ("token", 16)])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("stats_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("input_fp32", [False, True], ids=["x_in_stats_dtype", "x_fp32"])
def test_stored_stats_cover_the_group(axis, group, bits, stats_dtype, input_fp32):
    """The stats rounded to fp16/bf16 still cover each group's range: minimum <= every entry, minimum +
    (2^b - 1) * scale >= every entry (float32), so no entry is clamped and each dequantizes within half a step
    (plus float32 rounding). Rounded to nearest instead, they clamp the extremes up to ~1 step away (8 bits,
    bf16). x in float32 makes the stored minimum round too; all-excluded groups keep scale 0, minimum 0."""
    x, exclude = _adversarial(stats_dtype, seed=bits)
    x = x if input_fp32 else x.to(stats_dtype)
    xf = x.float()
    top = (1 << bits) - 1
    codes, scale, minimum = quantize(x, bits, axis, group, exclude=exclude, stats_dtype=stats_dtype)
    assert scale.dtype == minimum.dtype == stats_dtype
    y = dequantize(codes, scale, minimum, axis, group, 40, torch.float32)
    dim = 2 if axis == "channel" else 3
    step = scale.float().repeat_interleave(group, dim=dim)[..., :40]
    low = minimum.float().repeat_interleave(group, dim=dim)[..., :40]
    keep = ~exclude
    assert (low[keep] <= xf[keep]).all()
    assert ((low + top * step)[keep] >= xf[keep]).all()
    err = (y - xf).abs()
    bound = step / 2 + 2**-22 * (xf.abs() + low.abs() + top * step)
    assert (err[keep] <= bound[keep]).all(), float((err / step.clamp_min(1e-30))[keep].max())
    if axis == "channel":  # stats [1,6,2,40]
        empty = exclude.reshape(1, 6, 2, 16, 40).all(3)
    else:  # stats [1,6,32,3]; the padded channels 40..47 are excluded too
        empty = torch.nn.functional.pad(exclude, (0, 8), value=True).reshape(1, 6, 32, 3, 16).all(4)
    assert bool(empty.any())
    assert (scale[empty] == 0).all() and (minimum[empty] == 0).all()


def test_per_channel_key_groups_follow_their_channel():
    """Keys: one group = one channel over g tokens, so the outlier channel does not widen other channels."""
    x = _x()
    _, scale_channel, _ = quantize(x, 2, "channel", 64)
    _, scale_token, _ = quantize(x, 2, "token", 64)
    assert scale_channel[..., 0].mean() < scale_channel[..., 3].mean() / 5
    assert scale_token.mean() > scale_channel[..., 0].mean() * 2  # every token group spans channel 3


def test_excluded_entries_take_no_part_in_min_max():
    x = _x(B=1, H=1, n=64, d=8)
    exclude = torch.zeros_like(x, dtype=torch.bool)
    exclude[..., 5, :] = True
    x2 = x.clone()
    x2[..., 5, :] = 1e6
    a = quantize(x, 4, "channel", 64, exclude)
    b = quantize(x2, 4, "channel", 64, exclude)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_outlier_count_per_vector_is_fixed(axis):
    x = _x(n=200, d=64)
    index, used, mask = select_outliers(x, axis, 0.04)
    length = 200 if axis == "channel" else 64
    k = outliers_per_vector(length, 0.04)
    assert k == round(0.04 * length)
    per_vector = mask.sum(dim=-2 if axis == "channel" else -1)
    assert (per_vector == k).all()
    assert used.all()
    # the chosen entries are extremes of each vector: every kept entry lies between the chosen ones
    vec = x.transpose(-1, -2) if axis == "channel" else x
    m = mask.transpose(-1, -2) if axis == "channel" else mask
    kept_hi = vec.masked_fill(m, float("-inf")).amax(-1)
    kept_lo = vec.masked_fill(m, float("inf")).amin(-1)
    chosen_hi = vec.masked_fill(~m, float("-inf")).amax(-1)
    chosen_lo = vec.masked_fill(~m, float("inf")).amin(-1)
    assert ((chosen_hi >= kept_hi) | (chosen_lo <= kept_lo)).all()
    assert (vec.masked_fill(m, 0).abs().amax(-1) <= vec.abs().amax(-1)).all()


def _brute_force_outliers(vec: list[float], k: int) -> set[int]:
    """The documented choice, one vector at a time: the k+1 largest (equal values: lower index first), the k+1
    smallest of what the k largest leave, and the split (fewest from the top on a tie) leaving the narrowest range."""
    top = sorted(range(len(vec)), key=lambda i: (-vec[i], i))
    bottom = sorted(top[k:], key=lambda i: (vec[i], i))
    widths = [vec[top[j]] - vec[bottom[k - j]] for j in range(k + 1)]
    j = widths.index(min(widths))
    return set(top[:j]) | set(bottom[: k - j])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["extract", "candidates", "whole"])
@pytest.mark.parametrize("ratio", [0.01, 0.05])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_outliers_on_ties_follow_the_documented_order(axis, ratio, path, dtype, monkeypatch):
    """Many equal values (small integers; bf16 caches and repeated tokens have them): the chosen entries are those of
    the brute-force rule on each way of finding the extremes: taking them one by one (few per vector), ranking the
    candidates (the CPU's way for more), sorting whole vectors (other devices'); with 16-bit ranking keys (16-bit
    values) and 64-bit ones (float32)."""
    from gear_hf.compress import outliers

    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (2, 2, 200, 64), generator=g).to(dtype)
    if path != "candidates":  # (a vector where every entry is a candidate sends the whole call to another way)
        x[0, 0, :, 5] = 0.0  # a constant vector along tokens: every entry ties (-0.0 and +0.0 are equal)
        x[0, 0, ::3, 5] = -0.0
        x[1, 1, 7] = 0.0  # and one along channels
        x[1, 1, 7, 1::2] = -0.0
    k = outliers_per_vector(200 if axis == "channel" else 64, ratio)
    monkeypatch.setattr(outliers, "_EXTRACTION_MAX_SLOTS", 1000 if path == "extract" else 0)
    if path == "whole":
        monkeypatch.setattr(outliers, "_candidates", lambda *a, **kw: None)
    elif path == "candidates":
        assert outliers._candidates(x, axis, k, None) is not None  # the candidates are few enough to be ranked
    _, _, mask = select_outliers(x, axis, ratio)
    vec = x.transpose(-1, -2) if axis == "channel" else x
    chosen = mask.transpose(-1, -2) if axis == "channel" else mask
    for v, m in zip(vec.reshape(-1, vec.shape[-1]).tolist(), chosen.reshape(-1, vec.shape[-1])):
        assert set(torch.nonzero(m).flatten().tolist()) == _brute_force_outliers(v, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_16bit_ranking_keys_choose_what_float32_keys_choose(axis, dtype, monkeypatch):
    """16-bit values are ranked with int32 keys, float32 ones with int64 keys: the same values (a 16-bit chunk and its
    exact float32 copy) give the same outliers, on every way of finding them (the one each ratio takes; every ratio
    by extraction; every ratio by sorting whole vectors), with -0.0 beside +0.0, infinities, subnormals, ties, an
    odd shape and padding."""
    from gear_hf.compress import outliers

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 2, 328, 72, generator=g) * torch.rand(72, generator=g).mul(8).exp()).to(dtype)
    x[0, 0, :, 3] = 0.0  # a vector of zeros, -0.0 and +0.0 mixed: equal, so chosen by position
    x[0, 0, 7::3, 3] = -0.0
    x[0, 1, 17] = 0.0
    x[0, 1, 17, 1::2] = -0.0
    x[1, 1, 9] = torch.finfo(dtype).tiny / 4  # subnormal
    x[1, 0, 11, :9] = float("inf")
    x[2, 1, 13, 20:30] = float("-inf")
    x[2, 0, 100:140] = x[2, 0, 100:140].round()  # ties
    valid = torch.ones(3, 328, dtype=torch.bool)
    valid[1, :70] = False
    cases = [(ratio, mask) for ratio in (0.01, 0.02, 0.06, 0.3) for mask in (None, valid)]
    expected = [select_outliers(x.float(), axis, ratio, mask) for ratio, mask in cases]
    for way in ("own", "extract", "whole"):
        if way == "extract":
            monkeypatch.setattr(outliers, "_EXTRACTION_MAX_SLOTS", 1000)
        if way == "whole":
            monkeypatch.setattr(outliers, "_EXTRACTION_MAX_SLOTS", 0)
            monkeypatch.setattr(outliers, "_candidates", lambda *a, **kw: None)
        for (ratio, mask), wide in zip(cases, expected):
            for a, b in zip(select_outliers(x, axis, ratio, mask), wide):
                assert torch.equal(a, b), (way, ratio, mask is not None)


def test_outliers_ignore_padding_and_follow_row_length():
    x = _x(B=2, n=100)
    valid = torch.ones(2, 100, dtype=torch.bool)
    valid[1, :60] = False
    x[1, :, :60] = 1e4  # padding garbage must never be chosen
    index, used, mask = select_outliers(x, "channel", 0.04, valid)
    assert not mask[1, :, :60].any()
    assert used[0].sum(dim=-2).eq(outliers_per_vector(100, 0.04)).all()
    assert used[1].sum(dim=-2).eq(outliers_per_vector(40, 0.04)).all()


@pytest.mark.parametrize("range_search", [False, True])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_padding_does_not_change_a_rows_compression(axis, range_search):
    """Row-local padding (at the end, as the cache stores rows) leaves the valid part bit-identical."""
    spec = ChunkSpec(2, axis, 32, 0.02, 4, range_search=range_search)
    x = _x(B=1, n=96)
    alone = decompress(compress(x, spec), spec, 96, 64, torch.float32)
    padded = torch.cat([x, torch.full((1, 3, 32, 64), 7e3)], dim=2)
    valid = torch.zeros(1, 128, dtype=torch.bool)
    valid[:, :96] = True
    spec_ch = spec
    out = decompress(compress(padded, spec_ch, valid), spec_ch, 128, 64, torch.float32)
    assert torch.isfinite(out).all()
    err_alone = (alone - x).norm() / x.norm()
    err_padded = (out[:, :, :96] - x).norm() / x.norm()
    assert err_padded < err_alone * 1.1  # pads did not pollute statistics or the fit


def test_lowrank_is_deterministic_and_improves_with_rank():
    r = _x(n=64)
    a1, b1 = lowrank_fit(r, 4, 3)
    a2, b2 = lowrank_fit(r.clone(), 4, 3)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    errors = []
    for rank in (0, 1, 2, 4, 8, 16):
        a, b = lowrank_fit(r, rank, 3)
        errors.append(((r - a @ b.transpose(-1, -2)).norm() / r.norm()).item())
    assert all(e2 <= e1 + 1e-6 for e1, e2 in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0]


def test_lowrank_factors_stay_finite_in_fp16():
    r = torch.randn(1, 1, 64, 64) * 6e4
    a, b = lowrank_fit(r, 2, 3, out_dtype=torch.float16)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gear_terms_each_reduce_reconstruction_error(dtype):
    x = _x(dtype=dtype)
    def err(spec):
        y = decompress(compress(x, spec), spec, 128, 64, torch.float32)
        return ((y - x.float()).norm() / x.float().norm()).item()
    kivi = err(ChunkSpec(2, "channel", 64, 0.0, 0))
    gear_l = err(ChunkSpec(2, "channel", 64, 0.0, 4))
    outlier = err(ChunkSpec(2, "channel", 64, 0.02, 0))
    gear = err(ChunkSpec(2, "channel", 64, 0.02, 4))
    assert gear < gear_l < kivi and gear < outlier < kivi
    assert err(ChunkSpec(4, "channel", 64, 0.02, 4)) < gear


def test_kcvt_uses_one_group_per_vector():
    x = _x(n=128)
    c = compress(x, ChunkSpec(2, "channel", 0, 0.0, 0))
    assert c.scale.shape == (2, 3, 1, 64)
    c = compress(x, ChunkSpec(2, "token", 0, 0.0, 0))
    assert c.scale.shape == (2, 3, 128, 1)


def _group_squared_errors(x, exclude, codes, scale, minimum, axis, group):
    """Each group's squared error over its non-excluded entries: [B,H,n/g,d] or [B,H,n,G]."""
    d = x.shape[-1]
    err = (dequantize(codes, scale, minimum, axis, group, d, torch.float32) - x.float()).square()
    err = err.masked_fill(exclude, 0.0)
    if axis == "channel":
        return err.reshape(*err.shape[:2], -1, group, d).sum(3)
    err = torch.nn.functional.pad(err, (0, (-d) % group))
    return err.reshape(*err.shape[:3], -1, group).sum(4)


@pytest.mark.parametrize("axis,group", [("channel", 16), ("token", 16)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("stats_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_range_search_never_increases_a_groups_error(axis, group, bits, stats_dtype):
    """Searched ranges: every group's squared error <= plain min/max's (as stored), the stats keep their dtype and
    shapes, excluded entries still take no part, and codes dequantize to what the search scored."""
    x, exclude = _adversarial(stats_dtype, seed=bits)
    heavy = torch.randn(1, 2, 32, 40, generator=torch.Generator().manual_seed(1)) ** 3  # heavy tails: clipping pays
    x = torch.cat([x, heavy], dim=1)
    exclude = torch.cat([exclude, torch.zeros_like(heavy, dtype=torch.bool)], dim=1)
    plain = quantize(x, bits, axis, group, exclude=exclude, stats_dtype=stats_dtype)
    searched = quantize(x, bits, axis, group, exclude=exclude, stats_dtype=stats_dtype, range_search=True)
    for a, b in zip(plain, searched):
        assert a.shape == b.shape and a.dtype == b.dtype
    err_plain = _group_squared_errors(x, exclude, *plain, axis, group)
    err_searched = _group_squared_errors(x, exclude, *searched, axis, group)
    assert (err_searched <= err_plain * (1 + 1e-6) + 1e-30).all()
    if bits <= 3:
        assert err_searched[:, -2:].sum() < 0.9 * err_plain[:, -2:].sum()  # heavy tails at 2-3 bits: a real gain
    x2 = x.clone()
    x2[exclude] = 1e6  # excluded entries still take no part
    again = quantize(x2, bits, axis, group, exclude=exclude, stats_dtype=stats_dtype, range_search=True)
    assert torch.equal(again[1], searched[1]) and torch.equal(again[2], searched[2])


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_range_search_keeps_the_stored_format_and_lowers_the_error(axis):
    """compress with range_search stores the same fields (names, shapes, dtypes) as without, decompress reads them
    unchanged, and the reconstruction error falls at 2 bits."""
    x = _x(dtype=torch.bfloat16)
    plain_spec = ChunkSpec(2, axis, 32, 0.02, 2, rotate=True)
    search_spec = ChunkSpec(2, axis, 32, 0.02, 2, rotate=True, range_search=True)
    plain, searched = compress(x, plain_spec), compress(x, search_spec)
    for name in plain.fields:
        a, b = getattr(plain, name), getattr(searched, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
    def err(chunk, spec):
        y = decompress(chunk, spec, 128, 64, torch.float32)
        return ((y - x.float()).norm() / x.float().norm()).item()
    assert err(searched, search_spec) < 0.95 * err(plain, plain_spec)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_outliers_searching_only_the_misses_changes_nothing(model_dtype):
    """On the CPU only the entries whose first pair (quantized code, nearest S) misses are searched further: the
    same codes and S as searching every entry (the way other devices take)."""
    from gear_hf.compress.terms import sparse as gear

    g = torch.Generator().manual_seed(7)
    target = (torch.randn(4000, generator=g) * 3).to(model_dtype).float()
    scale = torch.rand(4000, generator=g) * 0.5 + 0.01
    minimum = -torch.rand(4000, generator=g) * 4
    code = torch.round((target - minimum) / scale).clamp(0, 3).to(torch.uint8)
    code[::3] = torch.randint(0, 4, (len(code[::3]),), generator=g, dtype=torch.uint8)  # some far from the target
    store = torch.float16 if model_dtype == torch.float16 else torch.bfloat16
    searched = gear.exact_outliers(target, code, scale, minimum, 2, model_dtype, store)
    everywhere = gear._search_pairs(target, code, scale, minimum, 2, model_dtype, store)
    assert torch.equal(searched[0], everywhere[0]) and torch.equal(searched[1], everywhere[1])
    base = code * scale + minimum
    first_pair_hits = (base + (target - base).to(store).float()).to(model_dtype).float() == target
    if model_dtype != torch.float32:  # the misses alone were searched (at most half), some of them
        assert 0 < 2 * int((~first_pair_hits).sum()) <= len(target)
