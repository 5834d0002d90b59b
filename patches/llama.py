"""Llama (Llama-2: MHA, default RoPE; Llama-3: GQA, `llama3` RoPE scaling) — and SmolLM2, which is Llama."""

from . import ArchitectureSpec

SPECS = [ArchitectureSpec(model_type="llama", attention_class="LlamaAttention")]
