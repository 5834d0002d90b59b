"""GearCache storage: streaming chunks, memory accounting, batch invariance, growth, row selection."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import gear_hf
from gear_hf.cache import GearCache, _stream_specs
from gear_hf.compress import compress, decompress
from memory_count import tensors_reachable as _tensors_reachable
from reference_match import assert_matches_oracle

H, D = 2, 32


def _config(**overrides):
    base = dict(group_size=8, buffer_size=16)
    base.update(overrides)
    method = base.pop("method", "gear")
    bits = base.pop("bits", 2)
    return gear_hf.GearConfig.preset(method, bits=bits, **base)


def _cache(config, layers=1):
    model_config = LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=2,
                               num_key_value_heads=H)
    return GearCache(model_config, config)


def _stream(steps_prompt, decode_steps, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = steps_prompt + decode_steps
    return torch.randn(batch, H, T, D, generator=g), torch.randn(batch, H, T, D, generator=g)


def _feed(cache, K, V, prompt, mask=None, layer=0):
    """Prefill `prompt` columns, then one column per step; returns the last read."""
    T = K.shape[2]
    if mask is not None:
        cache.observe_attention_mask(mask[:, :prompt])
    out = cache.store_and_read(layer, K[:, :, :prompt], V[:, :, :prompt])
    for t in range(prompt, T):
        if mask is not None:
            cache.observe_attention_mask(mask[:, : t + 1])
        out = cache.store_and_read(layer, K[:, :, t : t + 1], V[:, :, t : t + 1])
    return out


@pytest.mark.parametrize("method", ["kivi", "kcvt", "outlier", "gear-l", "gear"])
def test_streaming_matches_engine_chunk_by_chunk(method):
    """Prompt compressed once (rank_prefill), remainder buffered, then exactly n_b-token decode chunks."""
    config = _config(method=method)
    cache = _cache(config)
    K, V = _stream(37, 40)  # 37 = 4 groups of 8 + 5 buffered; then 2 chunks of 16 + 13 buffered
    keys, values = _feed(cache, K, V, 37)
    assert cache.prefill_len == [32] and cache.decode_chunks == [2] and cache.buffer_len == [13]
    for X, got, stream in ((K, keys, "key"), (V, values, "value")):
        assert_matches_oracle(got, _engine_read(X, config, stream, prompt=32, decode_chunks=2), config.uses_lowrank)


def _engine_read(X, config, stream, prompt, decode_chunks, chunk_len=16):
    """What the cache should read for X [1,H,T,d]: the first `prompt` tokens compressed as one chunk (prompt spec),
    then `decode_chunks` chunks of `chunk_len` (decode spec), then the rest exact (the buffer), by the engine."""
    prompt_spec, decode_spec = _stream_specs(config, stream)
    parts = [decompress(compress(X[:, :, :prompt], prompt_spec), prompt_spec, prompt, D, torch.float32)]
    for start in range(prompt, prompt + decode_chunks * chunk_len, chunk_len):
        chunk = X[:, :, start : start + chunk_len]
        parts.append(decompress(compress(chunk, decode_spec), decode_spec, chunk_len, D, torch.float32))
    parts.append(X[:, :, prompt + decode_chunks * chunk_len :])
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("overrides", [dict(method="gear"), dict(method="kivi", value_axis="channel")],
                         ids=["gear", "kivi-values-per-channel"])
def test_prompt_groups_longer_than_decode_groups(overrides):
    """prompt_group_size=32 (groups of 8 in decode chunks of 16): the prompt chunk holds whole groups of 32 in
    their own statistics, the prompt's tail fills decode chunks at once, then n_b-token decode chunks."""
    config = _config(prompt_group_size=32, **overrides)
    cache = _cache(config)
    K, V = _stream(90, 21)  # 90 = 64 (two prompt groups) + 16 (a decode chunk at prefill) + 10 buffered; +21
    keys, values = _feed(cache, K, V, 90)
    assert cache.prefill_len == [64] and cache.decode_chunks == [2] and cache.buffer_len == [15]
    for X, got, stream in ((K, keys, "key"), (V, values, "value")):
        prompt_spec, decode_spec = _stream_specs(config, stream)
        along_tokens = stream == "key" or config.value_axis == "channel"
        assert (prompt_spec.group, decode_spec.group) == ((32, 8) if along_tokens else (8, 8))
        assert_matches_oracle(got, _engine_read(X, config, stream, prompt=64, decode_chunks=2), config.uses_lowrank)
    # statistics of 64 prompt keys: 2 rows per channel instead of 8
    assert cache.layers[0].key_stream.prefill.fields["scale"].shape[2] == 2


def test_fp16_method_stores_tokens_exactly():
    cache = _cache(gear_hf.GearConfig.preset("fp16"))
    K, V = _stream(10, 30)
    keys, values = _feed(cache, K, V, 10)
    assert torch.equal(keys, K) and torch.equal(values, V)


def test_sink_tokens_stay_exact():
    cache = _cache(_config(sink_tokens=4))
    K, V = _stream(37, 20)
    keys, values = _feed(cache, K, V, 37)
    assert torch.equal(keys[:, :, :4], K[:, :, :4]) and torch.equal(values[:, :, :4], V[:, :, :4])
    assert cache.sink_len == [4] and cache.prefill_len == [32]


@pytest.mark.parametrize("method", ["fp16", "kivi", "gear"])
def test_memory_report_matches_independent_count(method):
    cache = _cache(_config(method=method), layers=2)
    K, V = (t.bfloat16() for t in _stream(50, 40, batch=2))
    for t, q in [(0, 50)] + [(50 + i, 1) for i in range(40)]:
        for layer in range(2):
            cache.store_and_read(layer, K[:, :, t : t + q], V[:, :, t : t + q])
    report = cache.memory_report()
    assert report["owned_bytes"] == _tensors_reachable(cache)
    assert report["fp16_bytes"] == 2 * 90 * H * D * 2 * 2 * 2  # rows * tokens * H * d * (K,V) * layers * 2B
    components = ("codes", "scales", "lowrank", "sparse_values", "sparse_indices", "buffer", "positions")
    assert sum(report[c] for c in components) == report["held_bytes"]
    assert report["held_bytes"] + report["spare_bytes"] + report["kernel_state_bytes"] + report["workspace_bytes"] \
        == report["owned_bytes"]
    # held, counted independently: per row 90 tokens; 2 rows; 2 layers; K and V; buffer in bf16
    rows, layers = 2, 2
    buffered = sum(cache.buffer_len)
    assert report["buffer"] == buffered * H * D * 2 * 2 * layers
    # positions that are the row-local indices (no position_ids given) are not stored: they follow from the pads
    assert cache.layout.tables is None and report["positions"] == 0
    if method != "fp16":
        assert cache.prefill_len == [48, 48] and cache.decode_chunks == [2, 2] and buffered == 2 * 10
        held_chunks = 0
        for layer in cache.layers:
            for stream in layer.streams:
                one = lambda store: sum(t[0, :, : store.extent[n]].numel() * t.element_size()  # noqa: E731
                                        for n, t in store.fields.items())
                held_chunks += rows * (one(stream.prefill) + 2 * one(stream.decode))
        assert sum(report[c] for c in components[:5]) == held_chunks
    if method != "fp16":
        assert report["codes"] > 0 and (report["lowrank"] > 0) == (method == "gear")


@pytest.mark.parametrize("overrides", [{}, dict(method="kivi", bits=3, value_axis="channel", rotation="both",
                                               range_search="values", prompt_group_size=32)],
                         ids=["gear", "kivi3-values-per-channel-prompt-groups"])
def test_batch_invariance_of_the_compressed_cache(overrides):
    """Row 0 alone and inside a left-padded batch stores bit-identical compressed data."""
    config = _config(**overrides)
    K, V = _stream(45, 30, batch=3)
    alone = _cache(config)
    keys_alone, values_alone = _feed(alone, K[:1, :, 11:], V[:1, :, 11:], 34)
    mask = torch.ones(3, 75, dtype=torch.long)
    mask[0, :11] = 0  # row 0 = the same 64 tokens after 11 pads
    mask[2, :3] = 0
    batch = _cache(config)
    keys_batch, values_batch = _feed(batch, K, V, 45, mask)
    assert batch.prefill_len[0] == alone.prefill_len[0] and batch.buffer_len[0] == alone.buffer_len[0]
    for name, store_alone in alone.layers[0].key_stream.decode.fields.items():
        used = store_alone.shape[2]
        assert torch.equal(batch.layers[0].key_stream.decode.fields[name][0, :, :used], store_alone[0])
    prompt_alone = alone.layers[0].value_stream.prefill.fields
    prompt_batch = batch.layers[0].value_stream.prefill.fields
    for name, t in prompt_alone.items():
        assert torch.equal(prompt_batch[name][0, :, : t.shape[2]], t[0]), name
    torch.testing.assert_close(keys_batch[0, :, 11:], keys_alone[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(values_batch[0, :, 11:], values_alone[0], rtol=0, atol=1e-6)


def test_stores_own_what_they_hold():
    """Without a known final length nothing is reserved ahead: the buffer holds exactly its tokens (a
    step copies at most a buffer's worth), decode chunk storage grows to the chunks held (1/16 beyond them at most
    once large), and the decode chunks held so far keep their memory between flushes."""
    cache = _cache(_config())
    K, V = _stream(40, 70)
    _feed(cache, K[:, :, :56], V[:, :, :56], 40)  # the first decode chunk allocates its storage
    assert cache.decode_chunks == [1]
    stream = cache.layers[0].key_stream
    pointers = {name: t.data_ptr() for name, t in stream.decode.fields.items()}
    for t in range(56, 56 + 16 * 3):
        cache.store_and_read(0, K[:, :, t : t + 1], V[:, :, t : t + 1])
        assert stream.buffer.capacity == max(max(cache.buffer_len), 1)
        assert stream.decode.capacity == cache.decode_chunks[0]
        if t < 56 + 15:  # (the second chunk's flush grows the store)
            assert {name: t.data_ptr() for name, t in stream.decode.fields.items()} == pointers
    assert cache.decode_chunks == [4]


def test_expected_length_sizes_storage_once():
    cache = GearCache(LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                                  num_key_value_heads=H), _config(), expected_length=40 + 64)
    K, V = _stream(40, 64)
    _feed(cache, K, V, 40)
    decode = cache.layers[0].key_stream.decode
    assert decode.capacity == cache.decode_chunks[0] == 4


def test_select_rows_reorders_everything():
    config = _config()
    K, V = _stream(40, 20, batch=3)
    cache = _cache(config)
    _feed(cache, K[:, :, :59], V[:, :, :59], 40)
    reference = _cache(config)
    _feed(reference, K[[2, 0]][:, :, :59], V[[2, 0]][:, :, :59], 40)
    cache.reorder_cache(torch.tensor([2, 0]))
    a = cache.store_and_read(0, K[[2, 0]][:, :, 59:60], V[[2, 0]][:, :, 59:60])
    b = reference.store_and_read(0, K[[2, 0]][:, :, 59:60], V[[2, 0]][:, :, 59:60])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unpatched_update_raises():
    cache = _cache(_config())
    with pytest.raises(RuntimeError, match="gear_hf.enable"):
        cache.update(torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D), 0)


def test_mask_of_wrong_length_raises():
    cache = _cache(_config())
    cache.observe_attention_mask(torch.ones(1, 7))
    with pytest.raises(ValueError, match="attention_mask"):
        cache.store_and_read(0, torch.zeros(1, H, 5, D), torch.zeros(1, H, 5, D))


def test_crop_raises_clearly():
    """An empty cache has nothing to take back (crops that work: tests/test_speculative.py)."""
    cache = _cache(_config())
    cache.crop(0)
    with pytest.raises(ValueError, match="cannot crop 3 tokens: only the last step's 0"):
        cache.crop(-3)


def test_bits_per_element_at_2_bits_with_llama3_8b_heads():
    """2-bit GEAR at T≈1k on Llama-3-8B head shapes (8 KV heads, d=128), everything counted: codes, scales,
    low rank, outliers, the fp16 buffer (here full: 63 decode tokens) and the position bookkeeping. The outlier
    count follows the ratio: round(2% of 128) = 3 per value vector (it was 2 when counted per side)."""
    cache = GearCache(LlamaConfig(num_hidden_layers=1, hidden_size=4096, num_attention_heads=32,
                                  num_key_value_heads=8), gear_hf.GearConfig.preset("gear", bits=2))
    g = torch.Generator().manual_seed(0)
    K = torch.randn(1, 8, 1024 + 63, 128, generator=g).bfloat16()
    V = torch.randn(1, 8, 1024 + 63, 128, generator=g).bfloat16()
    _feed(cache, K, V, 1024)
    report = cache.memory_report()
    assert cache.buffer_len == [63]
    assert report["bits_per_element"] <= 4.55, report
    assert report["owned_bytes"] == _tensors_reachable(cache)


def test_non_finite_values_fail_loudly():
    cache = _cache(_config())
    K, V = _stream(40, 1)
    V[0, 1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.store_and_read(0, K[:, :, :40], V[:, :, :40])


def test_rank_larger_than_a_short_rows_prompt():
    """A row whose prompt chunk is shorter than the rank (rank clamps to its length) still stores."""
    config = _config(rank_prefill=12, group_size=8, buffer_size=8)
    K, V = _stream(24, 4, batch=2)
    mask = torch.ones(2, 28, dtype=torch.long)
    mask[1, :16] = 0  # row 1: an 8-token prompt chunk, rank clamped to 8
    cache = _cache(config)
    keys, _ = _feed(cache, K, V, 24, mask)
    assert cache.prefill_len == [24, 8] and torch.isfinite(keys).all()


def test_sliding_layer_memory_stops_growing_past_the_window():
    """A sliding layer releases the chunks that left every row's window: what it holds at T = 4 x window is within
    10% of what it holds at T = window, what it allocates within 10% of T = 2 x window (its storage grows in
    bounded steps up to a window's worth of chunks, then stops), and it still reads its window exactly."""
    from transformers import MistralConfig

    window = 160  # with n_b = 16 a row holds at most window + 15 tokens: <= 9.4% more than the window
    model_config = MistralConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=H,
                                 sliding_window=window)
    cache = GearCache(model_config, _config(method="gear", bits=4))
    K, V = _stream(40, 4 * window - 40, batch=2)
    mask = torch.ones(2, 4 * window, dtype=torch.long)
    mask[1, :5] = 0

    def layer_bytes():
        report = cache.memory_report()
        return report["held_bytes"] - report["positions"], report["owned_bytes"] - 4 * (
            cache.positions.numel() + cache.rect_to_local.numel())

    cache.observe_attention_mask(mask[:, :40])
    cache.store_and_read(0, K[:, :, :40], V[:, :, :40])
    for t in range(40, 4 * window):
        if t == window:
            held_at_window = layer_bytes()[0]
        if t == 2 * window:
            allocated_at_2_windows = layer_bytes()[1]
        cache.observe_attention_mask(mask[:, : t + 1])
        keys, values = cache.store_and_read(0, K[:, :, t : t + 1], V[:, :, t : t + 1])
    held, allocated = layer_bytes()
    assert cache.layers[0].released.prompt and cache.layers[0].released.chunks >= 25
    assert held <= 1.1 * held_at_window, (held, held_at_window)
    assert allocated <= 1.1 * allocated_at_2_windows, (allocated, allocated_at_2_windows)
    assert keys.shape[2] == window  # the window-1 past tokens and the new one
    torch.testing.assert_close(values[:, :, -1], V[:, :, -1])


def test_held_of_a_sliding_layer_that_released_is_finite():
    from transformers import MistralConfig

    cache = GearCache(MistralConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                                    num_key_value_heads=H, sliding_window=40), _config(method="kivi", bits=4))
    K, V = _stream(24, 100)
    _feed(cache, K, V, 24)
    assert cache.layers[0].released.chunks > 0
    keys, values = cache.held(0, torch.float32)
    assert keys.shape[2] == 124 and torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert torch.equal(values[:, :, :24], torch.zeros_like(values[:, :, :24]))  # released: zeros
    torch.testing.assert_close(values[:, :, -4:], V[:, :, -4:])  # the buffer, exact


def test_gradients_on_get_a_clear_error():
    """A forward with autograd on hands the cache tensors that require grad: refused with a message saying what
    to do, not a `mul(): ... out=` error from deep inside the compression."""
    cache = _cache(_config())
    k = torch.zeros(1, H, 4, D, requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        cache.store_and_read(0, k, torch.zeros(1, H, 4, D))
    with torch.no_grad():
        cache.store_and_read(0, k, torch.zeros(1, H, 4, D))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("method", ["kivi", "gear"])
def test_slot_layout_attends_like_the_padded_layout(attn, method, monkeypatch, reference_path):
    """Decode steps of a left-padded batch (rows that flush on different steps) attend in the slot layout: each
    segment reconstructed for all rows at once, the model's mask remapped. Same tokens and scores (to rounding:
    the columns are ordered differently) as attending in HF's padded layout, which it replaces on those steps;
    the step's workspace is not held after the step. Workspaces start as NaN in tests (conftest): a hole left
    unwritten would turn its row's attention output into NaN."""
    import gear_hf.cache.gear_cache as gear_cache_module
    from gear_hf.cache.layout import RowLayout
    from tiny_models import CACHE_ARG, greedy, prompts, tiny_model

    model = tiny_model("llama3", attn)
    ids, mask = prompts(3, length=40)  # rows of 40, 35 and 30 tokens
    config = _config(method=method, sink_tokens=2)
    used = []
    slot_plan = RowLayout.slot_plan
    monkeypatch.setattr(RowLayout, "slot_plan", lambda self, *args: used.append(1) or slot_plan(self, *args))
    with gear_hf.enabled(model, config):
        cache = GearCache(model)
        slots = greedy(model, ids, mask, 30, **{CACHE_ARG: cache})
        assert len(used) == (30 - 1) * 2  # every decode step (the prompt step gives the first token), both layers
        assert not cache._workspace._tensors
        if attn == "eager":  # attention weights go back to the caller: in HF's padded columns
            used.clear()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                 output_attentions=True, return_dict_in_generate=True)
            assert not used and out.attentions[-1][0].shape[-1] == ids.shape[1] + 2
        monkeypatch.setattr(gear_cache_module, "SLOT_MAX_QUERY", 0)
        used.clear()
        padded = greedy(model, ids, mask, 30, **{CACHE_ARG: GearCache(model)})
        assert not used
    assert torch.equal(slots[0], padded[0])
    torch.testing.assert_close(slots[1], padded[1], rtol=0, atol=1e-5)


def test_prompt_step_compresses_each_prompt_length_once(monkeypatch):
    """A prompt step compresses each stream once per prompt length, longest first, and the prompt store sizes
    itself from that first (full) chunk instead of compressing zeros of the same length once more."""
    from gear_hf.backends import PRIORITY, get_backend

    compressed = []
    for name in PRIORITY:  # whichever backend compresses here
        backend = get_backend(name)
        real = backend.compress
        monkeypatch.setattr(backend, "compress", lambda spec, x, bits, real=real: compressed.append(x.shape[2]) or
                            real(spec, x, bits))
    cache = _cache(_config())
    K, V = _stream(40, 0, batch=2)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0  # rows of 40 and 35 tokens: prompt chunks of 40 and 32 (groups of 8), the rest buffered
    cache.observe_attention_mask(mask)
    cache.store_and_read(0, K, V)
    assert compressed == [40, 32, 40, 32]  # keys, then values: no probe


def test_slot_layout_holds_each_rows_tokens_with_its_buffer_after_its_own_chunks():
    """Rows that flushed different numbers of decode chunks: in the slot layout each slot holds exactly the token
    the padded read has for that row (keys and values), and the decode chunks + buffer run is as wide as the
    longest row's, not (most chunks + longest buffer)."""
    config = _config(sink_tokens=2)
    K, V = _stream(40, 30, batch=3)
    mask = torch.ones(3, 70, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :13] = 0  # prompt chunks of 40, 32, 24 tokens: buffers fill and flush on different steps
    cache = _cache(config)
    seen_chunk_counts = set()
    cache.observe_attention_mask(mask[:, :40])
    cache.store_and_read(0, K[:, :, :40], V[:, :, :40])
    for t in range(40, 70):
        cache.observe_attention_mask(mask[:, : t + 1])
        layer = cache.store(0, K[:, :, t : t + 1], V[:, :, t : t + 1])
        counts = cache.layout.plan.attend
        slots = cache.layout.slot_plan(counts, layer.key_stream.prefill.chunk_len)
        nb = cache.layout.chunk_len
        assert slots.tail == max(c * nb + f for c, f in zip(counts.chunks, counts.buffer))
        padded = cache.read(0)
        for stream, expected in zip(layer.streams, padded):
            got = stream.read_slots(slots, torch.empty(3, H, slots.local.shape[1], D))
            for b in range(3):
                real = slots.columns[b] >= 0
                assert torch.equal(got[b][:, real], expected[b][:, slots.columns[b][real]])
        seen_chunk_counts.add(tuple(counts.chunks))
        cache.compress_pending(0)
    assert any(len(set(chunks)) > 1 for chunks in seen_chunk_counts)  # rows really held different chunk counts
