"""Keys held one chunk longer too (`GearConfig.key_buffer_size`, with `value_buffer_size`): each row's newest decode
chunk of keys stays in the key buffer's per-token format until its next chunk flushes. What the cache holds, token by
token, against the torch oracle (`gear_hf.compress`), and the paths that must agree on it (reference, numba fused,
sliding windows, the memory report, the vLLM block format). The Triton kernels: tests/test_triton_tail.py."""

from __future__ import annotations

import pytest
import torch
from test_held_values import FUSED, HELD, _fill, _generate, held_oracle

from gear_hf import GearConfig
from gear_hf.cache.fused import row_local_tokens
from gear_hf.format import layer_formats
from tiny_models import prompts, tiny_model

HELD_KEYS = dict(HELD, key_buffer_size=32)


@pytest.mark.parametrize("steps", [[40] + [1] * 45, [75] + [1] * 20, [5] + [1] * 50 + [7, 3]])
def test_keys_held_a_chunk_longer_token_by_token(steps):
    """Keys are where the oracle says, as values are (and values as without key_buffer_size); the newest chunk's
    keys are read from the key buffer's codes, not from a chunk."""
    config = GearConfig(**HELD_KEYS)
    held, x = _fill(config, steps, stream="key")
    plain, _ = _fill(GearConfig(**HELD), steps)
    (keys, values), = row_local_tokens(held, 0)
    (plain_keys, plain_values), = row_local_tokens(plain, 0)
    assert torch.equal(values, plain_values)
    nb, (s,), (p,), (c,) = 16, held.sink_len, held.prefill_len, held.decode_chunks
    older = s + p + max(c - 1, 0) * nb  # tokens before the newest chunk
    key_format = layer_formats(config)[0]
    torch.testing.assert_close(keys, held_oracle(x, key_format, steps, held), rtol=0, atol=1e-6)
    if c:  # (the newest chunk: 8-bit rotated codes here, not the chunk's 3 bits)
        assert not torch.equal(keys[:, older:older + nb], plain_keys[:, older:older + nb])


def test_config_holds_keys_only_with_a_per_token_buffer_and_held_values():
    small = dict(group_size=64, buffer_size=64)
    for bad, allowed in ((dict(key_buffer_size=64), "'auto', None or 2 x buffer_size = 128"),
                         (dict(key_buffer_size=True), "'auto', None or 2 x buffer_size = 128"),
                         (dict(key_buffer_size=128, key_buffer="full"), "'int8', 'int8-rotated' or 'int4'"),
                         (dict(key_buffer_size=128, value_buffer_size=None), "only with their values")):
        with pytest.raises(ValueError, match="GearConfig.key_buffer_size") as err:
            GearConfig(**small, **bad)
        assert allowed in str(err.value)
    auto = GearConfig(**small, key_buffer_size="auto")
    assert (auto.value_buffer_size, auto.key_buffer_size) == (128, 128)
    assert auto.replace(buffer_size=32).key_buffer_size == 64  # ("auto" follows the buffer, as value_buffer_size)
    assert auto.replace(value_buffer="full").key_buffer_size is None  # (no held values: no held keys)
    assert auto.replace(key_buffer="full").key_buffer_size is None
    assert GearConfig(**small, key_buffer_size="auto", method="fp16").key_buffer_size is None


def test_fused_cpu_attention_reads_held_keys_as_the_reference_path():
    """A left-padded batch whose rows flush on different steps, 28 decode steps under inference mode: the numba fused
    attention (handed both streams as they store them) gives the torch backend's tokens and logits."""
    model = tiny_model("llama3", head_dim=32)
    ids, mask = prompts(3, 45, seed=1, pads=[0, 9, 20])
    runs = [_generate(model, ids, mask, GearConfig(**dict(FUSED, key_buffer_size=32), backend=backend), 28)
            for backend in ("torch", "auto")]
    (tokens, scores, paths, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    assert max(cache.decode_chunks) >= 2 and paths == {"reference": 27 * 2} and fused_paths == {"fused": 27 * 2}
    assert all(stream.held_chunk for stream in cache.layers[0].streams)
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4
    unheld = _generate(model, ids, mask, GearConfig(**FUSED, backend="torch"), 28)[1]
    assert (scores - unheld).abs().max().item() > 1e-3  # (the held keys are read: the logits move)


def test_sliding_window_releases_around_held_keys():
    """A sliding layer (window 40) releases leading chunks while both streams hold their newest chunk: the torch
    and numba paths agree, and the key store stays bounded by the window."""
    model = tiny_model("mistral", head_dim=32, window=40)
    ids, mask = prompts(2, 30, seed=3, pads=[0, 5])
    runs = [_generate(model, ids, mask, GearConfig(**dict(FUSED, key_buffer_size=32), backend=backend), 56)
            for backend in ("torch", "auto")]
    (tokens, scores, _, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    layer = cache.layers[0]
    assert layer.is_sliding and layer.dense is None and layer.released.chunks >= 2
    assert layer.key_stream.decode.capacity <= -(-40 // 16) + 2
    assert fused_paths == {"fused": 55 * 2}
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4


def test_memory_report_counts_held_keys_in_the_key_buffer():
    """Both buffers hold the held chunk + the buffered tokens, both chunk stores one chunk fewer than the layout's;
    on one row nothing is spare."""
    cache, _ = _fill(GearConfig(**HELD_KEYS), [40] + [1] * 45)
    report = cache.memory_report()
    keys, values = cache.layers[0].streams
    (f,), (c,) = cache.buffer_len, cache.decode_chunks
    assert c >= 2 and keys.buffer.capacity == values.buffer.capacity == f + 16
    assert keys.decode.capacity == values.decode.capacity == c - 1
    assert report["spare_bytes"] == 0
    assert report["buffer"] == sum(s.buffer.token_nbytes() * (f + 16) + s.sink.token_nbytes() * cache.sink_len[0]
                                   for s in (keys, values))


def test_vllm_block_format_holds_no_keys():
    """The vLLM plugin compresses a block's keys and values together when it closes (its open block is the engine's
    buffer): its block format drops key_buffer_size as it drops value_buffer_size."""
    from gear_hf.vllm.format import block_config

    block = block_config(GearConfig(**dict(FUSED, key_buffer_size=32)), 16, 32)
    assert block.key_buffer_size is None and block.value_buffer_size is None
