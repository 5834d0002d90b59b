"""Tiny random-weight models of each supported architecture, built from configs (no Hub access)."""

from __future__ import annotations

import inspect

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

VOCAB = 128
# The cache argument's name: `cache` from transformers 5.24, `past_key_values` up to 5.22.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
ARCHS = ("llama2", "llama3", "mistral", "qwen2")


def tiny_model(arch: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, layers: int = 2,
               seed: int = 0) -> torch.nn.Module:
    """llama2: MHA + default RoPE; llama3: GQA + llama3 RoPE scaling; mistral: GQA + sliding window 16
    (shorter than the test sequences); qwen2: GQA + q/k/v bias."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
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
    else:
        raise ValueError(arch)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # run every requested step
    return model


def prompts(batch: int, length: int = 21, seed: int = 1):
    """Token ids and a left-padded attention mask: row r has r*5 pad tokens (row 0 none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(batch):
        mask[r, : r * 5] = 0
    ids[mask == 0] = 0
    return ids, mask


def greedy(model, ids, mask, steps: int, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         **kwargs)
    return out.sequences, torch.stack(out.scores, 1)  # [B, T+steps], [B, steps, V]
