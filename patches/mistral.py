"""Mistral: Llama attention plus a config-wide sliding window, passed to the attention function and enforced by the
model's own sliding-window mask. The GEAR cache's sliding layers read exactly the window transformers' own sliding
cache keeps and release the chunks that left every row's window (gear_hf/cache/layer.py), so what they hold stops
growing once the sequence passes the window."""

from . import ArchitectureSpec, config_sliding_window

SPECS = [ArchitectureSpec(model_type="mistral", attention_class="MistralAttention",
                          attention_kwargs=config_sliding_window)]
