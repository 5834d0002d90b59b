"""Qwen2: q/k/v projections with bias (applied by the projections themselves); optional per-layer sliding
window (`layer_types`), passed to the attention function as the stock forward does."""

from . import ArchitectureSpec


def _sliding_window(module):
    return {"sliding_window": getattr(module, "sliding_window", None)}


SPECS = [ArchitectureSpec(model_type="qwen2", attention_class="Qwen2Attention",
                          attention_kwargs=_sliding_window)]
