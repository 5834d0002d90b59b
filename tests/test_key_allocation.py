"""Key widths allocated per channel (key_bit_allocation="query"): bit-plane packing, the allocation, the engine and
the cache against uniform widths and against an independent greedy."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import gear_hf
from gear_hf.backends.triton_backend import fused_supported
from gear_hf.cache import GearCache
from gear_hf.compress import ChunkSpec, compress, decompress, quant
from gear_hf.compress.allocation import allocate_channel_bits, even_channel_bits, query_pair_energy

H, D = 2, 32


def _widths(B, H_, d, mean, seed=0):
    """Random widths in [1, 8] with the same sum (mean * d) for every (row, head)."""
    g = torch.Generator().manual_seed(seed)
    out = even_channel_bits(B, H_, d, mean).long()
    for _ in range(3 * d):  # move single bits between random channels, staying in [1, 8]
        src, dst = torch.randint(0, d, (2,), generator=g).tolist()
        ok = (out[..., src] > 1) & (out[..., dst] < 8)
        out[..., src] -= ok.long()
        out[..., dst] += ok.long()
    return out.to(torch.uint8)


@pytest.mark.parametrize("chunks", [1, 3])
def test_bit_planes_round_trip_exactly(chunks):
    B, n, d = 2, 16 * chunks, 24
    bits = torch.stack([_widths(B, H, d, 3.5, seed=c) for c in range(chunks)], dim=2)  # [B,H,C,d]
    top = (1 << bits.long()) - 1
    codes = (torch.rand(B, H, chunks, n // chunks, d) * (top[:, :, :, None] + 1)).long().clamp(max=255)
    codes = torch.minimum(codes, top[:, :, :, None]).to(torch.uint8).view(B, H, n, d)
    packed = quant.pack_planes(codes, bits)
    assert packed.shape == (B, H, n // 8, int(3.5 * d))  # exactly the codes' bits: n * 3.5 * d / 8 bytes
    assert torch.equal(quant.unpack_planes(packed, bits), codes)


def test_bit_plane_layout():
    """The documented layout (the kernel reads it): per 8 tokens, channel c's planes at the sum of the widths before
    it; bit t of plane j is bit j of token t's code."""
    codes = torch.zeros(1, 1, 8, 2, dtype=torch.uint8)
    codes[0, 0, 3, 0] = 0b101  # channel 0 (3 bits), token 3
    codes[0, 0, 6, 1] = 0b10  # channel 1 (2 bits), token 6
    packed = quant.pack_planes(codes, torch.tensor([[[[3, 2]]]], dtype=torch.uint8))
    assert packed.flatten().tolist() == [1 << 3, 0, 1 << 3, 0, 1 << 6]


def test_unused_chunk_slots_do_not_shift_the_others():
    """A row with fewer decode chunks than another has zero widths in its unused slots: reading every slot at once
    must still find each used chunk's planes where they are."""
    B, C, per, d = 2, 3, 16, 8
    bits = torch.stack([_widths(B, H, d, 3.0, seed=c) for c in range(C)], dim=2)  # [B,H,C,d]
    codes = torch.minimum(torch.randint(0, 256, (B, H, C, per, d)), (1 << bits.long()[:, :, :, None]) - 1)
    codes = codes.to(torch.uint8).view(B, H, C * per, d)
    packed = quant.pack_planes(codes, bits)
    bits[0, :, 1] = 0  # row 0 never filled chunk slot 1 (its bytes: leftovers)
    packed.view(B, H, C, per // 8, -1)[0, :, 1] = 255
    got = quant.unpack_planes(packed, bits).view(B, H, C, per, d)
    want = codes.view(B, H, C, per, d)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0, :, [0, 2]], want[0, :, [0, 2]])
    assert not got[0, :, 1].any()


def _greedy_one_bit_at_a_time(weight, spread, mean):
    """An independent allocation: start every channel at 1 bit, give the next bit where it removes most error."""
    d = weight.numel()
    bits = [1] * d
    err = lambda b: 1.0 / (2 ** b - 1) ** 2  # noqa: E731
    for _ in range(int(mean * d) - d):
        gains = [weight[c] * spread[c] * (err(bits[c]) - err(bits[c] + 1)) if bits[c] < 8 else -1 for c in range(d)]
        bits[max(range(d), key=lambda c: gains[c])] += 1
    return bits


@pytest.mark.parametrize("mean", [1.5, 3.0, 3.5, 6.0])
def test_allocation_is_the_greedy_optimum_within_budget(mean):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, H, 32, D, generator=g) * torch.rand(D, generator=g) * 4  # channels of different ranges
    weight = torch.rand(2, H, D, generator=g, dtype=torch.float64) ** 3
    bits = allocate_channel_bits(weight, x, 16, mean)
    assert bits.dtype == torch.uint8 and int(bits.min()) >= 1 and int(bits.max()) <= 8
    assert (bits.long().sum(-1) == int(mean * D)).all()
    spread = (x.view(2, H, 2, 16, D).amax(3) - x.view(2, H, 2, 16, D).amin(3)).double().square().mean(2)
    for b in range(2):
        for h in range(H):
            assert bits[b, h].tolist() == _greedy_one_bit_at_a_time(weight[b, h], spread[b, h], mean)


def test_allocation_follows_the_queries_and_rounds_a_fractional_total_down():
    x = torch.randn(1, 1, 16, 8)
    weight = torch.ones(1, 1, 8, dtype=torch.float64)
    weight[..., 3] = 1e4  # the channel the queries read most
    bits = allocate_channel_bits(weight, x, 16, 3.0)
    assert int(bits[0, 0, 3]) == int(bits.max()) and int(bits[0, 0, 3]) > 3
    assert int(allocate_channel_bits(weight, x, 16, 3.3).long().sum()) == 26  # 26.4 bits -> 26
    with pytest.raises(ValueError, match="mean of 9 bits over 8 channels"):
        allocate_channel_bits(weight, x, 16, 9)


def test_query_pair_energy_is_rope_invariant_and_skips_padding():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, D, generator=g)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, :2] = False
    angle = torch.rand(5, D // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = q * cos + torch.cat([-q[..., D // 2:], q[..., : D // 2]], -1) * sin
    energy = query_pair_energy(q, H, valid)
    torch.testing.assert_close(query_pair_energy(rotated, H, valid), energy, rtol=1e-6, atol=0)  # float32 RoPE
    torch.testing.assert_close(energy[0], query_pair_energy(q[:1, :, 2:], H, valid[:1, 2:])[0])


def test_equal_widths_compress_exactly_like_one_width():
    """Per-channel widths all equal to 3 give uniform 3-bit keys' statistics and reconstruction, bit for bit."""
    x = torch.randn(2, H, 32, D).bfloat16()
    uniform = ChunkSpec(3, "channel", 16, 0.0, 0)
    allocated = ChunkSpec(3.0, "channel", 16, 0.0, 0, allocated=True)
    bits = torch.full((2, H, D), 3, dtype=torch.uint8)
    a, b = compress(x, uniform), compress(x, allocated, channel_bits=bits)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.minimum, b.minimum)
    assert b.codes.numel() == a.codes.numel()  # 3 bits per code either way
    torch.testing.assert_close(decompress(b, allocated, 32, D, torch.float32),
                               decompress(a, uniform, 32, D, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("range_search", [False, True])
def test_each_channel_is_within_half_a_step_of_its_width(range_search):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, H, 32, D, generator=g)
    bits = _widths(1, H, D, 3.5)
    spec = ChunkSpec(3.5, "channel", 16, 0.0, 0, range_search=range_search, allocated=True)
    chunk = compress(x, spec, channel_bits=bits)
    assert torch.equal(chunk.channel_bits[:, :, 0], bits)
    approx = decompress(chunk, spec, 32, D, torch.float32)
    step = chunk.scale.float().repeat_interleave(16, dim=2)  # [1,H,32,d]
    if not range_search:  # (a searched range clips on purpose)
        assert ((approx - x).abs() <= step / 2 + 1e-6).all()
    codes = quant.unpack_planes(chunk.codes, chunk.channel_bits)
    assert (codes.long() <= (1 << bits.long()[:, :, None]) - 1).all()


def test_a_wider_channel_errs_less():
    x = torch.randn(1, H, 32, D, generator=torch.Generator().manual_seed(4))
    bits = torch.tensor([1, 6] * (D // 2), dtype=torch.uint8).expand(1, H, D).clone()  # mean 3.5
    spec = ChunkSpec(3.5, "channel", 16, 0.0, 0, allocated=True)
    err = (decompress(compress(x, spec, channel_bits=bits), spec, 32, D, torch.float32) - x).abs().mean(dim=2)
    assert err[bits == 6].max() < err[bits == 1].min() / 4


def _config(**overrides):
    fields = dict(method="kivi", key_bits=3.5, value_bits=2, key_bit_allocation="query", rotation="values",
                  group_size=8, buffer_size=16, sink_tokens=0, backend="torch", prompt_group_size=None,
                  key_buffer="full", value_buffer="full")  # (buffered keys compared exact: the paper's buffer)
    fields.update(overrides)
    return gear_hf.GearConfig(**fields)


def _cache(config, layers=1):
    return GearCache(LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4,
                                 num_key_value_heads=H, head_dim=D), config)


def _feed(cache, K, V, Q, prompt, mask=None):
    if mask is not None:
        cache.observe_attention_mask(mask[:, :prompt])
    out = cache.store_and_read(0, K[:, :, :prompt], V[:, :, :prompt], query=Q[:, :, :prompt])
    for t in range(prompt, K.shape[2]):
        if mask is not None:
            cache.observe_attention_mask(mask[:, : t + 1])
        out = cache.store_and_read(0, K[:, :, t:t + 1], V[:, :, t:t + 1], query=Q[:, :, t:t + 1])
    return out


def _stream(T, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(D, generator=g) * 3
    return (torch.randn(batch, H, T, D, generator=g) * scale, torch.randn(batch, H, T, D, generator=g),
            torch.randn(batch, 4, T, D, generator=g) * scale.flip(0))


def test_cache_streams_like_the_engine_with_the_prompts_widths():
    """The prompt chunk is allocated from the prompt's queries; decode chunks reuse the row's widths."""
    config = _config()
    K, V, Q = _stream(45, 1)
    cache = _cache(config)
    keys, _ = _feed(cache, K, V, Q, 37)  # prompt 32 + 5 buffered; decode chunk at 48 is not reached (45)
    stream = cache.layers[0].key_stream
    energy = query_pair_energy(Q[:, :, :37], H, torch.ones(1, 37, dtype=torch.bool))
    spec = ChunkSpec(3.5, "channel", 8, 0.0, 0, allocated=True)
    bits = allocate_channel_bits(energy, K[:, :, :32], 8, 3.5)
    assert torch.equal(stream.channel_bits, bits)
    expected = decompress(compress(K[:, :, :32], spec, channel_bits=bits), spec, 32, D, torch.float32)
    assert torch.equal(keys[:, :, :32], expected) and torch.equal(keys[:, :, 32:], K[:, :, 32:])


def test_decode_chunks_take_the_rows_widths_and_memory_is_counted():
    config = _config()
    K, V, Q = _stream(70, 2)
    cache = _cache(config)
    _feed(cache, K, V, Q, 37)  # 32 prompt + 2 decode chunks of 16 + 6 buffered
    stream = cache.layers[0].key_stream
    assert cache.decode_chunks == [2, 2]
    fields = stream.decode.fields
    for chunk in range(2):
        assert torch.equal(fields["channel_bits"][:, :, chunk], stream.channel_bits)
    report = cache.memory_report()
    from memory_count import tensors_reachable  # the independent count of every tensor held

    assert report["owned_bytes"] == tensors_reachable(cache)
    # keys' codes: 3.5 bits per element exactly; values' codes: 2 bits
    tokens = 2 * (32 + 2 * 16)
    assert report["codes"] == tokens * H * D * (3.5 + 2) / 8


def test_padded_batch_stores_what_the_row_stores_alone():
    config = _config()
    K, V, Q = _stream(75, 3)
    alone = _cache(config)
    _feed(alone, K[:1, :, 11:], V[:1, :, 11:], Q[:1, :, 11:], 34)
    mask = torch.ones(3, 75, dtype=torch.long)
    mask[0, :11] = 0
    mask[2, :3] = 0
    batch = _cache(config)
    _feed(batch, K, V, Q, 45, mask)
    a, b = alone.layers[0].key_stream, batch.layers[0].key_stream
    assert torch.equal(b.channel_bits[0], a.channel_bits[0])
    for name, t in a.prefill.fields.items():
        assert torch.equal(b.prefill.fields[name][0, :, : t.shape[2]], t[0]), name
    for name, t in a.decode.fields.items():
        assert torch.equal(b.decode.fields[name][0, :, : t.shape[2]], t[0]), name


def test_rows_with_different_chunk_counts_read_as_alone():
    """Row 1 flushes a decode chunk that row 0 does not have yet (row 0's slot keeps zero widths, before row 1's
    chunk in storage order): the batch reads each row as that row alone."""
    config = _config()
    K, V, Q = _stream(54, 2)
    mask = torch.ones(2, 54, dtype=torch.long)
    mask[1, :4] = 0  # row 1: 32 prompt tokens + 4 buffered, so it flushes 4 steps before row 0
    batch = _cache(config)
    keys, values = _feed(batch, K, V, Q, 40, mask)
    assert batch.decode_chunks == [0, 1]
    for row, pad in ((0, 0), (1, 4)):
        alone = _cache(config)
        keys_alone, values_alone = _feed(alone, *(t[row:row + 1, :, pad:] for t in (K, V, Q)), 40 - pad)
        torch.testing.assert_close(keys[row, :, pad:], keys_alone[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(values[row, :, pad:], values_alone[0], rtol=0, atol=1e-6)


def test_rows_follow_a_reorder():
    config = _config()
    K, V, Q = _stream(40, 2)
    cache = _cache(config)
    _feed(cache, K, V, Q, 37)
    before = cache.layers[0].key_stream.channel_bits.clone()
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[0].key_stream.channel_bits, before[[1, 1]])


def test_missing_queries_fail_loudly():
    cache = _cache(_config())
    K, V, _ = _stream(40, 1)
    with pytest.raises(RuntimeError, match="pass query="):
        cache.store_and_read(0, K, V)


def test_a_row_whose_queries_are_all_zero_is_allocated_from_its_key_ranges():
    """Queries of exactly zero (a model embedding the pad token as zeros, fed as a real token: stock generate runs)
    were taken for missing queries, and generate raised mid-way. Such a row's widths follow its key ranges alone,
    as with every channel weighted alike; the other row's stay the queries' (as alone)."""
    config = _config()
    K, V, Q = _stream(40, 2)
    Q[1] = 0.0
    cache, alone = _cache(config), _cache(config)
    with torch.inference_mode():
        _feed(cache, K, V, Q, 37)
        _feed(alone, K[:1], V[:1], Q[:1], 37)
    bits = cache.layers[0].key_stream.channel_bits
    assert torch.equal(bits[0], alone.layers[0].key_stream.channel_bits[0])
    expected = allocate_channel_bits(torch.ones(1, H, D), K[1:, :, :32], 8, 3.5)  # (its first chunk: the prompt)
    assert torch.equal(bits[1:], expected)


@pytest.mark.parametrize("field, value, match", [
    ("key_bits", 3.3, r"key_bits=3.3 is invalid; allowed: a multiple of 1/8 in \[1, 8\]"),
    ("key_bits", 9, r"key_bits=9 is invalid"),
    ("key_axis", "token", r"key_axis='token' is invalid; allowed: 'channel' with key_bit_allocation='query'"),
    ("rotation", "both", r"rotation='both' is invalid; allowed: 'none' or 'values'"),
    ("method", "gear", r"method='gear' is invalid; allowed: a method without outliers"),
    ("key_bit_allocation", "greedy", r"key_bit_allocation='greedy' is invalid; allowed: uniform \| query"),
])
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        _config(**{field: value})


def test_fractional_key_bits_need_the_allocation():
    with pytest.raises(ValueError, match=r"key_bits=3.5 is invalid; allowed: 2, 3, 4 or 8 \(or, with "):
        gear_hf.GearConfig(key_bits=3.5, key_bit_allocation="uniform")


def test_the_fused_kernel_reads_allocated_keys():  # (numerics: tests/test_kernels_decode.py under the interpreter)
    assert fused_supported(_config(buffer_size=64, group_size=64), 64, 1) is None


def test_generate_with_allocated_keys_on_a_padded_batch():
    """Through model.generate (the patched attention passes the queries): a left-padded row decodes as it does
    alone, and every row's widths spend the budget."""
    from tiny_models import CACHE_ARG, greedy, prompts, tiny_model

    model = tiny_model("llama3")
    ids, mask = prompts(3, length=40)  # rows of 40, 35 and 30 tokens
    config = _config(sink_tokens=2)
    with gear_hf.enabled(model, config):
        cache = GearCache(model)
        batch = greedy(model, ids, mask, 24, **{CACHE_ARG: cache})
        alone = greedy(model, ids[1:2, 5:], mask[1:2, 5:], 24, **{CACHE_ARG: GearCache(model)})
    for layer in cache.layers:
        bits = layer.key_stream.channel_bits
        assert (bits.long().sum(-1) == int(3.5 * bits.shape[-1])).all() and layer.query_energy is None
    assert torch.equal(batch[0][1, 5:], alone[0][0])
    torch.testing.assert_close(batch[1][1], alone[1][0], rtol=0, atol=1e-4)


def test_lm_eval_args_take_a_mean_key_width():
    from gear_hf.lm_eval.args import parse_gear_args

    config = parse_gear_args({"preset": "kivi", "key_bits": "3.5", "value_bits": 3, "rotation": "values",
                              "key_bit_allocation": "query"})
    assert config.key_bits == 3.5 and config.key_bit_allocation == "query"
    assert parse_gear_args({"preset": "kivi", "key_bits": 4.0}).key_bits == 4  # a whole float is the int
    assert isinstance(parse_gear_args({"preset": "kivi", "key_bits": 4.0}).key_bits, int)
