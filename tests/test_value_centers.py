"""Values centered per channel in the buffer (`GearConfig.value_buffer_centered`, gear_hf/cache/channel_centers.py):
each
row's centers (the mean of its first step's buffered values, an int8 code a channel in steps of the head's largest
|mean| / 127) are taken out before a value is coded and added back when it is read. Token by token against an oracle
written here, what a value bias costs without them, the memory report, the paths that must agree (reference, numba
fused; Triton: tests/test_triton_tail.py), beams and the config."""

from __future__ import annotations

import copy

import pytest
import torch
from test_held_values import FUSED, _coded, _fill, held_oracle
from test_key_centers import CENTERED, beams_match_reference, fused_matches_reference

from gear_hf import GearConfig
from gear_hf.cache.fused import row_local_tokens
from gear_hf.format import layer_formats
from tiny_models import tiny_model

BOTH = dict(CENTERED, value_buffer_centered=True, value_chunks_centered=False)


def _value_centers(first: torch.Tensor) -> torch.Tensor:
    """[1,H,1,d] centers from a row's first step's buffered values first [1,H,n,d] (written out here: the mean, as an
    int8 code in steps of the head's largest |mean| / 127 rounded to bf16)."""
    mean = first.mean(dim=2, keepdim=True)
    step = (mean.abs().amax(dim=-1, keepdim=True) / 127).to(torch.bfloat16).float()
    return torch.round(mean / step).clamp(-127, 127) * step


@pytest.mark.parametrize("steps", [[40] + [1] * 45, [20] + [1] * 50 + [7, 3], [75] + [1] * 20])
def test_centered_values_token_by_token(steps):
    """Each value is where the oracle says with the buffer's codes of x - center read back plus center (the held
    chunk compressed from them); the keys are those of the keys-only centered cache."""
    config = GearConfig(**BOTH)
    cache, v = _fill(config, steps, offset={5: 30.0, 11: -12.0})
    s = cache.sink_len[0]
    key_format, value_format = layer_formats(config)
    assert key_format.centered and value_format.centered
    center = _value_centers(v[:, :, s : steps[0]])

    def tail(z):
        return _coded(z - center, value_format.tail) + center

    (keys, values), = row_local_tokens(cache, 0)
    torch.testing.assert_close(values, held_oracle(v, value_format, steps, cache, tail=tail)[None][0], rtol=1e-6,
                               atol=1e-5)  # (float32 rounding order on values ~30)
    keys_only, _ = _fill(GearConfig(**CENTERED), steps, offset={5: 30.0, 11: -12.0})
    assert torch.equal(keys, row_local_tokens(keys_only, 0)[0][0])


def test_a_value_bias_sets_no_tokens_range():
    """Values with a large constant offset on two channels: centered, the buffer's values err about as without it;
    uncentered, the offset sets every token's 4-bit range (far larger errors)."""
    steps = [40] + [1] * 30
    errors = {}
    for centered in (False, True):
        cache, v = _fill(GearConfig(**dict(BOTH, value_buffer_centered=centered)), steps, offset={3: 60.0, 17: -40.0})
        s, p, c = cache.sink_len[0], cache.prefill_len[0], cache.decode_chunks[0]
        (_, values), = row_local_tokens(cache, 0)
        newest = s + p + (c - 1) * 16  # the held chunk and the buffer: the per-token format's tokens
        errors[centered] = (values[:, newest:] - v[0, :, newest:]).abs().max().item()
    assert errors[True] < 0.5 < errors[False] / 4, errors


@pytest.mark.parametrize("prompt", [1, 18])
def test_memory_report_counts_the_value_centers(prompt):
    """A fitted row holds per head an int8 center a channel and one 16-bit step, counted as held ('scales') and owned,
    nothing spare; a row whose first step buffered fewer than 16 tokens holds nothing and reads uncentered."""
    steps = [prompt] + [1] * 45
    (cache, v), (plain, _) = (_fill(GearConfig(**dict(BOTH, value_buffer_centered=on)), steps) for on in (True, False))
    reports = [plain.memory_report(), cache.memory_report()]
    B, H, d = 1, 2, 32
    fitted = prompt - cache.sink_len[0] >= 16
    assert cache.layers[0].value_stream.buffer.centers.fitted == fitted
    assert reports[1]["scales"] - reports[0]["scales"] == (B * H * (d + 2) if fitted else 0)
    assert reports[1]["owned_bytes"] - reports[0]["owned_bytes"] == (B * H * (d + 2) if fitted else 0)
    assert reports[1]["spare_bytes"] == reports[0]["spare_bytes"]
    if not fitted:
        assert torch.equal(row_local_tokens(cache, 0)[0][1], row_local_tokens(plain, 0)[0][1])


def with_value_bias(model):
    """model with a value bias, as Qwen2's (what the centers take out), in place: -3..3 over the outputs."""
    with torch.no_grad():
        for layer in model.model.layers:
            proj = layer.self_attn.v_proj
            if proj.bias is None:
                proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features))
            proj.bias.copy_(torch.linspace(-3, 3, proj.out_features))
    return model


@pytest.mark.parametrize("arch,value_buffer", [("llama3", "int4"), ("qwen2", "int4"), ("llama3", "int8-rotated"),
                                               ("llama3", "int8")])
def test_fused_cpu_attention_reads_centered_values_as_the_reference_path(arch, value_buffer):
    """A left-padded batch under inference mode on a deep copy of the model, rows flushing and releasing on different
    steps: the numba fused attention (values read in the basis their buffer stores them in) gives the torch backend's
    tokens and logits, and centering the values moves the logits (it is read); every per-token value format."""
    model = with_value_bias(copy.deepcopy(tiny_model(arch, head_dim=32)))
    both = dict(FUSED, key_buffer_size=32, held_for=0.5, key_buffer_centered=True, value_buffer_centered=True,
                value_buffer=value_buffer)
    cache = fused_matches_reference(model, both, "value_buffer_centered")
    assert cache.layers[0].value_stream.buffer.centers.fitted


def test_beams_carry_each_rows_value_centers():
    """Beam search reorders rows: each keeps its centers (torch and numba agree on every beam's tokens)."""
    both = dict(FUSED, key_buffer_size=32, held_for=0.5, key_buffer_centered=True, value_buffer_centered=True)
    cache = beams_match_reference(tiny_model("qwen2", head_dim=32), both)
    assert cache.layers[0].value_stream.buffer.centers.fields["center"].shape[0] == 6


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_config_takes_a_bool(value):
    with pytest.raises(ValueError, match=r"value_buffer_centered=.*True or False"):
        GearConfig(value_buffer_centered=value)


@pytest.mark.parametrize("value_buffer", ["full", "final"])
def test_centering_is_ignored_where_values_are_not_buffered_per_token(value_buffer):
    """value_buffer "full" or "final": nothing is centered (values, bytes as with the field off)."""
    fields = dict(BOTH, value_buffer=value_buffer, value_buffer_size=None, key_buffer_size=None, held_for=1.0,
                  value_statistics="16")
    config = GearConfig(**dict(fields, value_buffer_centered=True))
    (cache, v), (plain, _) = (_fill(c, [40] + [1] * 30) for c in (config, config.replace(value_buffer_centered=False)))
    assert not layer_formats(config)[1].centered
    assert torch.equal(row_local_tokens(cache, 0)[0][1], row_local_tokens(plain, 0)[0][1])
    assert cache.memory_report()["owned_bytes"] == plain.memory_report()["owned_bytes"]
