"""The stored format: fields declared by the terms equal what compression writes, and a term defined here (the
recipe of gear_hf.compress.terms) round-trips through the torch backend, the storage and the memory report."""

from __future__ import annotations

import itertools

import pytest
import torch

import gear_hf
from gear_hf.backends import resolve
from gear_hf.compress import ChunkSpec, compress, decompress
from gear_hf.compress.allocation import even_channel_bits
from gear_hf.compress.terms import Field, Term, active_terms, chunk_fields, register_term, unregister_term
from gear_hf.format import layer_formats
from tiny_models import tiny_model

SPECS = [ChunkSpec(bits, axis, group, ratio, rank, factor_bits=factor_bits, rotate=rotate)
         for bits, axis, group, ratio, rank, factor_bits, rotate in itertools.product(
             (2, 3, 4, 8), ("channel", "token"), (0, 16, 24), (0.0, 0.05), (0, 3), (8, 16), (False, True))
         if not (group == 24 and axis == "channel")]
SPECS += [ChunkSpec(3.125, "channel", 16, 0.0, 0, allocated=True), ChunkSpec(2.5, "channel", 32, 0.0, 2,
                                                                             allocated=True, factor_bits=8)]
SPECS += [ChunkSpec(bits, "token", group, ratio, rank, rotate=rotate, stats="8")  # 8-bit value statistics
          for bits, group, ratio, rank, rotate in itertools.product((2, 3, 4, 8), (0, 16, 24), (0.0, 0.05), (0, 3),
                                                                    (False, True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 40])
def test_declared_fields_are_what_compress_writes(dtype, d):
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 64, d) * 3).to(dtype)
    for spec in SPECS:
        bits = even_channel_bits(2, 3, d, spec.bits) if spec.allocated else None
        chunk = compress(x, spec, channel_bits=bits)
        declared = chunk_fields(spec, 64, d, torch.float16 if dtype == torch.float16 else torch.bfloat16)
        assert sorted(f.name for f in declared) == sorted(chunk.fields), spec
        for f in declared:
            t = chunk.fields[f.name]
            assert (tuple(t.shape[2:]), t.dtype) == (f.shape, f.dtype), (spec, f)


class ChannelOffset(Term):
    """A test term: each chunk's per-channel mean, removed before the others and added back after them."""

    name = "channel-offset"

    def fields(self, spec, n, d, side):
        return (Field("channel_offset", (1, d), side, "offsets"),)

    def transforms(self, spec):
        return True

    def transform(self, st):
        offset = st.work.float().mean(dim=2, keepdim=True).to(st.side)  # [B,H,1,d]
        st.out["channel_offset"] = offset
        st.work = st.work.float() - offset.float()

    def untransform(self, ds):
        n = ds.n
        offset = ds.chunk.channel_offset.float()  # [B,H,C,d]: one row per chunk
        ds.x = (ds.x.view(*ds.x.shape[:2], ds.chunks, n, ds.d) + offset.unsqueeze(3)).flatten(2, 3)


@pytest.fixture
def channel_offset():
    term = register_term(ChannelOffset())
    yield term
    unregister_term(term.name)


def test_a_term_defined_here_round_trips_through_the_torch_backend(channel_offset):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 32) + 40 * torch.randn(32)  # large channel offsets
    plain = ChunkSpec(2, "token", 32, 0.0, 0)
    with_term = ChunkSpec(2, "token", 32, 0.0, 0, extra_terms=("channel-offset",))
    assert active_terms(with_term) == ("backbone", "channel-offset")
    chunk = compress(x, with_term)
    assert chunk.channel_offset.shape == (2, 3, 1, 32)
    error = (decompress(chunk, with_term, 64, 32, torch.float32) - x).abs().mean()
    plain_error = (decompress(compress(x, plain), plain, 64, 32, torch.float32) - x).abs().mean()
    assert error < 0.5 * plain_error  # the term does what it is for (the offsets no longer set the groups' ranges)
    # runs of chunks: each chunk's own offset
    two = torch.cat([x, x + 100], dim=2)
    run = compress(two.view(2, 3, 2, 64, 32).transpose(1, 2).reshape(4, 3, 64, 32), with_term)
    stacked = {k: v.view(2, 2, *v.shape[1:]).transpose(1, 2).flatten(2, 3) for k, v in run.fields.items()}
    from gear_hf.compress import CompressedChunk

    back = decompress(CompressedChunk(stacked), with_term, 64, 32, torch.float32, chunks=2)
    assert (back - two).abs().mean() < 0.5 * plain_error


def test_a_term_defined_here_is_stored_counted_and_refused_by_kernels(channel_offset):
    config = gear_hf.GearConfig.preset("kivi", bits=2, group_size=16, buffer_size=16, extra_terms=("channel-offset",))
    assert all("channel-offset" in fmt.terms for fmt in layer_formats(config))
    plan = resolve(config, 16, torch.float32, torch.device("cpu"))
    assert plan.names() == {"compress": "torch", "reconstruct": "torch", "attend": "reference"}
    assert any("channel-offset" in reason for _, reason in plan.skipped["compress"])
    with pytest.raises(ValueError, match="'numba' cannot run here.*channel-offset"):
        resolve(config.replace(backend="numba"), 16, torch.float32, torch.device("cpu"))
    model = tiny_model("llama3")
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    with gear_hf.enabled(model, config), torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        cache = gear_hf.last_cache(model)
    store = cache.layers[0].key_stream.decode
    assert "channel_offset" in store.fields and store.component["channel_offset"] == "offsets"
    report = cache.memory_report()
    assert report["offsets"] > 0 and sum(cache.decode_chunks) > 0


def test_unknown_extra_term_is_refused():
    with pytest.raises(ValueError, match="extra_terms"):
        gear_hf.GearConfig(extra_terms=("nope",))
    with pytest.raises(ValueError, match="unregistered term"):
        ChunkSpec(2, "channel", 16, 0.0, 0, extra_terms=("nope",)).terms
    with pytest.raises(ValueError, match="built in"):
        unregister_term("backbone")
