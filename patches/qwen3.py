"""Qwen3 and Qwen3-MoE: Qwen2-style projections followed by per-head RMSNorms `q_norm`/`k_norm` before RoPE
(the cache stores keys after the norm, before RoPE). Qwen3 has per-layer windows (`layer_types`); Qwen3-MoE one
config-wide window (set only with use_sliding_window). Both kept as the module's `sliding_window`."""

from . import ArchitectureSpec, layer_sliding_window, per_head_qk_norm

SPECS = [
    ArchitectureSpec(model_type="qwen3", attention_class="Qwen3Attention", project=per_head_qk_norm,
                     projection_attrs=("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"),
                     attention_kwargs=layer_sliding_window),
    ArchitectureSpec(model_type="qwen3_moe", attention_class="Qwen3MoeAttention", project=per_head_qk_norm,
                     projection_attrs=("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"),
                     attention_kwargs=layer_sliding_window),
]
