"""Architectures (qwen3, qwen3_moe, mixtral, gemma2, gemma3_text, gemma3, phi3, olmo2, granite) through
the one shared attention forward, on tiny random models (tests/tiny_models.py: GQA 4/2, a 21-token prompt and a
window of 16 where the architecture has one, so sliding layers really drop tokens).

* fp16 preset == stock, bit for bit (tokens and logits), eager and sdpa, fp32 and bf16, single and left-padded:
  in tests/test_stock_equivalence.py, parametrized over these too;
* `disable` restores the stock forwards and outputs;
* gear-4 keeps teacher-forced top-1 agreement >= 0.9 with stock (the cache really compresses: group 8, buffer 16);
* the fused decode kernels (Triton, interpreted on CPU; the numba CPU kernel) give the reference path's tokens
  where they apply, and the Triton one refuses with the reason where it does not (Gemma 2 soft-capping, Phi-3
  partial rotary: `auto` takes the reference path there, on CUDA and on CPU);
* what is not supported refuses at enable (longrope).
"""

from __future__ import annotations

import pytest
import torch

import gear_hf
import gear_hf.patches
from tiny_models import CACHE_ARG, NEW_ARCHS, SLIDING_ARCHS, greedy, prompts, tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the fused tests: compiled on CUDA, interpreted on CPU


@pytest.mark.compat
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_disable_restores_stock(arch):
    model = tiny_model(arch, "eager")
    ids, mask = prompts(2)
    stock = greedy(model, ids, mask, 6)
    attention = gear_hf.patches.spec_for(model).attention_modules(model)
    assert len(attention) == 2
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2, group_size=8, buffer_size=8))
    greedy(model, ids, mask, 6)
    assert all("forward" in m.__dict__ for m in attention)
    gear_hf.disable(model)
    assert not gear_hf.is_enabled(model)
    assert not any("forward" in m.__dict__ or hasattr(m, "_gear_hf_patch") for m in model.modules())
    assert "generate" not in model.__dict__
    restored = greedy(model, ids, mask, 6)
    assert torch.equal(restored[0], stock[0]) and torch.equal(restored[1], stock[1])


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_gear4_teacher_forced_agreement(arch):
    """Teacher forced on stock's own greedy continuation; a prompt of 40 compressed at prefill (32 tokens in
    chunks, 8 in the buffer) and two decode chunks flushed during the 40 continuation tokens."""
    from gear_hf.diagnostics import teacher_forced_agreement

    # (a window longer than 2 x buffer_size: a shorter one is stored dense, with nothing compressed)
    model = tiny_model(arch, "eager", window=40 if arch in SLIDING_ARCHS else None)
    ids, mask = prompts(1, length=40)
    sequence, _ = greedy(model, ids, mask, 40)
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=8, buffer_size=16)
    result = teacher_forced_agreement(model, ids, sequence[:, 40:], config)
    assert result["positions"] == 40
    assert result["top1_agreement"] >= 0.9, result
    # the cache did compress (an exact cache gives KL 0): visible at 2 bits even on these near-uniform tiny
    # models, where gear-4's KL can sit within float noise of 0 (granite: -4e-8)
    coarse = teacher_forced_agreement(model, ids, sequence[:, 40:], config.replace(method="kivi", key_bits=2,
                                                                                   value_bits=2))
    assert coarse["mean_kl"] > 1e-8, coarse


# -- the fused decode kernel where it applies ------------------------------------------------------------------

def _generate(model, config, steps=12, device=DEVICE):
    ids, mask = prompts(2, length=33)
    with gear_hf.enabled(model, config):
        return greedy(model, ids.to(device), mask.to(device), steps)


def _count_fused(monkeypatch) -> dict:
    calls = {"fused": 0}
    original = gear_hf.GearCache.fused_attention

    def counting(self, *args, **kwargs):
        calls["fused"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gear_hf.GearCache, "fused_attention", counting)
    return calls


# Where the fused kernel applies (gemma2: soft-capping, phi3 here: partial rotary -> reference path). Interpreted
# (CPU), three cover what differs for the kernel; compiled (CUDA), all of them.
FUSED_ARCHS = ("qwen3", "qwen3_moe", "mixtral", "gemma3_text", "gemma3", "olmo2", "granite")
INTERPRETED_FUSED_ARCHS = ("qwen3", "gemma3_text", "granite")


# The numba CPU kernel (fast on CPU): every fused-capable type.
FUSED_CASES = [("triton", arch) for arch in (FUSED_ARCHS if DEVICE == "cuda" else INTERPRETED_FUSED_ARCHS)] + \
    [("numba", arch) for arch in FUSED_ARCHS]


@pytest.mark.parametrize("backend, arch", FUSED_CASES)
def test_fused_kernel_matches_reference(backend, arch, monkeypatch):
    """qwen3: q/k norms and one sliding layer; gemma3_text: a local and a global RoPE table (linear-scaled) and
    query_pre_attn_scalar; granite: attention_multiplier. head_dim 32 (the Triton kernel needs a power of two
    >= 32)."""
    pytest.importorskip(backend)
    calls = _count_fused(monkeypatch)
    device = DEVICE if backend == "triton" else "cpu"
    if backend == "triton":
        # Both runs compress with the oracle, so the kernel reads exactly the codes the reference reconstructs. With
        # the Triton quantizer, CI saw gemma3_text's logits 1.6e-3 apart (3e-7 on the development machine): a value
        # on a code boundary can round either way between the two quantizers on another CPU. The quantizer is tested
        # against the oracle on its own (test_kernels_quant).
        from gear_hf import kernels

        monkeypatch.setattr(kernels, "quantize_pack_supports", lambda *args, **kwargs: False)
    model = tiny_model(arch, head_dim=32, window=40 if arch in SLIDING_ARCHS else None).to(device)  # (see above)
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=16, buffer_size=16)
    tokens_ref, logits_ref = _generate(model, config.replace(backend="torch"), device=device)
    assert calls["fused"] == 0
    tokens_fused, logits_fused = _generate(model, config.replace(backend=backend), device=device)
    assert calls["fused"] > 0
    assert torch.equal(tokens_ref, tokens_fused)
    assert (logits_ref - logits_fused).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch, reason", [("gemma2", "soft-capping"), ("phi3", "partial rotary")])
def test_fused_kernel_refuses_what_it_does_not_compute(arch, reason, monkeypatch):
    pytest.importorskip("triton")
    calls = _count_fused(monkeypatch)
    model = tiny_model(arch, "eager", head_dim=32).to(DEVICE)
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=16, buffer_size=16)
    with pytest.raises(NotImplementedError, match=reason):
        _generate(model, config.replace(backend="triton"), steps=2)
    # auto (on CUDA too): the reference path, never the kernel
    tokens, _ = _generate(model, config.replace(backend="auto"), steps=2)
    assert calls["fused"] == 0 and tokens.shape[1] == 35


# -- refusals ---------------------------------------------------------------------------------------------------

def test_length_dependent_rope_refused_at_enable():
    """Phi-3 128k's longrope switches frequency tables with the length: keys cannot be rotated when read."""
    import transformers

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64}
    config = transformers.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     rope_parameters=rope, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="longrope"):
        gear_hf.enable(model)
    assert not gear_hf.is_enabled(model)
    gear_hf.enable(model, gear_hf.GearConfig(pre_rope=False))  # keys stored after RoPE: allowed
    assert gear_hf.is_enabled(model)


def test_gemma3_layers_read_keys_with_their_own_rope():
    """Each layer type gets its own table: local (theta 1e4) on the sliding layer, global (1e6 / 8) on the other."""
    model = tiny_model("gemma3_text")
    gear_hf.enable(model)
    sliding, full = [m._gear_hf_patch.rotary_emb for m in model.model.layers.modules() if hasattr(m, "_gear_hf_patch")]
    assert (sliding.layer_type, full.layer_type) == ("sliding_attention", "full_attention")
    assert sliding.inv_freq[1] > full.inv_freq[1]
    ids = torch.tensor([[5, 6, 7]])
    kwargs = {CACHE_ARG: gear_hf.GearCache(model)}
    with torch.no_grad():  # a GearCache refuses autograd (test_user_path)
        model(input_ids=ids, **kwargs)  # runs both layers through the shared forward


def test_length_dependent_rope_on_one_layer_type_refused():
    """Gemma 3 with a `dynamic` global table: refused although the local table is static."""
    import transformers

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000000.0}}
    config = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                                           rope_parameters=rope, max_position_embeddings=256, pad_token_id=0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="dynamic"):
        gear_hf.enable(model)
    assert not gear_hf.is_enabled(model)


def test_fused_supported_names_architecture_reasons():
    from gear_hf.backends.triton_backend import fused_supported

    config = gear_hf.GearConfig.preset("gear", bits=4)
    assert fused_supported(config, 64, 1, rotary_dim=64, softcap=None) is None
    assert "partial rotary (32 of 64" in fused_supported(config, 64, 1, rotary_dim=32)
    assert "softcap=50.0" in fused_supported(config, 64, 1, rotary_dim=64, softcap=50.0)
