"""The one attention forward shared by every patched architecture.

With a `GearCache` it stores keys *before* RoPE, reads back the whole (reconstructed) history, rotates it
at the stored positions with the model's own rotary module, and calls the model's configured attention
function (sdpa/eager/...) with the model's own mask. With any other cache, or none, it calls the original
forward unchanged, so loglikelihood scoring and stock caches behave exactly like stock.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache import GearCache
from .kernels import use_fused  # no triton import: kernels load lazily

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # 5.24 / <=5.22 / older spellings


@dataclass
class AttentionPatch:
    """What the shared forward needs to know about one patched attention module."""

    original_forward: Callable  # bound forward we replaced (or accelerate's _old_forward)
    cache_kwarg: str  # the cache argument name the original forward takes
    rotary_emb: torch.nn.Module  # the model's rotary module (computes cos/sin from positions)
    attention_kwargs: Callable[[torch.nn.Module], dict]  # architecture quirks (sliding_window, softcap)
    project: Callable  # (module, hidden_states [B,q,hidden]) -> q, k, v [B,H,q,d] before RoPE (gear_hf.patches)
    replaced_attr: str  # "forward" or "_old_forward"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,d] rotated by cos/sin [B,T,r]: bit for bit HF's apply_rotary_pos_emb, x*cos + rotate_half(x)*sin
    with rotate_half(x) = cat(-x2, x1), computed per half in place (a + (-b)*s == a - b*s exactly), which
    skips the negated copy and the concatenation: the reference path rotates the whole history every step.
    Partial rotary (r < d, Phi-3's partial_rotary_factor): the first r channels rotate, the rest pass through.
    cos/sin in a wider dtype than x (OLMo 2): computed in that dtype, the result cast back to x's."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half] -= x2 * sin[..., :half]
    out[..., half:] += x1 * sin[..., half:]
    return out.to(x.dtype)  # OLMo 2's rotary returns float32 cos/sin: rotate in float32, back to x's dtype as HF does


def _eager_attention(module: torch.nn.Module) -> Callable:
    return sys.modules[type(module).__module__].eager_attention_forward


def gear_attention_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                           attention_mask: torch.Tensor | None = None, **kwargs: Any):
    patch: AttentionPatch = module._gear_hf_patch
    cache = None
    for name in CACHE_KWARGS:
        value = kwargs.pop(name, None)
        cache = value if cache is None else cache
    if not isinstance(cache, GearCache):
        if cache is not None:
            kwargs[patch.cache_kwarg] = cache
        return patch.original_forward(hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, **kwargs)

    input_shape = hidden_states.shape[:-1]
    query, key, value = patch.project(module, hidden_states)  # [B,Hq,q,d], [B,Hkv,q,d] x2; before RoPE
    cos, sin = position_embeddings
    query = apply_rotary(query, cos, sin)
    position_ids = kwargs.get("position_ids")
    if not cache.gear_config.pre_rope:  # ablation: compress keys after RoPE, as HF's QuantizedCache does
        key = apply_rotary(key, cos, sin)
    cache.store(module.layer_idx, key, value, position_ids)
    # -- fused Triton decode path (gear_hf.kernels.use_fused decides: backend switch, CUDA, supported step); a
    #    step that just compressed a chunk takes the reference path, which attends its own tokens exactly --
    quirks = patch.attention_kwargs(module)  # e.g. sliding_window, softcap
    if use_fused(cache.gear_config, query, training=module.training,
                 output_attentions=bool(kwargs.get("output_attentions")),
                 rotary_dim=2 * patch.rotary_emb.inv_freq.numel(), softcap=quirks.get("softcap")) \
            and not cache.step_compressed():
        rotary = patch.rotary_emb
        output = cache.fused_attention(module.layer_idx, query, scaling=module.scaling, inv_freq=rotary.inv_freq,
                                       attention_scaling=getattr(rotary, "attention_scaling", 1.0))
        return module.o_proj(output.reshape(*input_shape, -1).contiguous()), None
    # -- the reference path: reconstruct, rotate, the model's own attention function --
    keys, values = cache.read(module.layer_idx, key, value)  # [B,Hkv,T,d]
    if cache.gear_config.pre_rope:
        keys = apply_rotary(keys, *cache.rotary_for_read(module.layer_idx, patch.rotary_emb, values))

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                      _eager_attention(module))
    output, weights = attention(
        module, query, keys, values, attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **quirks,
        **kwargs,
    )
    output = output.reshape(*input_shape, -1).contiguous()
    return module.o_proj(output), weights
