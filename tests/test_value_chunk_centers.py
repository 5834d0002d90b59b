"""Value chunks coded by the value buffer's centers (`GearConfig.value_chunks_centered`): each row's value centers
(gear_hf/cache/channel_centers.py, fitted to its first step before anything of it is compressed) are taken out of the
values
its chunks compress and added back when they are read; the fused kernels are handed every value centered (chunks and
buffer codes as stored, the sink and the step's own tokens minus the centers) and add the centers to their output once
(`StreamView.center`). Token by token against an oracle, what a value bias costs the chunks without it, the bytes, the
paths that must agree (reference, numba fused; Triton: tests/test_triton_tail.py), beams and the config."""

from __future__ import annotations

import copy

import pytest
import torch
from test_held_values import FUSED, _fill, held_oracle
from test_key_centers import beams_match_reference, fused_matches_reference
from test_value_centers import BOTH, _value_centers, with_value_bias

from gear_hf import GearConfig
from gear_hf.cache.fused import row_local_tokens
from gear_hf.format import layer_formats
from tiny_models import tiny_model

CHUNKS = dict(BOTH, value_chunks_centered=True)


@pytest.mark.parametrize("steps", [[40] + [1] * 45, [20] + [1] * 50 + [7, 3], [75] + [1] * 20])
def test_centered_value_chunks_token_by_token(steps):
    """Each value is where the oracle says for the values minus their centers (chunks compressed from them, the
    held chunk from its buffered codes of them), plus the centers; the sink exact; the keys as without the field."""
    config = GearConfig(**CHUNKS)
    cache, v = _fill(config, steps, offset={5: 30.0, 11: -12.0})
    s = cache.sink_len[0]
    value_format = layer_formats(config)[1]
    assert value_format.centered and value_format.chunks_centered
    center = _value_centers(v[:, :, s : steps[0]])
    expected = held_oracle(v - center, value_format, steps, cache)[None] + center
    expected[:, :, :s] = v[:, :, :s]
    (keys, values), = row_local_tokens(cache, 0)
    torch.testing.assert_close(values, expected[0], rtol=1e-6, atol=1e-5)  # (float32 rounding on values ~30)
    plain, _ = _fill(GearConfig(**BOTH), steps, offset={5: 30.0, 11: -12.0})
    assert torch.equal(keys, row_local_tokens(plain, 0)[0][0])


def test_a_value_bias_sets_no_chunk_tokens_range():
    """Values with a large constant offset on two channels: with their chunks centered, the compressed values err
    about as without an offset; otherwise the offset sets every compressed token's 3-bit range."""
    steps = [40] + [1] * 30
    errors = {}
    for on in (False, True):
        cache, v = _fill(GearConfig(**dict(CHUNKS, value_chunks_centered=on)), steps, offset={3: 60.0, 17: -40.0})
        s, p = cache.sink_len[0], cache.prefill_len[0]
        (_, values), = row_local_tokens(cache, 0)
        errors[on] = (values[:, s : s + p] - v[0, :, s : s + p]).abs().max().item()  # the prompt chunk
    assert errors[True] < 1.0 < errors[False] / 4, errors


@pytest.mark.parametrize("prompt", [10, 40])
def test_no_byte_more_and_a_short_first_step_reads_uncentered(prompt):
    """The chunks are coded by centers the value buffer holds already: the same bytes, owned and held. A row whose
    first step buffered fewer than 16 tokens has no centers: its chunks are as with the field off."""
    steps = [prompt] + [1] * 45
    (cache, _), (plain, _) = (_fill(GearConfig(**dict(CHUNKS, value_chunks_centered=on)), steps)
                              for on in (True, False))
    report, plain_report = cache.memory_report(), plain.memory_report()
    for field in ("owned_bytes", "held_bytes", "spare_bytes", "scales", "codes"):
        assert report[field] == plain_report[field], field
    fitted = cache.layers[0].value_stream.buffer.centers.fitted
    assert fitted == (prompt - cache.sink_len[0] >= 16)
    same = torch.equal(row_local_tokens(cache, 0)[0][1], row_local_tokens(plain, 0)[0][1])
    assert same != fitted


@pytest.mark.parametrize("arch,value_buffer", [("qwen2", "int4"), ("llama3", "int8")])
def test_fused_cpu_attention_reads_centered_chunks_as_the_reference_path(arch, value_buffer):
    """A left-padded batch under inference mode on a deep copy of a model with a value bias: the numba fused attention
    (handed every value centered, the centers added to its output) gives the torch backend's tokens and logits, and
    the field moves the logits."""
    model = with_value_bias(copy.deepcopy(tiny_model(arch, head_dim=32)))
    fields = dict(FUSED, key_buffer_size=32, held_for=0.5, key_buffer_centered=True, value_buffer_centered=True,
                  value_chunks_centered=True, value_buffer=value_buffer)
    cache = fused_matches_reference(model, fields, "value_chunks_centered")
    assert cache.layers[0].value_stream.decode.centers is cache.layers[0].value_stream.buffer.centers


def test_beams_carry_each_rows_chunk_centers():
    fields = dict(FUSED, key_buffer_size=32, held_for=0.5, key_buffer_centered=True, value_buffer_centered=True,
                  value_chunks_centered=True)
    cache = beams_match_reference(tiny_model("qwen2", head_dim=32), fields)
    assert cache.layers[0].value_stream.buffer.centers.fields["center"].shape[0] == 6


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_config_takes_a_bool(value):
    with pytest.raises(ValueError, match=r"value_chunks_centered=.*True or False"):
        GearConfig(value_chunks_centered=value)


@pytest.mark.parametrize("fields", [dict(value_buffer_centered=False),
                                    dict(value_buffer="full", value_buffer_size=None, key_buffer_size=None,
                                         held_for=1.0)], ids=["buffer-not-centered", "full-buffer"])
def test_ignored_where_the_value_buffer_is_not_centered(fields):
    """No centers to code the chunks by: nothing changes (values, bytes)."""
    config = GearConfig(**dict(CHUNKS, **fields))
    (cache, _), (plain, _) = (_fill(c, [40] + [1] * 30) for c in (config, config.replace(value_chunks_centered=False)))
    assert not layer_formats(config)[1].chunks_centered
    assert torch.equal(row_local_tokens(cache, 0)[0][1], row_local_tokens(plain, 0)[0][1])
    assert cache.memory_report()["owned_bytes"] == plain.memory_report()["owned_bytes"]
