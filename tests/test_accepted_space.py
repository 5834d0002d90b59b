"""The accepted space is the space that works: any configuration GearConfig accepts, on any supported model shape,
is either refused up front (GearConfig(...) or enable, with a ValueError / NotImplementedError) or generates.

Drawn: GearConfig fields × architectures × head_dims (16-256, not only powers of two) × GQA ratios × dtypes ×
padded batches × prompt and generation lengths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gear_hf
from gear_hf import GearConfig

HEAD_DIMS = (16, 20, 24, 32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 256)
GQA = ((4, 4), (4, 1), (7, 1), (6, 2))  # (query heads, KV heads): ratios 1, 4, 7, 3


def _model(arch: str, head_dim: int, heads: tuple[int, int], dtype: torch.dtype):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    q_heads, kv_heads = heads
    common = dict(vocab_size=64, hidden_size=q_heads * head_dim, head_dim=head_dim, intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        config, cls = MistralConfig(sliding_window=24, **common), MistralForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


_fields = st.fixed_dictionaries({
    "method": st.sampled_from(("fp16", "kivi", "kcvt", "outlier", "gear-l", "gear")),
    "key_bit_allocation": st.sampled_from(("uniform", "query")),
    "key_bits": st.sampled_from((2, 3, 4, 8, 2.5, 3.125, 3.5)),
    "value_bits": st.sampled_from((2, 3, 4, 8)),
    "group_size": st.sampled_from((8, 16, 32, 64)),
    "buffer_size": st.sampled_from((16, 32, 64, 128)),
    "prompt_group_size": st.sampled_from((None, 32, 64, 256)),
    "sink_tokens": st.integers(0, 5),
    "rotation": st.sampled_from(("none", "keys", "values", "both")),
    "range_search": st.sampled_from(("none", "keys", "values", "both")),
    "factor_bits": st.sampled_from((8, 16)),
    "value_axis": st.sampled_from(("token", "channel")),
    "rank_prefill": st.integers(0, 6),
    "rank_decode": st.integers(0, 3),
    "outlier_ratio": st.sampled_from((0.0, 0.02, 0.1)),
})


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(fields=_fields, arch=st.sampled_from(("llama", "mistral", "qwen2")), head_dim=st.sampled_from(HEAD_DIMS),
       heads=st.sampled_from(GQA), dtype=st.sampled_from((torch.float32, torch.bfloat16)),
       prompt=st.integers(1, 70), new_tokens=st.integers(1, 40), padded=st.booleans(),
       backend=st.sampled_from(("auto", "torch")))
def test_accepted_configurations_generate(fields, arch, head_dim, heads, dtype, prompt, new_tokens, padded, backend):
    try:
        config = GearConfig(**fields, backend=backend)
    except ValueError:
        return  # refused where it was written
    model = _model(arch, head_dim, heads, dtype)
    try:
        gear_hf.enable(model, config)
    except (ValueError, NotImplementedError):
        return  # refused at enable, with a reason
    batch = 2 if padded else 1
    ids = torch.randint(3, 64, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    mask = torch.ones_like(ids)
    if padded and prompt > 1:
        mask[1, : prompt // 2] = 0
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (batch, prompt + new_tokens)
    assert gear_hf.last_cache(model) is not None


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_config_generates_on_every_head_dim(head_dim):
    """GearConfig() itself on every head_dim the patches accept (issue: 3.125 bits x 20 channels)."""
    model = _model("llama", head_dim, (4, 2), torch.float32)
    gear_hf.enable(model)
    ids = torch.randint(3, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=140,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (1, 440) and sum(gear_hf.last_cache(model).decode_chunks) > 0
