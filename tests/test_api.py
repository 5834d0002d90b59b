"""enable / disable / enabled: exact restore, idempotence, clear errors, accelerate hooks, cache growth."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gear_hf
from tiny_models import CACHE_ARG, greedy, prompts, tiny_model

pytestmark = pytest.mark.compat  # API behaviour must hold on the oldest supported transformers too


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, gear_hf; gear_hf.GearConfig(); "
            "bad = [m for m in ('triton', 'transformers', 'gear_hf.kernels') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_disable_restores_bitwise_identical_logits_and_forwards():
    model = tiny_model("llama3")
    ids, mask = prompts(3)
    before = _logits(model, ids, mask)
    forwards = [m.forward for m in model.modules()]
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2, group_size=8, buffer_size=8))
    greedy(model, ids, mask, 12)  # generate through the compressed cache
    assert torch.equal(_logits(model, ids, mask), before)  # no cache passed: the stock path
    gear_hf.disable(model)
    assert torch.equal(_logits(model, ids, mask), before)
    assert [m.forward for m in model.modules()] == forwards
    assert not any("forward" in vars(m) for m in model.modules())
    assert "generate" not in vars(model) and not gear_hf.is_enabled(model)
    assert model._forward_pre_hooks == {} and model.model._forward_pre_hooks == {}


def test_disable_on_a_model_never_enabled_says_so():
    model = tiny_model("llama3")
    with pytest.warns(UserWarning, match="was not enabled"):
        assert gear_hf.disable(model) is model
    assert not gear_hf.is_enabled(model)


def test_enable_twice_is_harmless_and_reconfigures():
    model = tiny_model("qwen2")
    ids, mask = prompts(1)
    gear_hf.enable(model, gear_hf.GearConfig.preset("fp16"))
    gear_hf.enable(model, gear_hf.GearConfig.preset("fp16"))
    attention = model.model.layers[0].self_attn
    assert attention.forward.__func__.__name__ == "gear_attention_forward"
    assert attention._gear_hf_patch.original_forward.__func__.__name__ != "gear_attention_forward"
    kivi = gear_hf.GearConfig.preset("kivi", bits=4, group_size=8, buffer_size=8)
    gear_hf.enable(model, kivi)
    greedy(model, ids, mask, 3)
    assert gear_hf.last_cache(model).gear_config == kivi
    gear_hf.disable(model)
    gear_hf.disable(model)  # no-op


def test_enabled_context_manager_restores():
    model = tiny_model("mistral")
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        assert gear_hf.is_enabled(model)
    assert not gear_hf.is_enabled(model)


def test_unsupported_model_lists_supported_types():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="gpt2.*supported: gemma2, gemma3, .*llama, mistral, .*qwen3_moe"):
        gear_hf.enable(model)
    assert gear_hf.supported_model_types() == ["gemma2", "gemma3", "gemma3_text", "granite", "llama", "mistral",
                                               "mixtral", "olmo2", "phi3", "qwen2", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("field,value,allowed", [
    ("method", "kvquant", "fp16 | kivi"), ("key_bits", 9, "a multiple of 1/8 in [1, 8]"),
    ("key_bits", 3.3, "a multiple of 1/8 in [1, 8]"), ("value_bits", True, "2, 3, 4 or 8"),
    ("group_size", 0, ">= 1"), ("buffer_size", 100, "multiple of 8"), ("key_group_size", 0, ">= 1"),
    ("rotation", "random", "none | keys | values | both"), ("factor_bits", 4, "16 or 8"),
    ("outlier_ratio", 1.5, "[0, 1)"), ("key_axis", "head", "channel | token"), ("rank_prefill", -1, ">= 0"),
    ("pre_rope", "yes", "True or False"), ("backend", "cuda", "auto | torch | triton | numba"),
])
def test_bad_config_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        gear_hf.GearConfig(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value) and allowed in str(err.value)


def test_bad_preset_and_overrides():
    with pytest.raises(ValueError, match="preset name 'nope' is invalid"):
        gear_hf.GearConfig.preset("nope")
    with pytest.raises(ValueError, match="no setting"):
        gear_hf.GearConfig.preset("gear", bits=2, rank=3)
    with pytest.raises(ValueError, match="rank_prefill"):
        gear_hf.GearConfig.preset("gear-l", rank_prefill=0, rank_decode=0)


def test_enable_rejects_a_non_config():
    model = tiny_model("llama2")
    with pytest.raises(TypeError, match=r"got dict \(a dict: GearConfig\(\*\*fields\)"):
        gear_hf.enable(model, {"method": "gear"})
    with pytest.raises(TypeError, match=r"got str \(a name: GearConfig.preset\('gear-2'\)"):  # says how to make one
        gear_hf.enable(model, "gear-2")
    with pytest.raises(TypeError, match=r"gear_config must be a gear_hf.GearConfig, got int$"):
        gear_hf.GearCache(model, 3)
    assert not hasattr(model, "_gear_hf_state") or model._gear_hf_state is None  # nothing half-enabled


def test_dynamic_rope_needs_post_rope_mode():
    model = tiny_model("llama2")
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(NotImplementedError, match="pre_rope=False"):
        gear_hf.enable(model)
    gear_hf.enable(model, gear_hf.GearConfig(pre_rope=False))
    gear_hf.disable(model)


@pytest.mark.parametrize("cache_kwarg", ["cache", "past_key_values"])
def test_explicit_cache_argument_and_growth(cache_kwarg):
    """A GearCache passed explicitly under either spelling really caches: it grows every step."""
    if cache_kwarg == "cache" and CACHE_ARG != "cache":
        pytest.skip("this transformers only knows past_key_values")
    model = tiny_model("llama3")
    ids, mask = prompts(2)
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=8, buffer_size=8)
    gear_hf.enable(model, config)
    cache = gear_hf.GearCache(model)
    assert cache.gear_config == config
    greedy(model, ids, mask, 17, **{cache_kwarg: cache})
    assert cache.get_seq_length() == ids.shape[1] + 16
    assert cache.tokens_held() == sum(mask.sum(1).tolist()) + 2 * 16
    assert sum(cache.decode_chunks) > 0
    gear_hf.disable(model)


def test_gear_cache_on_an_unpatched_model_fails_clearly():
    model = tiny_model("llama2")
    ids, mask = prompts(1)
    with pytest.raises(RuntimeError, match="gear_hf.enable"):
        greedy(model, ids, mask, 2, **{CACHE_ARG: gear_hf.GearCache(model, gear_hf.GearConfig())})


def test_accelerate_hooks_are_respected():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model = tiny_model("llama2")
    ids, mask = prompts(3)
    stock_tokens, stock_logits = greedy(model, ids, mask, 10)
    for layer in model.model.layers:
        add_hook_to_module(layer.self_attn, ModelHook())
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        assert model.model.layers[0].self_attn._old_forward.__func__.__name__ == "gear_attention_forward"
        tokens, logits = greedy(model, ids, mask, 10)
    assert torch.equal(tokens, stock_tokens) and torch.equal(logits, stock_logits)
    for layer in model.model.layers:
        remove_hook_from_module(layer.self_attn)


def test_beam_search_and_sampling_run():
    model = tiny_model("qwen2")
    ids, mask = prompts(2)
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=8, buffer_size=8)
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                           num_beams=3, do_sample=False, pad_token_id=0)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        beams = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                               num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(beams, stock)  # reorder_cache keeps rows consistent
    with gear_hf.enabled(model, config):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, num_beams=3,
                             do_sample=False, pad_token_id=0)
        assert out.shape[0] == 2
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True,
                             top_k=5, pad_token_id=0)
        assert out.shape == (2, ids.shape[1] + 20)
