"""Triton quantize + pack kernels vs the torch reference (gear_hf.compress.quant): codes, scales and minimums
must be equal bit for bit, in the exact layout ChunkStore stores.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py and, for a
standalone run, below, before gear_hf.kernels.quant is imported); with CUDA they are compiled and run on it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from gear_hf.compress import ChunkSpec, compress, quant, select_outliers, side_dtype  # noqa: E402
from gear_hf.kernels.quant import _TL_DTYPES, _next_toward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qp():
    from gear_hf.kernels.quant import quantize_pack

    return quantize_pack


def _reference(x, bits, axis, group, exclude=None, stats_dtype=None):
    codes, scale, minimum = quant.quantize(x, bits, axis, group, exclude=exclude, stats_dtype=stats_dtype)
    return quant.pack_codes(codes, bits, -2 if axis == "channel" else -1), scale, minimum


def _assert_same(got, want):
    for name, g, w in zip(("codes", "scale", "minimum"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        diff = (g != w).sum().item()
        assert diff == 0, f"{name}: {diff} of {w.numel()} entries differ"


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    x[..., 1] *= 20  # an outlier channel
    exclude = torch.rand(*shape, generator=g) < 0.1
    return x.to(dtype).to(DEVICE), exclude.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis,group,d", [("channel", 16, 64), ("channel", 48, 40), ("token", 16, 64),
                                          ("token", 48, 40)])
def test_quantize_pack_bit_exact(dtype, bits, axis, group, d):
    """Odd shapes: d=40 (not a power of two; for values not a multiple of the group: a short last group,
    only real channels coded), group 48 (not a power of two), 96 tokens; with an exclusion mask. 3 bits: 8 codes in
    3 bytes."""
    x, exclude = _data((2, 2, 96, d), dtype, seed=bits * 7 + d)
    if axis == "channel":
        exclude[0, 1, :group, 5] = True  # one fully excluded group: stats 0, codes from x/1
    else:
        exclude[1, 1, 7, :] = True
    _assert_same(_qp()(x, bits, axis, group, exclude=exclude), _reference(x, bits, axis, group, exclude=exclude))
    if dtype == torch.float32:
        _assert_same(_qp()(x, bits, axis, group), _reference(x, bits, axis, group))


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_pack_coarse_groups_and_stats_dtype(bits):
    """KCVT: one group per whole channel (keys) / whole token (values); stats in another dtype."""
    x, exclude = _data((1, 2, 128, 64), torch.float16, seed=bits)
    _assert_same(_qp()(x, bits, "channel", 128, exclude=exclude), _reference(x, bits, "channel", 128, exclude=exclude))
    _assert_same(_qp()(x, bits, "token", 64), _reference(x, bits, "token", 64))
    _assert_same(_qp()(x, bits, "token", 32, stats_dtype=torch.float32),
                 _reference(x, bits, "token", 32, stats_dtype=torch.float32))


def _group_range(x, exclude, axis, group):
    """float32 (lo, hi) of each group over the entries not excluded (as the reference; empty groups -> inf)."""
    xg, member = quant._grouped(x.float(), axis, group)
    eg = quant._grouped(exclude.to(torch.uint8), axis, group)[0].bool()
    if axis == "token" and x.shape[-1] % group:
        eg = eg | (torch.arange(xg.shape[3] * group, device=x.device).view(-1, group) >= x.shape[-1])
    return xg.masked_fill(eg, float("inf")).amin(member), xg.masked_fill(eg, float("-inf")).amax(member)


@pytest.mark.parametrize("x_dtype,stats_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float16), (torch.float32, torch.float32)],
                         ids=str)
@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quantize_pack_bit_exact_when_stats_are_stepped(x_dtype, stats_dtype, bits, axis):
    """Groups whose stats rounded to nearest would not cover their range (minimum above the group's min when x
    is wider than the stats dtype, scale rounded down): the reference steps them one ulp, and so must the
    kernel. Groups: offset, large offset with a tiny spread, negative, straddling 0, all equal, and empty."""
    g = torch.Generator().manual_seed(bits)
    r = torch.randn(5, 64, 40, generator=g)
    x = torch.stack([r[0] * 3 + 5, 1000 + r[1] * 1e-2, -300 + r[2] * 7, r[3] * 1e-3, torch.full_like(r[4], 0.1)])
    x = x[None].to(x_dtype).to(DEVICE)
    exclude = (torch.rand(1, 5, 64, 40, generator=g) < 0.05).to(DEVICE)
    exclude[0, 2, :16, :16] = True  # empty groups along both axes
    want = _reference(x, bits, axis, 16, exclude=exclude, stats_dtype=stats_dtype)
    _assert_same(_qp()(x, bits, axis, 16, exclude=exclude, stats_dtype=stats_dtype), want)
    # the adjustments do happen here: the stored stats differ from the ones rounded to nearest
    lo, hi = _group_range(x, exclude, axis, 16)
    _, scale, minimum = want
    assert bool((scale == 0).any() & (minimum == 0).any())  # the empty groups
    if stats_dtype != torch.float32:
        assert bool((scale != ((hi - minimum.float()) / quant.levels(bits)).to(stats_dtype)).any())
    if x_dtype == torch.float32 and stats_dtype != torch.float32:
        assert bool((minimum != lo.to(stats_dtype)).any())


@triton.jit
def _next_toward_kernel(x_ptr, up_ptr, down_ptr, n, STATS_DT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(up_ptr + offs, _next_toward(x, True, STATS_DT), mask=ok)
    tl.store(down_ptr + offs, _next_toward(x, False, STATS_DT), mask=ok)


@pytest.mark.parametrize("stats_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_next_toward_is_torch_nextafter(stats_dtype):
    """The kernels' one-ulp step equals torch.nextafter (what the reference uses), bit for bit, for every finite
    fp16 / bf16 value (±0, subnormals, ±max included) and a sample of fp32 ones."""
    if stats_dtype == torch.float32:
        bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(0),
                             dtype=torch.int32)
        special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.1754944e-38, 3.4028235e38, -3.4028235e38])
        v = torch.cat([bits.view(torch.float32), special])
    else:
        v = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(stats_dtype)
    v = v[torch.isfinite(v)]
    x = v.float().to(DEVICE)
    up, down = torch.empty_like(x), torch.empty_like(x)
    _next_toward_kernel[(triton.cdiv(x.numel(), 1024),)](x, up, down, x.numel(), STATS_DT=_TL_DTYPES[stats_dtype],
                                                          BLOCK=1024)
    for got, direction in ((up, float("inf")), (down, float("-inf"))):
        want = torch.nextafter(v, torch.full_like(v, direction)).float()
        diff = got.cpu().view(torch.int32) != want.view(torch.int32)
        assert not diff.any(), (direction, v[diff][:5], got.cpu()[diff][:5], want[diff][:5])


def test_round_half_to_even_ties():
    """Values that land exactly on .5 steps: torch.round sends them to the even neighbour."""
    # one channel group of 4 tokens: min 0, max 3 -> scale 1 (2 bits), entries 0.5/1.5/2.5 are exact ties
    x = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.49999997], dtype=torch.float32)
    x = x.view(1, 1, 8, 1).repeat(1, 1, 1, 4).contiguous().to(DEVICE)
    _assert_same(_qp()(x, 2, "channel", 8), _reference(x, 2, "channel", 8))
    xt = x.transpose(-1, -2).contiguous()  # [1,1,4,8]: per-token groups of 8 channels
    _assert_same(_qp()(xt, 2, "token", 8), _reference(xt, 2, "token", 8))


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_matches_chunkstore_layout(axis):
    """The codes/stats the torch engine stores for a compressed chunk (outliers excluded from min/max) are what
    the kernel writes, also when writing through `out=` views into a preallocated multi-chunk field."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 2, 64, 64, generator=g) * 2).to(DEVICE)
    spec = ChunkSpec(bits=2, axis=axis, group=16, outlier_ratio=0.05, rank=2)
    chunk = compress(x, spec)
    _, _, mask = select_outliers(x, axis, spec.outlier_ratio)
    got = _qp()(x, spec.bits, axis, spec.group, exclude=mask, stats_dtype=side_dtype(x.dtype))
    _assert_same(got, (chunk.codes, chunk.scale, chunk.minimum))

    # write chunk 1 of 3 of a ChunkStore-like field (slots along dim 2)
    fields = [torch.zeros(2, 2, 3 * t.shape[2], t.shape[3], dtype=t.dtype, device=DEVICE) for t in got]
    views = [f[:, :, t.shape[2]: 2 * t.shape[2]] for f, t in zip(fields, got)]
    _qp()(x, spec.bits, axis, spec.group, exclude=mask, stats_dtype=side_dtype(x.dtype), out=views)
    for f, t in zip(fields, got):
        e = t.shape[2]
        assert torch.equal(f[:, :, e: 2 * e], t)
        assert not f[:, :, :e].any() and not f[:, :, 2 * e:].any()


def test_rejects_bad_arguments():
    x = torch.zeros(1, 1, 32, 64, device=DEVICE)
    with pytest.raises(ValueError):
        _qp()(x, 5, "channel", 16)
    with pytest.raises(ValueError):
        _qp()(x, 3, "channel", 4)  # 3-bit codes come in units of 8
    with pytest.raises(ValueError):
        _qp()(x, 2, "channel", 6)  # a group that does not hold whole bytes
    with pytest.raises(ValueError):
        _qp()(x[:, :, :30], 2, "channel", 16)  # tokens not a multiple of the group
