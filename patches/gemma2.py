"""Gemma 2: alternating sliding and global layers (`layer_types`, the module's `sliding_window`), attention
scale `query_pre_attn_scalar**-0.5` (the module's `scaling`), and attention-logit soft-capping passed to the
attention function as `softcap` — honoured by the eager function, ignored by sdpa exactly as in stock. The fused
kernel does not cap logits, so a soft-capped model always takes the reference path."""

from . import ArchitectureSpec


def _window_and_softcap(module):
    return {"sliding_window": module.sliding_window, "softcap": module.attn_logit_softcapping}


SPECS = [ArchitectureSpec(model_type="gemma2", attention_class="Gemma2Attention",
                          attention_kwargs=_window_and_softcap)]
