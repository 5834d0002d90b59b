"""Granite: Llama attention whose score scale is `attention_multiplier` instead of 1/sqrt(d); the module holds
it as `scaling`, which the shared forward (and the fused kernel) use. The embedding/residual/logit multipliers
sit outside the attention and run stock."""

from . import ArchitectureSpec

SPECS = [ArchitectureSpec(model_type="granite", attention_class="GraniteAttention")]
