"""Tiny random-weight models of each supported architecture, built from configs (no Hub access)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 128
# The cache argument's name: `cache` from transformers 5.24, `past_key_values` up to 5.22.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
ARCHS = ("llama2", "llama3", "mistral", "qwen2")
# Each exists in transformers 5.17 (the oldest supported) and 5.24.
NEW_ARCHS = ("qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2", "granite")
WINDOW = 16  # sliding window of the architectures that have one: shorter than every test sequence
SLIDING_ARCHS = ("mistral", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "gemma3", "phi3")


def tiny_model(arch: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, layers: int = 2,
               seed: int = 0, head_dim: int = 16, window: int | None = None) -> torch.nn.Module:
    """llama2: MHA + default RoPE; llama3: GQA + llama3 RoPE scaling; mistral: GQA + sliding window 16
    (shorter than the test sequences); qwen2: GQA + q/k/v bias; NEW_ARCHS: see `_new_arch_config`.
    4 query heads of `head_dim` channels (32 or more for the fused kernel). window: another sliding window for the
    layers that have one (a window <= 2 x buffer_size is stored dense: `gear_hf.cache.window`)."""
    common = dict(vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if arch == "llama2":
        config, cls = LlamaConfig(num_key_value_heads=4, **common), LlamaForCausalLM
    elif arch == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config, cls = LlamaConfig(num_key_value_heads=2, rope_parameters=rope, **common), LlamaForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(num_key_value_heads=2, sliding_window=16, **common), MistralForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(num_key_value_heads=2, **common), Qwen2ForCausalLM
    elif arch in NEW_ARCHS:
        config, cls = _new_arch_config(arch, common)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHS + NEW_ARCHS}")
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # run every requested step
    if window is not None:
        _set_window(model, window)
    return model


def _set_window(model: torch.nn.Module, window: int) -> None:
    """The sliding window of every sliding layer (the config the masks read, the attention modules' own)."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "sliding_window", None) is None:
        raise ValueError(f"{type(model).__name__} has no sliding window to set")
    config.sliding_window = window
    for module in model.modules():
        if getattr(module, "sliding_window", None) is not None:
            module.sliding_window = window


def tiny_model_or_skip(arch: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, **kwargs):
    """`tiny_model`, skipping the test where transformers itself refuses the pair (Gemma 2 has no sdpa in 5.24)."""
    try:
        return tiny_model(arch, attn, dtype, **kwargs)
    except ValueError as error:
        if "does not support an attention implementation" in str(error):
            pytest.skip(f"transformers {transformers.__version__} has no {attn} attention for {arch}")
        raise


def _new_arch_config(arch: str, common: dict):
    """Configs of the issue-12 architectures: GQA 4/2 everywhere, a window of WINDOW tokens where the
    architecture has one (on one of the two layers when it alternates)."""
    gqa = dict(common, num_key_value_heads=2)
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    if arch == "qwen3":  # layer 0 full, layer 1 sliding (max_window_layers=1)
        config = transformers.Qwen3Config(head_dim=head_dim, use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=1, **gqa)
        return config, transformers.Qwen3ForCausalLM
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(head_dim=head_dim, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, use_sliding_window=True,
                                             sliding_window=WINDOW, **gqa)
        return config, transformers.Qwen3MoeForCausalLM
    if arch == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                            **gqa)
        return config, transformers.MixtralForCausalLM
    if arch == "gemma2":  # soft-capped attention and final logits, query_pre_attn_scalar != head_dim
        config = transformers.Gemma2Config(head_dim=head_dim, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                           attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
                                           layer_types=["sliding_attention", "full_attention"], **gqa)
        return config, transformers.Gemma2ForCausalLM
    if arch in ("gemma3_text", "gemma3"):  # local RoPE (theta 1e4) on the sliding layer, global (1e6, linear x8)
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        text = transformers.Gemma3TextConfig(head_dim=head_dim, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters=rope, **gqa)
        if arch == "gemma3_text":
            return text, transformers.Gemma3ForCausalLM
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        return config, transformers.Gemma3ForConditionalGeneration
    if arch == "phi3":  # partial rotary: half of each head's channels rotate
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        config = transformers.Phi3Config(sliding_window=WINDOW, rope_parameters=rope, **gqa)
        return config, transformers.Phi3ForCausalLM
    if arch == "olmo2":
        return transformers.Olmo2Config(**gqa), transformers.Olmo2ForCausalLM
    if arch == "granite":  # attention_multiplier replaces 1/sqrt(head_dim)
        config = transformers.GraniteConfig(attention_multiplier=0.09, embedding_multiplier=4.0,
                                            residual_multiplier=0.5, logits_scaling=2.0, **gqa)
        return config, transformers.GraniteForCausalLM
    raise ValueError(arch)


def prompts(batch: int, length: int = 21, seed: int = 1, pads: list[int] | None = None):
    """Token ids and a left-padded attention mask: row r has pads[r] pad tokens (default r*5: row 0 none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(batch):
        mask[r, : pads[r] if pads is not None else r * 5] = 0
    ids[mask == 0] = 0
    return ids, mask


def greedy(model, ids, mask, steps: int, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         **kwargs)
    return out.sequences, torch.stack(out.scores, 1)  # [B, T+steps], [B, steps, V]
