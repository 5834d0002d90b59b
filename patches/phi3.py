"""Phi-3: one fused `qkv_proj` (query heads, then key heads, then value heads along the output), an optional
config-wide sliding window, and partial rotary (`partial_rotary_factor`: only the first channels of each head are
rotated; the shared forward rotates exactly the channels the rotary module's cos/sin cover, and the fused kernel
is not used). `longrope` (Phi-3 128k) changes its frequencies with the length and is refused at enable."""

from . import ArchitectureSpec, config_sliding_window, split_heads


def _split_fused_qkv(module, hidden_states):
    qkv = module.qkv_proj(hidden_states)  # [B, q, (Hq + 2*Hkv) * d]
    query_width = module.config.num_attention_heads * module.head_dim
    kv_width = module.config.num_key_value_heads * module.head_dim
    query, key, value = qkv.split((query_width, kv_width, kv_width), dim=-1)
    return split_heads(module, query), split_heads(module, key), split_heads(module, value)


SPECS = [ArchitectureSpec(model_type="phi3", attention_class="Phi3Attention", project=_split_fused_qkv,
                          projection_attrs=("qkv_proj",), attention_kwargs=config_sliding_window)]
