"""OLMo 2: RMSNorms `q_norm`/`k_norm` over the whole q and k projections (all heads at once), before the head
reshape and RoPE; no sliding window."""

from . import ArchitectureSpec, split_heads


def _whole_projection_qk_norm(module, hidden_states):
    query = split_heads(module, module.q_norm(module.q_proj(hidden_states)))
    key = split_heads(module, module.k_norm(module.k_proj(hidden_states)))
    return query, key, split_heads(module, module.v_proj(hidden_states))


SPECS = [ArchitectureSpec(model_type="olmo2", attention_class="Olmo2Attention", project=_whole_projection_qk_norm,
                          projection_attrs=("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"))]
