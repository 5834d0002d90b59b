"""Backend dispatch of the fused decode path, lazy triton import, and end-to-end generation through it.

End to end: a tiny random-weight model generates greedily with backend="torch" (reconstruct + sdpa) and with a
fused kernel: backend="triton" forced (interpreted on CPU) and backend="numba" (the CPU kernel, on CPU). In float32
the tokens must be identical and the per-step logits agree to 1e-4 (observed ~2e-7).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import gear_hf  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402
from gear_hf.kernels import MAX_FUSED_QUERY, fused_supported, resolve_backend, use_fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_import_gear_hf_does_not_import_triton():
    code = ("import sys, gear_hf, gear_hf.kernels, gear_hf.config, gear_hf.compress\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n"
            # transformers itself imports triton when it is installed; our kernel modules must not load
            "import gear_hf.api, gear_hf.attention, gear_hf.cache, gear_hf.cache.fused\n"
            "assert 'gear_hf.kernels.decode' not in sys.modules and 'gear_hf.kernels.quant' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_resolve_backend(monkeypatch):
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    monkeypatch.setattr("gear_hf.kernels.numba_available", lambda: False)
    assert resolve_backend(GearConfig(), torch.device("cpu")) == "torch"  # (numba: tests/test_cpu_kernels.py)
    assert resolve_backend(GearConfig(backend="torch"), torch.device("cuda")) == "torch"
    assert resolve_backend(GearConfig(backend="triton"), torch.device("cpu")) == "triton"
    monkeypatch.setenv("GEAR_HF_BACKEND", "triton")
    assert resolve_backend(GearConfig(), torch.device("cpu")) == "triton"  # env overrides auto...
    assert resolve_backend(GearConfig(backend="torch"), torch.device("cpu")) == "torch"  # ...not a forced choice
    monkeypatch.setenv("GEAR_HF_BACKEND", "torch")
    assert resolve_backend(GearConfig(), torch.device("cuda")) == "torch"
    monkeypatch.setenv("GEAR_HF_BACKEND", "cuda")
    with pytest.raises(ValueError, match="GEAR_HF_BACKEND"):
        resolve_backend(GearConfig(), torch.device("cpu"))


def test_use_fused(monkeypatch):
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    q1 = torch.zeros(1, 4, 1, 64)
    prompt = torch.zeros(1, 4, MAX_FUSED_QUERY + 1, 64)
    assert not use_fused(GearConfig(backend="torch"), q1)
    # auto on CPU: the numba CPU kernel, for what compresses (fp16 keeps stock attention bit for bit)
    from gear_hf.kernels import numba_available

    assert use_fused(GearConfig(), q1) == numba_available()
    assert not use_fused(GearConfig.preset("fp16"), q1)
    assert not use_fused(GearConfig(), prompt)
    assert not use_fused(GearConfig(), q1, softcap=30.0) and not use_fused(GearConfig(), q1, rotary_dim=32)
    forced = GearConfig.preset("gear", bits=4, backend="triton")  # storage the fused kernel reads
    assert use_fused(forced, q1)
    assert not use_fused(forced, prompt)  # prompts keep the reference path
    assert not use_fused(forced, q1, training=True)
    with pytest.raises(NotImplementedError, match="pre_rope"):
        use_fused(forced.replace(pre_rope=False), q1)
    with pytest.raises(NotImplementedError, match="value_axis='channel' with value outliers"):
        use_fused(forced.replace(value_axis="channel"), q1)
    with pytest.raises(NotImplementedError, match="key_axis='token'"):
        use_fused(forced.replace(key_axis="token"), q1)
    assert use_fused(GearConfig.preset("gear-l", bits=4, backend="triton", value_axis="channel"), q1)
    assert not use_fused(GearConfig(pre_rope=False), q1)  # auto: silently the torch path
    assert fused_supported(GearConfig(), 96, 1) is not None  # head_dim not a power of two
    assert fused_supported(GearConfig(group_size=8, buffer_size=8), 64, 1) is not None  # tiles < 16 tokens
    assert fused_supported(GearConfig.preset("fp16"), 64, 1) is None
    assert "rank" in fused_supported(GearConfig.preset("gear", bits=4, rank_prefill=32), 64, 1)
    assert fused_supported(GearConfig.preset("gear", bits=4, rank_prefill=16), 64, 1) is None


def _tiny(arch: str, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    # head_dim 32 (the fused kernel needs a power of two >= 32), GQA 2
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config, cls = LlamaConfig(rope_parameters=rope, **common), LlamaForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(sliding_window=24, **common), MistralForCausalLM
    else:
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config).to(dtype).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    return model


def _generate(model, config, new_tokens):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 41), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[mask == 0] = 0
    with gear_hf.enabled(model, config):
        out = model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        cache = gear_hf.last_cache(model)
    return out.sequences, torch.stack(out.scores, 1), cache


@pytest.fixture(params=["triton", "numba"])
def fused(request):
    """The backend whose fused kernel a generation test runs: triton (compiled on CUDA, else interpreted) or numba
    (the CPU kernel)."""
    if request.param == "numba" and DEVICE != "cpu":
        pytest.skip("the numba kernel reads CPU tensors")
    pytest.importorskip(request.param)
    return request.param


def _compare(arch, new_tokens, group_size=16, cfg=None, backend="triton"):
    model = _tiny(arch)
    cfg = cfg or GearConfig.preset("gear", bits=4, group_size=group_size, buffer_size=16)
    seq_t, logits_t, cache_t = _generate(model, cfg.replace(backend="torch"), new_tokens)
    assert cache_t.step_paths["fused"] == 0
    seq_k, logits_k, cache_k = _generate(model, cfg.replace(backend=backend), new_tokens)
    # attend-then-compress: the fused kernel serves every decode step of both layers (padded rows flush on
    # different steps), the prompt step alone takes the reference path
    assert cache_k.step_paths == {"fused": 2 * (new_tokens - 1)}
    assert sum(cache_k.decode_chunks) > 0
    assert torch.equal(seq_t, seq_k)
    assert (logits_t - logits_k).abs().max().item() < 1e-4
    return cache_k


def test_generate_llama3_fused_equals_torch(fused):
    """GQA, llama3 RoPE scaling, a left-padded batch, a decode chunk flushed during generation."""
    _compare("llama3", 9, backend=fused)


def test_generate_default_config_fused_equals_torch(fused):
    """GearConfig()'s storage (kivi, key widths allocated by the queries with a mean of 3.125 bits, 3-bit values
    rotated, 4 sinks, the prompt in longer groups) at small groups: every decode step takes the fused path and
    generation equals the torch reference path."""
    default = GearConfig()
    assert (default.method, default.key_bits, default.value_bits, default.rotation, default.key_bit_allocation) == \
        ("kivi", 3.125, 3, "values", "query")
    _compare("llama3", 9, cfg=default.replace(group_size=16, buffer_size=16, prompt_group_size=32), backend=fused)


def test_generate_gear_l_int8_factors_separate_groups_fused_equals_torch(fused):
    cfg = GearConfig.preset("gear-l", bits=2, factor_bits=8, key_group_size=16, value_group_size=8, buffer_size=16,
                            rotation="both")
    _compare("qwen2", 9, cfg=cfg, backend=fused)


def test_sliding_layer_releases_chunks_and_fused_still_equals_torch(fused):
    """Mistral with a window shorter than the sequence: the prompt chunk and leading decode chunks leave every
    row's window and are released; the kernel reads [sink | live chunks | buffer] with remapped indices."""
    cache = _compare("mistral", 40, group_size=8, backend=fused)
    assert all(layer.released.prompt and layer.released.chunks > 0 for layer in cache.layers)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_generate_fused_equals_torch(arch, fused):
    """mistral: sliding window 24 < sequence length; qwen2: q/k/v bias."""
    _compare(arch, 12, backend=fused)
