"""Mistral: Llama attention plus a sliding window, passed to the attention function and enforced by the
model's own sliding-window mask (the GEAR cache keeps every token; the mask hides those out of the window)."""

from . import ArchitectureSpec


def _sliding_window(module):
    return {"sliding_window": getattr(module.config, "sliding_window", None)}


SPECS = [ArchitectureSpec(model_type="mistral", attention_class="MistralAttention",
                          attention_kwargs=_sliding_window)]
