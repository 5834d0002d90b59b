"""Keys centered and scaled per channel in the buffer (`GearConfig.key_buffer_centered`,
gear_hf/cache/channel_centers.py):
each row's center and power-of-two scale come from its first step's tokens, every key the buffer codes is coded as
(x - center) / scale and read back through them. Token by token against an oracle written here, the paths that must
agree on it (reference, numba fused; Triton: tests/test_triton_tail.py), beams, the memory report, a short prompt, the
config, and what it is for: a key bias that would set every token's 8-bit range."""

from __future__ import annotations

import copy

import pytest
import torch
from test_held_keys import HELD_KEYS
from test_held_values import FUSED, _coded, _fill, _generate, held_oracle

from gear_hf import GearConfig
from gear_hf.cache.channel_centers import MIN_FIT_TOKENS, SPREAD_RANGE
from gear_hf.cache.fused import row_local_tokens
from gear_hf.format import layer_formats
from tiny_models import prompts, tiny_model

CENTERED = dict(HELD_KEYS, held_for=0.5, key_buffer_centered=True, value_buffer_centered=False)


def _centers(first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(center, scale) [1,H,1,d] from a row's first step's buffered tokens first [1,H,n,d] (written out here: the mean
    rounded to bf16; a power of two at or above the square root of the largest deviation, that at least the head's
    widest / 2^8)."""
    center = first.mean(dim=2, keepdim=True).to(torch.bfloat16).float()
    spread = (first - center).abs().amax(dim=2, keepdim=True)
    spread = torch.maximum(spread, spread.amax(dim=-1, keepdim=True) / 2 ** SPREAD_RANGE)
    return center, torch.exp2(torch.ceil(torch.log2(spread) / 2))


@pytest.mark.parametrize("steps", [[40] + [1] * 45, [20] + [1] * 50 + [7, 3], [75] + [1] * 20])
def test_centered_keys_token_by_token(steps):
    """Keys are where the oracle says with the buffer's codes of (x - center) / scale read back times scale plus
    center; values are not centered."""
    config = GearConfig(**CENTERED)
    cache, x = _fill(config, steps, stream="key")
    _, v = _fill(config, steps)
    s = cache.sink_len[0]
    key_format, value_format = layer_formats(config)
    assert key_format.centered and not value_format.centered
    center, scale = _centers(x[:, :, s : steps[0]])

    def tail(z):  # (token by token, as the cache codes each step's tokens: a rotation summed over more rows can
        # differ in the last bit, enough to move the bf16 rounding of a token's 8-bit scale)
        coded = [_coded((z[:, :, i : i + 1] - center) / scale, key_format.tail) for i in range(z.shape[2])]
        return torch.cat(coded, dim=2) * scale + center

    (keys, values), = row_local_tokens(cache, 0)
    torch.testing.assert_close(keys, held_oracle(x, key_format, steps, cache, tail=tail)[None][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(values, held_oracle(v, value_format, steps, cache), rtol=0, atol=1e-6)


def test_a_key_bias_sets_no_tokens_range():
    """Keys with a large constant offset on two channels: centered, the buffer's keys err about as without the
    offset; uncentered, the offset's channels set every token's 8-bit range (far larger errors)."""
    steps = [40] + [1] * 30
    errors = {}
    for centered in (False, True):
        config = GearConfig(**dict(CENTERED, key_buffer_centered=centered))
        cache, x = _fill(config, steps, stream="key", offset={3: 400.0, 17: -250.0})
        s, p, c = cache.sink_len[0], cache.prefill_len[0], cache.decode_chunks[0]
        (keys, _), = row_local_tokens(cache, 0)
        newest = s + p + (c - 1) * 16  # the held chunk and the buffer: the per-token format's tokens
        errors[centered] = (keys[:, newest:] - x[0, :, newest:]).abs().max().item()
    assert errors[True] < 0.05 < errors[False] / 10, errors


@pytest.mark.parametrize("prompt", [1, 4 + MIN_FIT_TOKENS - 1])
def test_a_short_first_step_leaves_the_row_uncentered(prompt):
    """A row whose first step buffers fewer than MIN_FIT_TOKENS tokens (4 of them sinks) is never centered, and
    nothing is stored for it: its keys are the uncentered format's, token by token."""
    steps = [prompt] + [1] * 40
    cache, x = _fill(GearConfig(**CENTERED), steps, stream="key")
    plain, _ = _fill(GearConfig(**dict(CENTERED, key_buffer_centered=False)), steps, stream="key")
    centers = cache.layers[0].key_stream.buffer.centers
    assert centers.settled == [True] and not centers.fitted and centers.kernel_affine() is None
    assert torch.equal(row_local_tokens(cache, 0)[0][0], row_local_tokens(plain, 0)[0][0])
    assert cache.memory_report()["owned_bytes"] == plain.memory_report()["owned_bytes"]


def test_memory_report_counts_the_centers():
    """Per row and head of each key buffer 2.5 bytes a channel (16-bit center, 4-bit exponent) + 1 (the head's lowest
    exponent), counted as held ('scales') and owned; nothing spare."""
    steps = [40] + [1] * 45
    reports = [_fill(GearConfig(**dict(CENTERED, key_buffer_centered=on)), steps)[0].memory_report()
               for on in (False, True)]
    B, H, d = 1, 2, 32
    assert reports[1]["scales"] - reports[0]["scales"] == B * H * (d * 5 // 2 + 1)
    assert reports[1]["owned_bytes"] - reports[0]["owned_bytes"] == B * H * (d * 5 // 2 + 1)
    assert reports[1]["spare_bytes"] == 0


@pytest.mark.parametrize("arch,key_buffer", [("llama3", "int8-rotated"), ("qwen2", "int8-rotated"), ("llama3", "int8"),
                                             ("llama3", "int4")])
def test_fused_cpu_attention_reads_centered_keys_as_the_reference_path(arch, key_buffer):
    """A left-padded batch under inference mode, rows flushing and releasing on different steps, 28 decode steps on a
    deep copy of the model: the numba fused attention gives the torch backend's tokens and logits, and centering
    moves the logits (it is read); every per-token key format."""
    model = copy.deepcopy(tiny_model(arch, head_dim=32))
    centered = dict(FUSED, key_buffer_size=32, held_for=0.5, key_buffer_centered=True, key_buffer=key_buffer)
    cache = fused_matches_reference(model, centered, "key_buffer_centered")
    assert cache.layers[0].key_stream.buffer.centers.fitted


def fused_matches_reference(model, fields: dict, field: str):
    """A left-padded batch (rows flushing and releasing on different steps), 28 greedy steps under inference mode:
    the numba fused attention gives the torch backend's tokens and logits, every step fused, and turning `field` off
    moves the logits (what it centers is read). Returns the torch backend's cache."""
    ids, mask = prompts(3, 45, seed=1, pads=[0, 9, 20])
    runs = [_generate(model, ids, mask, GearConfig(**fields, backend=backend), 28) for backend in ("torch", "auto")]
    (tokens, scores, paths, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    assert paths == {"reference": 27 * 2} and fused_paths == {"fused": 27 * 2}
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4
    plain = _generate(model, ids, mask, GearConfig(**dict(fields, **{field: False}), backend="torch"), 28)
    assert (scores - plain[1]).abs().max().item() > 1e-4
    return cache


def test_beams_carry_each_rows_centers():
    """Beam search reorders rows: each keeps its centers (torch and numba agree on every beam's tokens)."""
    centered = dict(FUSED, key_buffer_size=32, held_for=0.5, key_buffer_centered=True)
    cache = beams_match_reference(tiny_model("llama3", head_dim=32), centered)
    assert cache.layers[0].key_stream.buffer.centers.fields["center"].shape[0] == 6


def beams_match_reference(model, fields: dict):
    """Beam search (3 beams over a left-padded batch of 2: rows reordered every step): the torch backend and the
    numba fused path (used) give the same tokens. Returns the torch backend's cache."""
    ids, mask = prompts(2, 45, seed=2, pads=[0, 7])
    runs = [_generate(model, ids, mask, GearConfig(**fields, backend=backend), 24, num_beams=3)
            for backend in ("torch", "auto")]
    (tokens, _, _, cache), (fused_tokens, _, fused_paths, _) = runs
    assert "fused" in fused_paths
    assert torch.equal(tokens, fused_tokens)
    return cache


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_config_takes_a_bool(value):
    with pytest.raises(ValueError, match=r"key_buffer_centered=.*True or False"):
        GearConfig(key_buffer_centered=value)


def test_centering_is_ignored_for_a_full_precision_key_buffer():
    """key_buffer="full" keeps keys as the model made them: centering changes nothing there (keys, bytes)."""
    fields = dict(CENTERED, key_buffer="full", key_buffer_size=None, held_for=1.0)
    (cache, x), (plain, _) = (_fill(GearConfig(**dict(fields, key_buffer_centered=on)), [40] + [1] * 30, stream="key")
                              for on in (True, False))
    assert not layer_formats(cache.gear_config)[0].centered
    assert torch.equal(row_local_tokens(cache, 0)[0][0], row_local_tokens(plain, 0)[0][0])
    assert cache.memory_report()["owned_bytes"] == plain.memory_report()["owned_bytes"]


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("head_dim", [64, 7, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_centers_kernel_is_the_torch_decode_bit_for_bit(scaled, head_dim, dtype):
    """The numba decode of the stored centers (`kernels.cpu.decode_centers`, what the CPU backend hands the kernels
    each step) is `ChannelCenters`' torch decode bit for bit: fitted rows, a row never fitted, odd head_dims, and
    keys' exponents at float32's edges (subnormal scales, and past the largest: inf)."""
    pytest.importorskip("numba")
    from gear_hf.cache.channel_centers import ChannelCenters
    from gear_hf.kernels.cpu import decode_centers

    def torch_decode(centers):
        center, scale = centers._decoded(centers.fields)
        return torch.stack([scale, center], dim=2)

    torch.manual_seed(head_dim)
    centers = ChannelCenters(scaled)
    x = (torch.randn(3, 4, 40, head_dim) * torch.rand(1, 1, 1, head_dim) * 10 + torch.randn(1, 1, 1, head_dim) * 5)
    written = torch.ones(3, 40, dtype=torch.bool)
    written[1] = False  # (a row with no tokens: never fitted, read as identity)
    centers.fit(x.to(dtype), written)
    assert torch.equal(decode_centers(centers.fields).view(torch.int32), torch_decode(centers).view(torch.int32))
    if scaled:
        for low in (-128, -127, 100, 124, 127):
            centers.fields["low"][:] = low
            centers.fields["above"][:] = 0x41  # (exponents low + 1 and low + 4)
            got, expected = decode_centers(centers.fields), torch_decode(centers)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), low
