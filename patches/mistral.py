"""Mistral: Llama attention plus a sliding window, passed to the attention function and enforced by the
model's own sliding-window mask (the GEAR cache keeps every token; the mask hides those out of the window)."""

from . import ArchitectureSpec, config_sliding_window

SPECS = [ArchitectureSpec(model_type="mistral", attention_class="MistralAttention",
                          attention_kwargs=config_sliding_window)]
