"""Mixtral: Mistral's attention (GQA, one config-wide sliding window) in front of a sparse MoE MLP. Only the
attention is patched; the experts run stock."""

from . import ArchitectureSpec, config_sliding_window

SPECS = [ArchitectureSpec(model_type="mixtral", attention_class="MixtralAttention",
                          attention_kwargs=config_sliding_window)]
