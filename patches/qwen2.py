"""Qwen2: q/k/v projections with bias (applied by the projections themselves); optional per-layer sliding
window (`layer_types`), passed to the attention function as the stock forward does."""

from . import ArchitectureSpec, layer_sliding_window

SPECS = [ArchitectureSpec(model_type="qwen2", attention_class="Qwen2Attention",
                          attention_kwargs=layer_sliding_window)]
