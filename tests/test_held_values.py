"""Values held one chunk longer than their keys (`GearConfig.value_buffer_size`): what the cache holds, token by
token, against the torch oracle (`gear_hf.compress`), and the paths that must agree on it (reference, slot layout,
numba fused, sliding windows, beams, speculative crops, the memory report)."""

from __future__ import annotations

import types

import pytest
import torch

import gear_hf
from gear_hf import GearConfig
from gear_hf.cache import GearCache
from gear_hf.cache.fused import row_local_tokens
from gear_hf.compress import compress, decompress
from gear_hf.format import layer_formats
from tiny_models import prompts, tiny_model

D, H = 32, 2
# a small GearConfig() (value_buffer "int4": rotated per-token codes), keys flushing every 16 tokens (values held, keys
# not: tests/test_held_keys.py holds both; tests/test_key_centers.py centers the key buffer)
HELD = dict(group_size=16, buffer_size=16, prompt_group_size=32, value_buffer_size=32, key_bit_allocation="uniform",
            key_bits=3, key_buffer_size=None, key_buffer_centered=False, value_buffer_centered=False)


def _fill(config: GearConfig, steps: list[int], seed: int = 0, expected_length: int | None = None,
          stream: str = "value", offset: dict[int, float] | None = None):
    """One row, one layer: a prompt of steps[0] tokens, then steps[1:] (returns the cache and every value stored, or
    every key with stream="key"); offset: {channel of the returned stream: a constant added to it}."""
    gen = torch.Generator().manual_seed(seed)
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config, expected_length=expected_length)
    stored, seen = [], 0
    for q in steps:
        k = torch.randn(1, H, q, D, generator=gen)
        v = torch.randn(1, H, q, D, generator=gen)
        for channel, shift in (offset or {}).items():
            (k if stream == "key" else v)[..., channel] += shift
        cache.observe_attention_mask(torch.ones(1, seen + q, dtype=torch.long))
        cache.store_and_read(0, k, v, torch.arange(seen, seen + q)[None])
        stored.append(k if stream == "key" else v)
        seen += q
    return cache, torch.cat(stored, 2)


def _coded(x: torch.Tensor, spec) -> torch.Tensor:
    """x [1,H,n,d] through a format and back (the oracle)."""
    return decompress(compress(x, spec), spec, x.shape[2], D, x.dtype)


def held_oracle(x: torch.Tensor, fmt, steps: list[int], cache, nb: int = 16, tail=None) -> torch.Tensor:
    """[H, T, d]: what a stream with a held chunk holds of x [1,H,T,d], one row fed `steps` (no crop). A chunk the
    layout flushes is held unless it is not the step's newest or release_after tokens are buffered after it; a held
    chunk is compressed from its buffered codes once released, any other from what the buffer has of it then (the
    step's own tokens exact: all of them at the prompt step). The newest chunk, while held, and the buffer are in the
    buffer's format (a buffer with no chunk before it: the step's own tokens exact). tail: tokens [1,H,n,d] -> as the
    buffer reads them back (default: through fmt.tail)."""
    (s,), (p,), (c,), (f,) = cache.sink_len, cache.prefill_len, cache.decode_chunks, cache.buffer_len
    coded_tail = tail or (lambda z: _coded(z, fmt.tail))
    release_after = fmt.release_after
    expected = [x[:, :, :s]]
    if p:
        expected.append(_coded(x[:, :, s : s + p], fmt.prompt))
    holding = c > 0 and f < release_after
    before = total = 0  # tokens before / after each step
    for q in steps:
        before, total = total, total + q
        flushed = range(max(before - s - p, 0) // nb, max(total - s - p, 0) // nb)  # chunks this step flushes
        for j in flushed:
            if j == c - 1 and holding:
                continue
            at = s + p + j * nb
            chunk = x[:, :, at : at + nb]
            held = j == flushed[-1] and (total - s - p) % nb < release_after  # (released on a later step)
            if held:
                source = coded_tail(chunk)
            else:  # (released as flushed: the tokens earlier steps buffered as codes, this step's exact)
                mine = max(before - at, 0)
                source = torch.cat([coded_tail(chunk[:, :, :mine]), chunk[:, :, mine:]], 2) if mine else chunk
            expected.append(_coded(source, fmt.decode))
    newest = s + p + (c - holding) * nb
    expected.append(coded_tail(x[:, :, newest:]) if c else x[:, :, s + p :])
    return torch.cat(expected, 2)[0]


@pytest.mark.parametrize("steps", [[40] + [1] * 45, [75] + [1] * 20, [5] + [1] * 50 + [7, 3]])
@pytest.mark.parametrize("value_buffer", ["int4", "int8"])
def test_values_held_a_chunk_longer_token_by_token(steps, value_buffer):
    """Keys are stored exactly as without value_buffer_size; each value is where the oracle says: the prompt chunk
    and chunks flushed with it compressed from the exact values, later chunks from their buffered codes one flush
    after their keys, and the newest chunk with the buffer in the buffer's format."""
    config = GearConfig(**HELD, value_buffer=value_buffer)
    held, x = _fill(config, steps)
    plain, _ = _fill(GearConfig(**{**HELD, "value_buffer_size": None}, value_buffer=value_buffer), steps)
    (keys, values), = row_local_tokens(held, 0)
    (plain_keys, _), = row_local_tokens(plain, 0)
    assert torch.equal(keys, plain_keys)

    nb, (c,), (f,) = 16, held.decode_chunks, held.buffer_len
    expected = held_oracle(x, layer_formats(config)[1], steps, held)
    assert values.shape == expected.shape
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)
    assert held.layers[0].value_stream.buffer.capacity >= f + (nb if c else 0)


def test_config_rejects_what_cannot_hold():
    small = dict(group_size=64, buffer_size=64)
    with pytest.warns(DeprecationWarning, match="advanced.hold"):
        for bad in (64, True):  # the former size names: None or 2 x buffer_size only
            with pytest.raises(ValueError, match=r"value_buffer_size=.* is invalid; allowed: 'auto', None or 2 x "
                                                 r"buffer_size = 128"):
                GearConfig(**small, value_buffer_size=bad)
        assert GearConfig(**small, value_buffer_size=128, value_buffer="int8").value_buffer_size == 128
    for buffer in ("full", "final"):  # a buffer that is not per token holds nothing
        assert GearConfig(**small, hold="values", value_buffer=buffer, method="kivi").value_buffer_size is None
    for bad in (0, 1.5, "soon", True):
        with pytest.raises(ValueError, match=r"held_for=.* is invalid; allowed: a number in \(0, 1\]"):
            GearConfig(**small, held_for=bad)
    assert GearConfig(**small, held_for=0.5, hold="values").held_for == 1.0  # (values held alone: until the flush)
    assert GearConfig(**small, held_for=0.5, hold="none").value_buffer_size is None  # (nothing held: ignored)


def _generate(model, ids, mask, config, steps: int, **kwargs):
    """(tokens, float32 logits [B, steps, V], step paths, cache) of greedy generation under inference mode."""
    with gear_hf.enabled(model, config), torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                             **kwargs)
        cache = gear_hf.last_cache(model)
    return out.sequences, torch.stack(out.scores, 1).float(), dict(cache.step_paths), cache


FUSED = dict(group_size=16, buffer_size=16, prompt_group_size=32, value_buffer_size=32, key_buffer_size=None)


GEAR_2 = dict(method="gear", key_bits=2, value_bits=2, key_bit_allocation="uniform", outlier_ratio=0.05)


# the default's rotated 4-bit value tail, and an unrotated 8-bit one under gear-2's values (outliers, low-rank); 8-bit
# statistics and the other tails are read by the same code as without a held chunk (test_value_statistics, test_tail)
@pytest.mark.parametrize("overrides", [{}, dict(GEAR_2, value_buffer="int8")], ids=["default", "gear"])
def test_fused_cpu_attention_reads_the_held_chunk_as_the_reference_path(overrides):
    """A left-padded batch whose rows flush on different steps (the slot layout on the reference path), 28 decode
    steps (a held chunk compressed on the way): the numba fused attention gives the torch backend's tokens and logits
    (float32 rounding), every decode step fused."""
    model = tiny_model("llama3", head_dim=32)
    ids, mask = prompts(3, 45, seed=1, pads=[0, 9, 20])
    runs = [_generate(model, ids, mask, GearConfig(**FUSED, backend=backend, **overrides), 28)
            for backend in ("torch", "auto")]
    (tokens, scores, paths, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    assert max(cache.decode_chunks) >= 2 and paths == {"reference": 27 * 2} and fused_paths == {"fused": 27 * 2}
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4


def test_sliding_window_releases_around_the_held_chunk():
    """A sliding layer (window 40 > 2 x buffer_size) releases leading chunks of keys and values alike while the
    values' newest chunk is held: the torch and numba paths agree step by step, and memory stops growing."""
    model = tiny_model("mistral", head_dim=32, window=40)
    ids, mask = prompts(2, 30, seed=3, pads=[0, 5])
    runs = [_generate(model, ids, mask, GearConfig(**FUSED, backend=backend), 56) for backend in ("torch", "auto")]
    (tokens, scores, _, cache), (fused_tokens, fused_scores, fused_paths, _) = runs
    layer = cache.layers[0]
    assert layer.is_sliding and layer.dense is None and layer.released.chunks >= 2
    assert layer.value_stream.decode.capacity <= -(-40 // 16) + 2  # (bounded by the window, as the keys')
    assert fused_paths == {"fused": 55 * 2}
    assert torch.equal(tokens, fused_tokens)
    assert (scores - fused_scores).abs().max().item() < 1e-4


def _fill_rows(config: GearConfig, histories: list[torch.Tensor]):
    """A batch cache fed row b's (keys, values) history [2, H, T, d] step by step (steps of 1 after a prompt)."""
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=1), config)
    T = histories[0].shape[2]
    for lo, hi in [(0, 21)] + [(t, t + 1) for t in range(21, T)]:
        kv = torch.stack([h[:, :, lo:hi] for h in histories], 1)  # [2, B, H, q, d]
        cache.observe_attention_mask(torch.ones(len(histories), hi, dtype=torch.long))
        cache.store_and_read(0, kv[0], kv[1], torch.arange(lo, hi)[None].expand(len(histories), -1))
    return cache


@pytest.mark.parametrize("held", [HELD, dict(HELD, key_buffer_size=32, held_for=0.5)],
                         ids=["values", "both-released-early"])
def test_reordered_rows_keep_their_held_chunks(held):
    """Beam search reorders rows (`reorder_cache`): each row then continues as a cache that held its source row's
    history alone would (rows are independent; the held chunk, or that it was released, travels with its row)."""
    config = GearConfig(**held)
    gen = torch.Generator().manual_seed(5)
    first = [torch.randn(2, 1, H, 50, D, generator=gen)[:, 0] for _ in range(3)]
    cache = _fill_rows(config, first)
    order = [2, 0, 0]
    cache.reorder_cache(torch.tensor(order))
    more = [torch.randn(2, H, 30, D, generator=gen) for _ in range(3)]
    for t in range(30):
        kv = torch.stack([m[:, :, t : t + 1] for m in more], 1)
        cache.observe_attention_mask(torch.ones(3, 51 + t, dtype=torch.long))
        cache.store_and_read(0, kv[0], kv[1], torch.full((3, 1), 50 + t))
    for row, source in enumerate(order):
        alone = _fill_rows(config, [torch.cat([first[source], more[row]], 2)])
        (keys, values), = row_local_tokens(alone, 0)
        got_keys, got_values = row_local_tokens(cache, 0)[row]
        assert max(cache.decode_chunks) >= 3
        torch.testing.assert_close(got_keys, keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_values, values, rtol=0, atol=1e-6)


@pytest.mark.parametrize("expected_length", [None, 40 + 45])
def test_memory_report_counts_the_held_chunk_once(expected_length):
    """The held chunk is buffer tokens in the buffer's format: the buffer component counts keys' and values' buffers
    as their stores hold them, and on one row nothing is spare: the value buffer holds exactly the held chunk + the
    buffered tokens, and the value chunk store one chunk fewer than the keys' (it had reserved one more, never used:
    0.1 bit/element of a 1k-token SmolLM2 cache)."""
    cache, _ = _fill(GearConfig(**HELD), [40] + [1] * 45, expected_length=expected_length)
    report = cache.memory_report()
    keys, values = cache.layers[0].streams
    (f,), (c,) = cache.buffer_len, cache.decode_chunks
    assert c >= 2 and values.buffer.capacity == f + 16
    assert values.decode.capacity == keys.decode.capacity - 1 == c - 1
    assert report["spare_bytes"] == 0 and report["owned_bytes"] == report["held_bytes"] + report["kernel_state_bytes"]
    assert report["buffer"] == sum(s.buffer.token_nbytes() * n for s, n in zip(cache.layers[0].streams,
                                                                                 (f, f + 16))) \
        + sum(s.sink.token_nbytes() * cache.sink_len[0] for s in cache.layers[0].streams)


def test_engines_say_whether_they_hold_values():
    """The Triton kernels read a held chunk (tests/test_triton_tail.py): backend="auto" on CUDA attends it fused. The
    vLLM plugin compresses a block's keys and values together when the block closes: its block format holds no
    values longer (its open block is the engine's buffer), as the Transformers path without value_buffer_size."""
    pytest.importorskip("triton")
    from gear_hf.backends import resolve
    from gear_hf.vllm.format import block_config, chunk_specs

    config = GearConfig(**FUSED)
    block = block_config(config, 16, D)
    assert block.value_buffer_size is None and block.buffer_size == 16
    assert chunk_specs(config, 16, D) == chunk_specs(config.replace(value_buffer_size=None), 16, D)
    auto = resolve(config, D, torch.float16, "cuda")
    assert auto.attend is not None and auto.attend.name == "triton"
