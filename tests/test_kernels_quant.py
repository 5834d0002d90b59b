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

pytest.importorskip("triton")

from gear_hf.compress import ChunkSpec, compress, quant, select_outliers  # noqa: E402

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
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis,group,d", [("channel", 16, 64), ("channel", 48, 40), ("token", 16, 64),
                                          ("token", 48, 40)])
def test_quantize_pack_bit_exact(dtype, bits, axis, group, d):
    """Odd shapes: d=40 (not a power of two; for values not a multiple of the group: padded channels are
    coded too), group 48 (not a power of two), 96 tokens; with an exclusion mask."""
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
    got = _qp()(x, spec.bits, axis, spec.group, exclude=mask)
    _assert_same(got, (chunk.codes, chunk.scale, chunk.minimum))

    # write chunk 1 of 3 of a ChunkStore-like field (slots along dim 2)
    fields = [torch.zeros(2, 2, 3 * t.shape[2], t.shape[3], dtype=t.dtype, device=DEVICE) for t in got]
    views = [f[:, :, t.shape[2]: 2 * t.shape[2]] for f, t in zip(fields, got)]
    _qp()(x, spec.bits, axis, spec.group, exclude=mask, out=views)
    for f, t in zip(fields, got):
        e = t.shape[2]
        assert torch.equal(f[:, :, e: 2 * e], t)
        assert not f[:, :, :e].any() and not f[:, :, 2 * e:].any()


def test_rejects_bad_arguments():
    x = torch.zeros(1, 1, 32, 64, device=DEVICE)
    with pytest.raises(ValueError):
        _qp()(x, 3, "channel", 16)
    with pytest.raises(ValueError):
        _qp()(x, 2, "channel", 6)  # a group that does not hold whole bytes
    with pytest.raises(ValueError):
        _qp()(x[:, :, :30], 2, "channel", 16)  # tokens not a multiple of the group
