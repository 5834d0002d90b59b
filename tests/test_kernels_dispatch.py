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
from gear_hf.backends import resolve  # noqa: E402
from gear_hf.backends.triton_backend import fused_supported  # noqa: E402
from gear_hf.cache import GearCache  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402
from gear_hf.kernels import MAX_FUSED_QUERY  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_import_gear_hf_does_not_import_triton():
    code = ("import sys, gear_hf, gear_hf.kernels, gear_hf.config, gear_hf.compress\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n"
            # transformers itself imports triton when it is installed; our kernel modules must not load
            "import gear_hf.api, gear_hf.attention, gear_hf.cache, gear_hf.cache.fused\n"
            "assert 'gear_hf.kernels.decode' not in sys.modules and 'gear_hf.kernels.quant' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))


def _names(config, device="cpu", head_dim=64, dtype=torch.float32):
    return resolve(config, head_dim, dtype, torch.device(device)).names()


def test_resolve(monkeypatch):
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    monkeypatch.setattr("gear_hf.backends.numba_backend.import_problem", lambda *m: "numba is not installed")
    torch_only = {"compress": "torch", "reconstruct": "torch", "attend": "reference"}
    assert _names(GearConfig()) == torch_only  # (numba: tests/test_cpu_kernels.py)
    assert _names(GearConfig(backend="torch"), "cuda") == torch_only
    triton = {"compress": "triton", "reconstruct": "triton", "attend": "triton"}  # (fallback)
    assert _names(GearConfig(backend="triton")) == triton  # (TRITON_INTERPRET=1 here)
    monkeypatch.setenv("GEAR_HF_BACKEND", "triton")
    assert _names(GearConfig()) == triton  # env overrides auto...
    assert _names(GearConfig(backend="torch")) == torch_only  # ...not a forced choice
    monkeypatch.setenv("GEAR_HF_BACKEND", "torch")
    assert _names(GearConfig(), "cuda") == torch_only
    monkeypatch.setenv("GEAR_HF_BACKEND", "cuda")
    with pytest.raises(ValueError, match="GEAR_HF_BACKEND"):
        _names(GearConfig())


def test_forced_backend_that_cannot_serve_the_format_raises(monkeypatch):
    """A forced backend raises, naming why, when it cannot serve the format; auto passes it over and says why."""
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    for backend in ("triton", "numba"):
        with pytest.raises(ValueError, match=f"backend {backend!r} cannot run here: its attend .*pre_rope"):
            _names(GearConfig(backend=backend, pre_rope=False))
    plan = resolve(GearConfig(pre_rope=False), 64, torch.float32, torch.device("cpu"))
    assert plan.attend is None and any("pre_rope" in reason for _, reason in plan.skipped["attend"])
    # nothing compressed: every backend may be asked for, none has anything to do
    assert _names(GearConfig.preset("fp16", backend="numba")) == {"compress": "torch", "reconstruct": "torch",
                                                                   "attend": "reference"}


def test_broken_accelerator_is_reported_not_swallowed(monkeypatch):
    import gear_hf.backends as backends

    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    broken = "numba is installed but failed to import (ImportError: numpy too new)"
    monkeypatch.setattr("gear_hf.backends.numba_backend.import_problem", lambda *m: broken)
    monkeypatch.setattr(backends, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="numba backend is installed but unusable.*numpy too new"):
        plan = resolve(GearConfig(), 64, torch.float32, torch.device("cpu"))
    assert plan.attend is None
    with pytest.raises(ValueError, match="numpy too new"):
        _names(GearConfig(backend="numba"))


def _step_cache(config):
    """A GearCache of a tiny model after a prompt step (its backends resolved)."""
    model = _tiny("qwen2")
    cache = GearCache(model, config)
    k = torch.zeros(1, 2, 3, 32)
    cache.store(0, k, k)
    return cache


def test_use_fused(monkeypatch):
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    q1 = torch.zeros(1, 4, 1, 32)
    prompt = torch.zeros(1, 4, MAX_FUSED_QUERY + 1, 32)
    assert not _step_cache(GearConfig(backend="torch")).use_fused(q1)
    # auto on CPU: the numba CPU kernel, for what compresses (fp16 keeps stock attention bit for bit)
    from gear_hf.backends import import_problem

    numba_available = import_problem("numba") is None
    auto = _step_cache(GearConfig(group_size=16, buffer_size=16, prompt_group_size=32))
    assert auto.use_fused(q1) == numba_available
    assert not _step_cache(GearConfig.preset("fp16")).use_fused(q1)
    assert not auto.use_fused(prompt)
    assert not auto.use_fused(q1, softcap=30.0) and not auto.use_fused(q1, rotary_dim=16)
    forced = _step_cache(GearConfig.preset("gear", bits=4, group_size=16, buffer_size=16, backend="triton"))
    assert forced.use_fused(q1)
    assert not forced.use_fused(prompt)  # prompts keep the reference path
    assert not forced.use_fused(q1, training=True)
    with pytest.raises(NotImplementedError, match="partial rotary"):
        forced.use_fused(q1, rotary_dim=16)
    for change, message in ((dict(pre_rope=False), "pre_rope"),
                            (dict(value_axis="channel"), "value_axis='channel' with value outliers"),
                            (dict(key_axis="token"), "key_axis='token'")):
        with pytest.raises(ValueError, match=message):
            _step_cache(GearConfig.preset("gear", bits=4, group_size=16, buffer_size=16, backend="triton",
                                          **change))
    assert _step_cache(GearConfig.preset("gear-l", bits=4, group_size=16, buffer_size=16, backend="triton",
                                         value_axis="channel")).use_fused(q1)
    assert not _step_cache(GearConfig(pre_rope=False)).use_fused(q1)  # auto: the reference path
    assert fused_supported(GearConfig(), 96, 1) is not None  # head_dim not a power of two
    assert fused_supported(GearConfig(group_size=8, buffer_size=8), 64, 1) is not None  # tiles < 16 tokens
    assert fused_supported(GearConfig.preset("fp16"), 64, 1) is None
    assert "rank" in fused_supported(GearConfig.preset("gear", bits=4, rank_prefill=32), 64, 1)
    assert fused_supported(GearConfig.preset("gear", bits=4, rank_prefill=16), 64, 1) is None


def _tiny(arch: str, dtype=torch.float32, window: int = 36):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    # head_dim 32 (the fused kernel needs a power of two >= 32), GQA 2
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config, cls = LlamaConfig(rope_parameters=rope, **common), LlamaForCausalLM
    elif arch == "mistral":
        # (a window > 2 x buffer_size 16: a shorter one is stored dense, nothing compressed: gear_hf/cache/window.py)
        config, cls = MistralConfig(sliding_window=window, **common), MistralForCausalLM
    elif arch == "qwen3":  # layer 0 full, layer 1 sliding (window), one rotary module for both
        config = Qwen3Config(head_dim=32, use_sliding_window=True, sliding_window=window, max_window_layers=1, **common)
        cls = Qwen3ForCausalLM
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


def _compare(arch, new_tokens, group_size=16, cfg=None, backend="triton", window=36):
    model = _tiny(arch, window=window)
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
    """GearConfig()'s storage (kivi, key widths allocated by the queries with a mean of 3 bits, 3-bit values
    rotated per token, 4 sinks, the prompt in longer groups, the buffer at 8-bit rotated keys / 4-bit rotated values,
    both held a chunk longer) at small groups: every decode step takes the fused path and generation equals the
    torch reference path."""
    default = GearConfig()
    assert (default.method, default.key_bits, default.value_bits, default.rotation, default.key_bit_allocation,
            default.value_axis, default.key_buffer, default.value_buffer) == \
        ("kivi", 3, 3, "values", "query", "token", "int8-rotated", "int4")
    assert default.key_buffer_size == default.value_buffer_size == 2 * default.buffer_size  # (both streams held)
    _compare("llama3", 9, cfg=default.replace(group_size=16, buffer_size=16, prompt_group_size=32), backend=fused)


def test_generate_gear_l_int8_factors_separate_groups_fused_equals_torch(fused):
    cfg = GearConfig.preset("gear-l", bits=2, factor_bits=8, key_group_size=16, value_group_size=8, buffer_size=16,
                            rotation="both")
    _compare("qwen2", 9, cfg=cfg, backend=fused)


def test_sliding_layer_releases_chunks_and_fused_still_equals_torch(fused):
    """Mistral with a window shorter than the sequence: the prompt chunk and leading decode chunks leave every
    row's window and are released; the kernel reads [sink | live chunks | buffer] with remapped indices. (Window 33,
    the shortest above 2 x buffer_size: a decode chunk leaves it after 48 new tokens, the fewest that test a release;
    the interpreted Triton kernel costs seconds a step.)"""
    cache = _compare("mistral", 48, group_size=8, backend=fused, window=33)
    assert all(layer.released.prompt and layer.released.chunks > 0 for layer in cache.layers)


def test_full_and_sliding_layers_sharing_a_rotary_module_fused_equals_torch(fused):
    """Qwen3 with a full layer and a sliding one that released its prompt and leading chunks, sharing one rotary
    module: the sliding layer's kernel positions skip what it released, so the rotary halves of a step are not the
    full layer's (the numba kernel once rotated the sliding layer's keys at the full layer's positions)."""
    cache = _compare("qwen3", 48, group_size=8, backend=fused, window=33)
    full, sliding = cache.layers
    assert not full.released.prompt and sliding.released.prompt and sliding.released.chunks > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_generate_fused_equals_torch(arch, fused):
    """mistral: sliding window 36 < sequence length; qwen2: q/k/v bias."""
    _compare(arch, 12, backend=fused)
