"""Keys held one chunk longer too (`GearConfig.key_buffer_size`, with `value_buffer_size`): each row's newest decode
chunk of keys stays in the key buffer's per-token format until its next chunk flushes, or, with `held_for` below 1,
until held_for x buffer_size newer tokens are buffered after it (an early release: fewer tokens buffered at once).
What the cache holds, token by token, against the torch oracle (`gear_hf.compress`), and the paths that must agree on
it (reference, numba fused, sliding windows, the memory report, the vLLM block format). Beams:
tests/test_held_values.py; the Triton kernels: tests/test_triton_tail.py; speculative crops:
tests/test_speculative.py."""

from __future__ import annotations

import types

import pytest
import torch
from test_held_values import FUSED, HELD, D, H, _fill, _generate, held_oracle

from gear_hf import GearConfig
from gear_hf.cache import GearCache
from gear_hf.cache.fused import row_local_tokens
from gear_hf.format import layer_formats
from tiny_models import prompts, tiny_model

HELD_KEYS = dict(HELD, key_buffer_size=32)
HELD_FOR = [1.0, 0.5, 1 / 16]  # held until the next chunk flushes, released 8 / 1 token(s) after it (buffer_size 16)


def _held_both(held_for: float) -> dict:
    return dict(HELD_KEYS, held_for=held_for)


@pytest.mark.parametrize("held_for", HELD_FOR)
@pytest.mark.parametrize("steps", [[40] + [1] * 45, [75] + [1] * 20, [5] + [1] * 50 + [7, 3], [46] + [1] * 30,
                                   [40] + [1] * 10 + [9] + [1] * 5])
def test_keys_held_a_chunk_longer_token_by_token(steps, held_for):
    """Keys and values are where the oracle says; while a row holds its newest chunk (fewer than held_for x 16 tokens
    after it) both streams read it from their buffer's codes, not from a chunk, and both hold alike."""
    config = GearConfig(**_held_both(held_for))
    release = round(held_for * 16)
    held, x = _fill(config, steps, stream="key")
    _, v = _fill(config, steps)
    (keys, values), = row_local_tokens(held, 0)
    key_format, value_format = layer_formats(config)
    assert key_format.release_after == value_format.release_after == release
    torch.testing.assert_close(keys, held_oracle(x, key_format, steps, held), rtol=0, atol=1e-6)
    torch.testing.assert_close(values, held_oracle(v, value_format, steps, held), rtol=0, atol=1e-6)
    key_stream, value_stream = held.layers[0].streams
    (c,), (f,) = held.decode_chunks, held.buffer_len
    assert key_stream.holding == value_stream.holding == [c > 0 and f < release]


@pytest.mark.parametrize("held_for", HELD_FOR)
def test_an_early_release_buffers_fewer_tokens(held_for):
    """A decode run of 80 single tokens: each stream's buffer never holds more than 16 + held_for x 16 - 1 tokens
    (the layout's newest, plus the held chunk until held_for x 16 are buffered after it)."""
    config = GearConfig(**_held_both(held_for))
    gen = torch.Generator().manual_seed(0)
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config)
    most = seen = 0
    for q in [40] + [1] * 80:
        k, v = (torch.randn(1, H, q, D, generator=gen) for _ in range(2))
        cache.observe_attention_mask(torch.ones(1, seen + q, dtype=torch.long))
        cache.store_and_read(0, k, v, torch.arange(seen, seen + q)[None])
        seen += q
        for stream in cache.layers[0].streams:
            most = max(most, stream.own(cache.layout.counts).buffer[0])
    assert most == 16 + round(held_for * 16) - 1


def test_config_holds_keys_only_with_a_per_token_buffer_and_held_values():
    small = dict(group_size=64, buffer_size=64)
    with pytest.warns(DeprecationWarning, match="advanced.hold"):
        for bad, allowed in ((dict(key_buffer_size=64), "'auto', None or 2 x buffer_size = 128"),
                             (dict(key_buffer_size=True), "'auto', None or 2 x buffer_size = 128"),
                             (dict(key_buffer_size=128, value_buffer_size=None), "only with their values")):
            with pytest.raises(ValueError, match="GearConfig.key_buffer_size") as err:
                GearConfig(**small, **bad)
            assert allowed in str(err.value)
    both = GearConfig(**small, hold="both")
    assert (both.value_buffer_size, both.key_buffer_size, both.held_for) == (128, 128, 0.5)
    assert both.replace(buffer_size=32).key_buffer_size == 64  # (held tokens follow the buffer)
    assert both.replace(value_buffer="full").key_buffer_size is None  # (no held values: no held keys)
    assert both.replace(key_buffer="full").held_for == 1.0  # (values held alone stay a whole chunk)
    assert both.replace(key_buffer="full").key_buffer_size is None
    assert GearConfig(**small, hold="both", method="fp16").key_buffer_size is None


@pytest.mark.parametrize("held_for", [1.0, 0.5])
def test_fused_cpu_attention_reads_held_keys_as_the_reference_path(held_for):
    """A left-padded batch whose rows flush (and release) on different steps, 28 decode steps under inference mode:
    the numba fused attention (handed both streams as they store them) gives the torch backend's tokens and
    logits."""
    model = tiny_model("llama3", head_dim=32)
    ids, mask = prompts(3, 45, seed=1, pads=[0, 9, 20])
    held = dict(FUSED, key_buffer_size=32, held_for=held_for)
    runs = [_generate(model, ids, mask, GearConfig(**held, backend=backend), 28) for backend in ("torch", "auto")]
    (tokens, scores, paths, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    assert max(cache.decode_chunks) >= 2 and paths == {"reference": 27 * 2} and fused_paths == {"fused": 27 * 2}
    assert all(stream.held_chunk for stream in cache.layers[0].streams)
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4
    unheld = _generate(model, ids, mask, GearConfig(**FUSED, backend="torch"), 28)[1]
    assert (scores - unheld).abs().max().item() > 1e-3  # (the held keys are read: the logits move)


@pytest.mark.parametrize("held_for", [1.0, 0.5])
def test_sliding_window_releases_around_held_keys(held_for):
    """A sliding layer (window 40) releases leading chunks while both streams hold their newest chunk: the torch
    and numba paths agree, and the key store stays bounded by the window."""
    model = tiny_model("mistral", head_dim=32, window=40)
    ids, mask = prompts(2, 30, seed=3, pads=[0, 5])
    held = dict(FUSED, key_buffer_size=32, held_for=held_for)
    runs = [_generate(model, ids, mask, GearConfig(**held, backend=backend), 56) for backend in ("torch", "auto")]
    (tokens, scores, _, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    layer = cache.layers[0]
    assert layer.is_sliding and layer.dense is None and layer.released.chunks >= 2
    assert layer.key_stream.decode.capacity <= -(-40 // 16) + 2
    assert fused_paths == {"fused": 55 * 2}
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4


@pytest.mark.parametrize("held_for, steps", [(1.0, 45), (0.5, 45), (0.5, 40)])
def test_memory_report_counts_held_keys_in_the_key_buffer(held_for, steps):
    """Both buffers hold the held chunk (while held) + the buffered tokens, both chunk stores the chunks they
    store; on one row nothing is spare."""
    cache, _ = _fill(GearConfig(**_held_both(held_for)), [40] + [1] * steps)
    report = cache.memory_report()
    keys, values = cache.layers[0].streams
    (f,), (c,) = cache.buffer_len, cache.decode_chunks
    held = 16 if f < held_for * 16 else 0
    assert c >= 2 and keys.holding == [held > 0] and keys.buffer.capacity == values.buffer.capacity == f + held
    assert keys.decode.capacity == values.decode.capacity == c - (held > 0)
    assert report["spare_bytes"] == 0
    assert report["buffer"] == sum(s.buffer.token_nbytes() * (f + held) + s.sink.token_nbytes() * cache.sink_len[0]
                                   for s in (keys, values))


def test_vllm_block_format_holds_no_keys():
    """The vLLM plugin compresses a block's keys and values together when it closes (its open block is the engine's
    buffer): its block format drops key_buffer_size as it drops value_buffer_size."""
    from gear_hf.vllm.format import block_config

    block = block_config(GearConfig(**dict(FUSED, key_buffer_size=32, held_for=0.5)), 16, 32)
    assert block.key_buffer_size is None and block.value_buffer_size is None
