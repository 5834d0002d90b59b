"""The numba compression kernels (`gear_hf.kernels.cpu.compress`, `.lowrank`) against the torch oracle.

`compute_backbone` (outlier choice, group statistics, codes, exact outliers, packing, residual) is what
`compress_backbone` must equal exactly; `gear.fit_factors` is what `cpu.fit_factors` must equal to float32
rounding. Inputs are chosen to break a careless port: ties (small integers), signed
zeros, constant groups, values near the 16-bit range, vectors exactly 2k long, groups that do not split d.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

numba = pytest.importorskip("numba")

from gear_hf.backends import get_backend, plan_of  # noqa: E402
from gear_hf.cache.storage import ChunkStore  # noqa: E402
from gear_hf.compress import ChunkSpec, CompressedChunk, compress  # noqa: E402
from gear_hf.compress.gear import compute_backbone, fit_factors  # noqa: E402
from gear_hf.kernels import cpu  # noqa: E402
from gear_hf.kernels.cpu import compress_backbone, compress_supported  # noqa: E402


def _inputs(kind: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(kind))
    if kind == "gaussian":  # channels of different ranges, a few large entries
        x = torch.randn(shape, generator=g) * (1 + 3 * torch.rand(shape[-1], generator=g))
        x[..., 3, 1] = 50.0
    elif kind == "ties":  # few distinct values: every ranking decided by position
        x = torch.randint(-3, 3, shape, generator=g).float() * 0.5
    elif kind == "signed_zeros":  # -0.0 and +0.0 rank equal; one huge entry
        x = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
        x[..., 1, 1] = 1e30
    else:  # "wide": heavy tails up to the edge of bf16's range
        x = torch.randn(shape, generator=g) ** 3 * 1e4
        x[..., 0, :] = 1e38
    return x.to(dtype)


def _assert_same(expected, got):
    """Every field of a Backbone (a dataclass) or a CompressedChunk (named fields) the same."""
    names = list(expected.fields) if isinstance(expected, CompressedChunk) else \
        [f.name for f in dataclasses.fields(expected)]
    assert names == (list(got.fields) if isinstance(got, CompressedChunk) else names)
    for name in names:
        a, b = getattr(expected, name), getattr(got, name)
        if a is None:
            assert b is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        # values, not bits: a group of signed zeros may store its minimum as -0.0 or +0.0 (torch's amin picks
        # either), which decodes to the same values
        assert torch.equal(a, b), (name, (a != b).sum().item())


CASES = [
    (bits, axis, n, d, ratio, rank, group)
    for bits, axis in itertools.product((2, 3, 4, 8), ("channel", "token"))
    for n, d, ratio, rank, group in ((64, 64, 0.02, 2, 16), (128, 24, 0.1, 0, 0), (32, 20, 0.5, 3, 8),
                                     (256, 64, 0.02, 4, 64), (16, 64, 0.0, 2, 0))
    if not (axis == "channel" and group and n % group)
]


@pytest.mark.parametrize("axis,group,ratio", [("token", 128, 0.0), ("token", 16, 0.05), ("channel", 16, 0.02)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compress_backbone_of_a_rotating_spec(axis, group, ratio, dtype):
    """Hadamard-rotated chunks (GearConfig()'s values): rotated as the oracle rotates them, then the same kernel,
    with the outliers exact in float32 (the rotated entries are float32 sums)."""
    spec = ChunkSpec(3, axis, group, ratio, 2, rotate=True)
    for kind in ("gaussian", "ties"):
        x = _inputs(kind, (2, 3, 64, 64), dtype)
        assert compress_supported(spec, x)
        _assert_same(compute_backbone(x, spec), compress_backbone(x, spec))


@pytest.mark.parametrize("bits,axis,n,d,ratio,rank,group", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compress_backbone_equals_compute_backbone(bits, axis, n, d, ratio, rank, group, dtype):
    spec = ChunkSpec(bits, axis, group, ratio, rank)
    for kind in ("gaussian", "ties", "signed_zeros", "wide"):
        x = _inputs(kind, (2, 3, n, d), dtype)
        assert compress_supported(spec, x)
        _assert_same(compute_backbone(x, spec), compress_backbone(x, spec))


@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compress_backbone_of_widths_per_channel(rank, dtype):
    """Keys with a width per channel (GearConfig()'s keys, `quant.pack_planes`): each (row, head) its own widths
    of 1 to 8 bits with the same total; a chunk given no widths, or widths for a uniform spec, is refused."""
    spec = ChunkSpec(3.25, "channel", 16, 0.0, rank, allocated=True)
    base = torch.tensor([1, 2, 3, 4, 5, 8, 2, 1] * 8, dtype=torch.uint8)
    widths = torch.stack([base[torch.randperm(64, generator=torch.Generator().manual_seed(i))]
                          for i in range(6)]).view(2, 3, 64)
    for kind in ("gaussian", "ties", "wide"):
        x = _inputs(kind, (2, 3, 64, 64), dtype)
        assert compress_supported(spec, x)
        _assert_same(compute_backbone(x, spec, channel_bits=widths), compress_backbone(x, spec, widths))
    with pytest.raises(ValueError, match="channel_bits"):
        compress_backbone(x, spec)
    with pytest.raises(ValueError, match="channel_bits"):
        compress_backbone(x, ChunkSpec(2, "channel", 16, 0.0, 0), widths)


def test_compress_with_the_kernel_equals_compress():
    """Whole chunks: the low-rank fit runs on the kernel's residual, so every stored field is the same."""
    spec = ChunkSpec(2, "channel", 32, 0.02, 4, factor_bits=8)
    x = _inputs("gaussian", (2, 3, 128, 64), torch.bfloat16)[:, :, 16:80]  # a slice of a wider buffer
    _assert_same(compress(x, spec), compress(x, spec, backbone=compress_backbone))


def test_compress_supported_declines():
    x = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    assert compress_supported(ChunkSpec(2, "channel", 16, 0.02, 2), x)
    assert not compress_supported(ChunkSpec(2, "channel", 16, 0.02, 2), x.half())  # fp16 side information
    assert compress_supported(ChunkSpec(2, "channel", 16, 0.0, 0, rotate=True), x)
    assert not compress_supported(ChunkSpec(2, "channel", 16, 0.0, 0, range_search=True), x)
    assert compress_supported(ChunkSpec(2.5, "channel", 16, 0.0, 0, allocated=True), x)
    assert not compress_supported(ChunkSpec(2.5, "channel", 4, 0.0, 0, allocated=True), x[:, :, :60])  # planes of 8
    assert not compress_supported(ChunkSpec(2, "channel", 48, 0.0, 0), x)  # 48 does not split 64 tokens
    assert not compress_supported(ChunkSpec(3, "channel", 0, 0.0, 0), x[:, :, :60])  # 3-bit units of 8 tokens
    assert compress_supported(ChunkSpec(3, "token", 64, 0.0, 0), x)
    assert compress_supported(ChunkSpec(3, "token", 64, 0.0, 0, stats="8"), x)  # 8-bit statistics (values)


def _values(kind: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Value chunks [B,H,n,d] (n >= 8) whose groups 8-bit statistics' grid covers (`quant.stats8`), with its edge
    cases: magnitudes from below the grid's smallest scale (2^-20) to near its largest range, zero and constant
    rows, a zero group, rows of one sign far from 0, ties."""
    g = torch.Generator().manual_seed(len(kind))
    n, d = shape[2], shape[3]
    if kind == "decades":  # per-token magnitudes over 9 decades
        return (torch.randn(shape, generator=g) * torch.logspace(-7, 2, n).view(1, 1, n, 1)).to(dtype)
    if kind == "ties":  # few distinct values: every ranking decided by position
        return (torch.randint(-3, 3, shape, generator=g).float() * 0.5).to(dtype)
    x = torch.randn(shape, generator=g)
    x[..., 0, :] = 0.0  # a zero row (scale code 0)
    x[..., 1, :] = 0.37  # constant rows of either sign
    x[..., 2, :] = -2.5
    x[..., 3, :] = x[..., 3, :].abs() + 5.0  # one sign, far from 0 (zero point 0 / top)
    x[..., 4, :] = -x[..., 4, :].abs() - 0.01
    x[..., 5, : d // 2] = 0.0  # a zero group (groups of <= d/2 channels) beside a non-zero one
    x[..., 6, :] *= 1000.0  # large magnitudes: a range of ~6000, near the grid's largest at 2 bits (~10290)
    x[..., 6, 1] = 3000.0
    x[..., 7, :] = torch.rand(d, generator=g) * 9000.0 + 1000.0  # all positive up to ~10000 (2 bits: <= 10332)
    return x.to(dtype)


# (n, d, group): a square chunk, head_dim 128 with groups of 32, a non-power-of-two head_dim with a short last group
# (64 + 16), an odd one (groups 16, 16, 1), one group per whole vector (KCVT)
STATS8_SHAPES = [(64, 64, 64), (33, 128, 32), (17, 80, 64), (24, 33, 16), (8, 96, 0)]
# (outlier ratio, rank, rotate): backbone only, outliers, low-rank, both, and rotated (GearConfig()'s values)
STATS8_TERMS = [(0.0, 0, False), (0.1, 0, False), (0.0, 2, False), (0.02, 4, False), (0.05, 2, True)]


@pytest.mark.parametrize("n,d,group", STATS8_SHAPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compress_backbone_with_8bit_statistics_equals_compute_backbone(n, d, group, bits, dtype):
    """Values with 8-bit statistics: the same uint8 scale and zero-point codes as `quant.stats8` chooses, the codes
    quantized against their decoded values, the exact outliers and the residual of the decoded backbone."""
    for kind, (ratio, rank, rotate) in itertools.product(("decades", "edges", "ties"), STATS8_TERMS):
        if rotate and d & (d - 1):
            continue  # (the Hadamard rotation needs a power-of-two head_dim)
        spec = ChunkSpec(bits, "token", group, ratio, rank, rotate=rotate, stats="8")
        x = _values(kind, (2, 3, n, d), dtype)
        assert compress_supported(spec, x)
        expected, got = compute_backbone(x, spec), compress_backbone(x, spec)
        assert got.scale.dtype == got.minimum.dtype == torch.uint8
        _assert_same(expected, got)


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_compress_with_8bit_statistics_and_the_kernel_equals_compress(context):
    """Whole chunks (a slice of a wider buffer): the low-rank fit runs on the kernel's residual, so every stored
    field is the same, under inference_mode too."""
    spec = ChunkSpec(3, "token", 32, 0.02, 4, factor_bits=8, stats="8")
    with context():
        x = _values("edges", (2, 3, 96, 64), torch.bfloat16)[:, :, 16:80]
        _assert_same(compress(x, spec), compress(x, spec, backbone=compress_backbone))


def test_8bit_statistics_beyond_the_grid_raise_the_oracles_error():
    x = _values("decades", (1, 2, 16, 64), torch.float32)
    x[0, 1, 9, 3] = 1e6
    spec = ChunkSpec(2, "token", 64, 0.0, 0, stats="8")
    with pytest.raises(ValueError, match=r"8-bit statistics \(value_statistics='8'\) cover ranges up to .*"
                                         r"use value_statistics='16'"):
        compress_backbone(x, spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite(dtype):
    buffer = torch.randn(2, 3, 40, 64).to(dtype)
    x = buffer[:, :, 5:30]
    assert bool(get_backend("numba").all_finite(x)) and bool(get_backend("torch").all_finite(x))
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = buffer.clone()
        y[1, 2, 29, 63] = bad
        assert not bool(get_backend("numba").all_finite(y[:, :, 5:30]))
        assert bool(get_backend("numba").all_finite(y[:, :, 5:29]))  # outside the slice: not looked at


def test_prompt_store_adopts_the_compressed_chunk():
    """A prompt chunk of every row at once becomes the store as it is: the same fields as copying it in."""
    spec = ChunkSpec(2, "token", 64, 0.02, 2, factor_bits=8)
    x = torch.randn(2, 3, 64, 64, dtype=torch.bfloat16)
    adopted, copied = ChunkStore(spec, 64, plan_of("numba")), ChunkStore(spec, 64, plan_of("numba"))
    adopted.compress_rows(x, [0, 1], [0, 0], batch=2, reserve_chunks=1)
    copied.compress_rows(x[:1], [0], [0], batch=2, reserve_chunks=1)
    copied.compress_rows(x[1:], [1], [0], batch=2, reserve_chunks=1)
    assert adopted.fields.keys() == copied.fields.keys() and adopted.capacity == copied.capacity == 1
    for name, t in adopted.fields.items():
        assert torch.equal(t, copied.fields[name]), name
    assert adopted.extent == copied.extent
    assert torch.equal(adopted.reconstruct(1, torch.float32), copied.reconstruct(1, torch.float32))


def _product(a, b, a_scale, b_scale):
    """A Bᵀ of stored factors (dequantized)."""
    a, b = a.float(), b.float()
    if a_scale.shape[2]:
        a, b = a * a_scale.float(), b * b_scale.float()
    return a @ b.transpose(-1, -2)


@pytest.mark.parametrize("factor_bits", [8, 16])
@pytest.mark.parametrize("n,d,rank", [(256, 64, 4), (64, 64, 2), (16, 20, 3), (2, 64, 4)])
def test_fit_factors_equals_torch_fit(n, d, rank, factor_bits):
    """Same shapes and dtypes as `gear.fit_factors`; the same A Bᵀ to float32 rounding (a column may come out with
    the other sign; an int8 code at a rounding boundary may differ by one)."""
    torch.manual_seed(n + d + rank)
    spec = ChunkSpec(2, "channel", 0, 0.0, rank, factor_bits=factor_bits)
    residual = torch.randn(2, 3, n, d) * 0.1 + torch.randn(2, 3, n, 1) @ torch.randn(2, 3, 1, d)
    expected, got = fit_factors(residual, spec, torch.bfloat16), cpu.fit_factors(residual, spec, torch.bfloat16)
    for e, g in zip(expected, got):
        assert e.shape == g.shape and e.dtype == g.dtype
    p_expected, p_got = _product(*expected), _product(*got)
    assert (p_got - p_expected).norm() <= 1e-2 * p_expected.norm()
    fit_error = (residual - p_expected).norm()
    assert abs((residual - p_got).norm() - fit_error) <= 1e-3 * residual.norm()


@pytest.mark.parametrize("seed,n,d,rank,factor_bits", [(6, 16, 64, 4, 8), (6, 64, 64, 2, 16), (21, 16, 64, 4, 8)])
def test_fit_factors_of_a_residual_of_lower_rank_than_asked(seed, n, d, rank, factor_bits):
    """Every token the same vector (a generation looping on one token leaves such a chunk, its residual of rank 1):
    Gram-Schmidt leaves the columns beyond the rank as float32 rounding, alike in every entry, which normalized
    came back as the first column; A then held it twice (A Bᵀ twice the fit, the int8 refit's Gram matrix
    singular): a fit error 100-300x torch's, found on a Qwen3 beam search. Such a column must carry nothing."""
    torch.manual_seed(seed)
    spec = ChunkSpec(2, "channel", 0, 0.0, rank, factor_bits=factor_bits)
    residual = (torch.ones(1, 2, n, 1) * (torch.randn(1, 2, 1, d) * 0.05)).contiguous()
    expected, got = fit_factors(residual, spec, torch.bfloat16), cpu.fit_factors(residual, spec, torch.bfloat16)
    fit_error = (residual - _product(*expected)).norm()
    assert abs((residual - _product(*got)).norm() - fit_error) <= 1e-3 * residual.norm()


def test_fit_factors_of_zeros_and_a_fp16_side_dtype():
    spec = ChunkSpec(2, "channel", 0, 0.0, 2, factor_bits=8)
    a, b, a_scale, b_scale = cpu.fit_factors(torch.zeros(1, 2, 64, 64), spec, torch.bfloat16)
    assert not _product(a, b, a_scale, b_scale).any() and torch.isfinite(a_scale.float()).all()
    with pytest.raises(ValueError, match="bf16"):
        cpu.fit_factors(torch.zeros(1, 2, 64, 64), spec, torch.float16)


def test_reads_see_fields_written_in_place():
    """The store's prepared kernel arrays (side fields cast once) follow in-place writes to its fields."""
    spec = ChunkSpec(2, "channel", 16, 0.05, 2, factor_bits=8)
    store = ChunkStore(spec, 64, plan_of("numba"))
    store.compress_rows(torch.randn(1, 2, 64, 64), [0], [0], batch=1, reserve_chunks=1)
    before = store.reconstruct(1, torch.float32, torch.empty(1, 2, 64, 64)).clone()
    store.fields["sparse_values"].zero_()
    store.fields["minimum"].add_(1)
    after = store.reconstruct(1, torch.float32, torch.empty(1, 2, 64, 64))
    expected = ChunkStore(spec, 64, plan_of("torch"))
    expected.fields, expected.extent, expected.capacity = store.fields, store.extent, 1
    expected.head_dim, expected.dtype = 64, store.dtype
    torch.testing.assert_close(after, expected.reconstruct(1, torch.float32), rtol=0, atol=1e-5)
    assert not torch.equal(after, before)
