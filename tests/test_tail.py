"""Issue 25, item 3: the buffer in a cheaper format (`GearConfig.key_buffer` / `value_buffer`) is real storage, read
by the torch oracle, served alike by the CPU kernel, and counted as held."""

from __future__ import annotations

import pytest
import torch

import gear_hf
from gear_hf import GearConfig
from gear_hf.coded_store import CodedTokenStore
from gear_hf.compress import compress, decompress
from gear_hf.format import INT4_TOKENS, INT8_TOKENS, layer_formats
from tiny_models import CACHE_ARG, tiny_model

H, D = 2, 64
FULL = GearConfig.recommended(name="accurate")  # config version 1's GearConfig(): values per token, 16-bit buffer


def _fill(config: GearConfig, prompt: int, steps: int, seed: int = 0):
    """A one-layer bf16 cache after a `prompt`-token prompt and `steps` single-token steps (store-level): the cache
    and every key/value stored [1,H,T,d]."""
    from transformers import LlamaConfig

    cache = gear_hf.GearCache(LlamaConfig(num_hidden_layers=1, hidden_size=H * D * 2, num_attention_heads=H * 2,
                                          num_key_value_heads=H, head_dim=D), config)
    g = torch.Generator().manual_seed(seed)
    keys, values = [], []
    with torch.no_grad():
        for q in [prompt] + [1] * steps:
            k, v = (torch.randn(1, H, q, D, generator=g).bfloat16() for _ in range(2))
            k[..., 3] *= 12  # an outlier channel, as pre-RoPE keys have
            cache.store(0, k, v, query=torch.randn(1, H * 2, q, D, generator=g).bfloat16())
            cache.compress_pending(0)
            keys.append(k)
            values.append(v)
    return cache, torch.cat(keys, 2), torch.cat(values, 2)


def test_values_final_hold_the_same_chunks_and_quantized_buffer():
    """value_buffer="final": each value is encoded on arrival in its chunk's format and moved into the chunk as is,
    so the chunks hold the same bits as with a 16-bit buffer; the buffered values read back as that format decodes
    them."""
    plain, _, values = _fill(FULL, 300, 200)
    final, _, _ = _fill(FULL.replace(value_buffer="final"), 300, 200)
    assert final.layout.counts == plain.layout.counts
    _, held_plain = plain.held(0, torch.bfloat16)
    _, held_final = final.held(0, torch.bfloat16)
    buffered = final.layout.counts.buffer[0]
    compressed = held_plain.shape[2] - buffered
    assert torch.equal(held_final[:, :, :compressed], held_plain[:, :, :compressed])
    spec = layer_formats(FULL)[1].decode
    tail = values[:, :, compressed:]
    assert torch.equal(held_final[:, :, compressed:], decompress(compress(tail, spec), spec, buffered, D,
                                                                 torch.bfloat16))
    assert not torch.equal(held_final[:, :, compressed:], tail)  # (really quantized)


def test_keys_int8_buffer_is_eight_bits_per_token_and_counted():
    config = FULL.replace(key_buffer="int8", value_buffer="final")
    cache, keys, _ = _fill(config, 300, 60)
    buffered = cache.layout.counts.buffer[0]
    held_keys, _ = cache.held(0, torch.float32)
    tail = keys[:, :, -buffered:].float()
    step = (tail.amax(-1, keepdim=True) - tail.amin(-1, keepdim=True)) / 255
    assert ((held_keys[:, :, -buffered:] - tail).abs() <= step * 0.51 + 1e-3).all()
    report = cache.memory_report()
    value_token = sum(f.nbytes() for f in CodedTokenStore.per_token_fields(layer_formats(config)[1].decode, D,
                                                                           torch.bfloat16))
    key_token = D + 2 + 2  # 8-bit codes, bf16 scale and minimum
    assert INT8_TOKENS.bits == 8
    assert report["buffer"] == buffered * H * (key_token + value_token) + config.sink_tokens * H * D * 2 * 2
    assert report["held_bytes"] < _fill(FULL, 300, 60)[0].memory_report()["held_bytes"]


def test_int4_buffer_is_four_bits_per_rotated_token_and_counted():
    """value_buffer="int4": each buffered value is stored as INT4_TOKENS encodes it (4-bit codes of the Walsh–Hadamard
    rotated vector, one bf16 scale and minimum), read back as it decodes, and counted at D/2 + 4 bytes a token."""
    config = FULL.replace(key_buffer="int8", value_buffer="int4")
    cache, _, values = _fill(config, 300, 60)
    buffered = cache.layout.counts.buffer[0]
    _, held_values = cache.held(0, torch.bfloat16)
    tail = values[:, :, -buffered:]
    expected = decompress(compress(tail, INT4_TOKENS), INT4_TOKENS, buffered, D, torch.bfloat16)
    assert torch.equal(held_values[:, :, -buffered:], expected) and not torch.equal(expected, tail)
    assert INT4_TOKENS.bits == 4 and INT4_TOKENS.rotate
    report = cache.memory_report()
    key_token, value_token = D + 2 + 2, D // 2 + 2 + 2  # 8-bit / 4-bit codes, bf16 scale and minimum
    assert report["buffer"] == buffered * H * (key_token + value_token) + config.sink_tokens * H * D * 2 * 2


@pytest.mark.parametrize("fields", [dict(value_buffer="final"), dict(key_buffer="int8", value_buffer="int8"),
                                    dict(value_axis="channel", key_buffer="int8", value_buffer="int4"),
                                    dict(key_buffer="int4", value_buffer="int4")])
def test_fused_cpu_kernel_reads_the_coded_buffer_as_the_oracle(fields):
    """The numba decode kernel is handed the buffer decoded as the reference path reads it: same logits."""
    pytest.importorskip("numba")
    model = tiny_model("llama3", dtype=torch.float32, head_dim=32)
    ids = torch.randint(3, 128, (2, 290), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = {}
    for backend in ("torch", "auto"):
        gear_hf.enable(model, FULL.replace(backend=backend, **fields))
        cache = gear_hf.GearCache(model)
        with torch.inference_mode():
            result = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                    **{CACHE_ARG: cache})
        gear_hf.disable(model)
        out[backend] = (torch.stack(result.scores), dict(cache.step_paths))
    assert out["auto"][1].get("fused", 0) > 0 and "fused" not in out["torch"][1]
    torch.testing.assert_close(out["auto"][0], out["torch"][0], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fields,match", [
    (dict(key_buffer="fp8"), r"key_buffer='fp8' is invalid; allowed: full \| int8 \| int4"),
    (dict(value_buffer="fp8"), r"value_buffer='fp8' is invalid; allowed: full \| final \| int8 \| int4"),
    (dict(method="gear-l", value_axis="token", value_buffer="final"),
     r"value_buffer='final' is invalid; allowed: 'full' unless values"),
    (dict(value_axis="channel", value_buffer="final"), r"value_buffer='final' is invalid"),
])
def test_bad_buffer_settings_say_what_is_allowed(fields, match):
    with pytest.raises(ValueError, match=match):
        GearConfig(**fields)


def test_a_format_that_does_not_store_tokens_alone_cannot_be_a_buffer():
    with pytest.raises(ValueError, match="does not store each token on its own"):
        CodedTokenStore.per_token_fields(layer_formats(GearConfig())[0].decode, D, torch.bfloat16)


def test_fp16_keeps_every_token_whatever_the_buffer_settings():
    assert layer_formats(GearConfig(method="fp16"))[0].tail is None  # (GearConfig()'s int8 buffer: ignored)


def test_presets_keep_the_full_precision_buffer():
    assert GearConfig.preset("gear-2").key_buffer == GearConfig.preset("kivi-4").value_buffer == "full"
    assert GearConfig.recommended(name="accurate").value_buffer == "full"
    # GearConfig() (config version 2): 8-bit keys and 4-bit values in the buffer (config.py, results/tail/)
    assert (GearConfig().key_buffer, GearConfig().value_buffer) == ("int8", "int4")


def test_a_step_reads_its_own_tokens_exact_and_the_prompt_compresses_from_them():
    """A coded buffer stages the step's own tokens: the prompt chunk is compressed from the exact tokens (the same
    fields as with a 16-bit buffer), and the step reads its own tokens as the model made them."""
    coded = FULL.replace(key_buffer="int8", value_buffer="int8")
    full_cache, _, _ = _fill(FULL, 300, 0)
    coded_cache, keys, values = _fill(coded, 300, 0)
    for full_stream, coded_stream in zip(full_cache.layers[0].streams, coded_cache.layers[0].streams):
        for name, t in full_stream.prefill.fields.items():
            assert torch.equal(coded_stream.prefill.fields[name], t), name
    from transformers import LlamaConfig

    cache = gear_hf.GearCache(LlamaConfig(num_hidden_layers=1, hidden_size=H * D * 2, num_attention_heads=H * 2,
                                          num_key_value_heads=H, head_dim=D), coded)
    with torch.no_grad():
        k, v = keys[:, :, :10], values[:, :, :10]  # (shorter than a prompt group: all stay in the buffer)
        got_k, got_v = cache.store_and_read(0, k, v)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        held_k, held_v = cache.held(0, torch.bfloat16)  # after the step: coded
        assert not torch.equal(held_k, k) and (held_v.float() - v.float()).abs().max() < 0.05


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_one_token_prompt_generates_with_an_empty_coded_buffer(backend):
    """A 1-token prompt goes to the sinks: the coded buffer is read empty (nothing to decode) on the first steps."""
    model = tiny_model("llama3", dtype=torch.bfloat16, head_dim=32)
    gear_hf.enable(model, GearConfig(backend=backend))  # (8-bit keys, 4-bit values in the buffer)
    ids = torch.tensor([[5]])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0)
    gear_hf.disable(model)
    assert out.shape == (1, 9)
