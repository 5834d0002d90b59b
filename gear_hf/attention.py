"""The one attention forward shared by every patched architecture.

With a `GearCache` it stores keys *before* RoPE into the full-precision buffer, attends — fused kernel on
decode steps where it applies, else the reference path: reads back the whole (reconstructed) history, rotates
it at the stored positions with the model's own rotary module, and calls the model's configured attention
function (sdpa/eager/...) with the model's own mask — then lets the cache compress what left the buffer. With
any other cache, or none, it calls the original forward unchanged, so loglikelihood scoring and stock caches
behave exactly like stock.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache import GearCache
from .compress.rope import apply_rotary
from .hf_compat import pop_cache
from .kernels import MAX_FUSED_QUERY  # no triton import: kernels load lazily
from .step_ref import OPAQUE_STEP, StepRef


@dataclass
class AttentionPatch:
    """What the shared forward needs to know about one patched attention module."""

    original_forward: Callable  # bound forward we replaced (or accelerate's _old_forward)
    cache_kwarg: str  # the cache argument name the original forward takes
    rotary_emb: torch.nn.Module  # the model's rotary module (computes cos/sin from positions)
    attention_kwargs: Callable[[torch.nn.Module], dict]  # architecture quirks (sliding_window, softcap)
    project: Callable  # (module, hidden_states [B,q,hidden]) -> q, k, v [B,H,q,d] before RoPE (gear_hf.patches)
    replaced_attr: str  # "forward" or "_old_forward"
    step_ref: StepRef  # the patched module, as the compiled cache step takes it (gear_hf.step_ref)


def _eager_attention(module: torch.nn.Module) -> Callable:
    return sys.modules[type(module).__module__].eager_attention_forward


def gear_attention_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                           attention_mask: torch.Tensor | None = None, **kwargs: Any):
    patch: AttentionPatch = module._gear_hf_patch
    cache = pop_cache(kwargs)
    if not isinstance(cache, GearCache):
        if cache is not None:
            kwargs[patch.cache_kwarg] = cache
        return patch.original_forward(hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, **kwargs)

    input_shape = hidden_states.shape[:-1]
    query, key, value = patch.project(module, hidden_states)  # [B,Hq,q,d], [B,Hkv,q,d] x2; before RoPE
    cos, sin = position_embeddings
    if not torch.compiler.is_compiling():
        # a decode step's query reaches the cache before RoPE (a CPU kernel rotates it itself); a prompt's is rotated
        # here, so that no prompt-sized copy of it outlives the rotation
        prompt = query.shape[2] > MAX_FUSED_QUERY
        if prompt:
            query = apply_rotary(query, cos, sin)
        output, weights = cache_step(module, cache, query, key, value, cos, sin, attention_mask, kwargs,
                                     query_rotated=prompt)
        output = output.reshape(*input_shape, -1).contiguous()
        return module.o_proj(output), weights
    query = apply_rotary(query, cos, sin)
    if OPAQUE_STEP and _op_serves(kwargs):
        # the model-level hook's 2D padding mask: traced, its write to the cache lands only after the graph ran
        padding_mask = cache._pending_mask
        output = torch.ops.gear_hf.cache_step(patch.step_ref, cache.step_ref, query, key, value, cos, sin,
                                              attention_mask, kwargs.get("position_ids"), padding_mask)
        weights = None
    else:
        output, weights = _cache_step_boundary(module, cache, query, key, value, cos, sin, attention_mask, kwargs)
    output = output.reshape(*input_shape, -1).contiguous()
    return module.o_proj(output), weights


def cache_step(module: torch.nn.Module, cache: GearCache, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor | None,
               kwargs: dict, query_rotated: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's step through the cache: store, attend (fused or reference), compress. Returns the attention
    output [B,q,Hq,d] and weights (or None). query_rotated False: query is before RoPE, rotated where it is read
    (by the fused kernel itself where it can).

    None of it traces: the cache plans each step on the host (Python lists), runs numba kernels, checks finiteness
    with a host sync and resolves its backends at the first step. Under torch.compile it runs as one opaque
    operator (`gear_hf::cache_step`, below) inside the graph; eager calls it directly (no dispatcher)."""
    patch: AttentionPatch = module._gear_hf_patch
    position_ids = kwargs.get("position_ids")
    if not cache.gear_config.pre_rope:  # ablation: compress keys after RoPE, as HF's QuantizedCache does
        key = apply_rotary(key, cos, sin)
    query_rotary = None if query_rotated else (cos, sin)
    # joins the buffer: the step sees itself exactly (the query: for keys whose bits are allocated by it)
    cache.store(module.layer_idx, key, value, position_ids, query, query_rotary)
    quirks = patch.attention_kwargs(module)  # e.g. sliding_window, softcap
    if cache.use_fused(query, training=module.training, output_attentions=bool(kwargs.get("output_attentions")),
                       rotary_dim=2 * patch.rotary_emb.inv_freq.numel(), softcap=quirks.get("softcap")):
        rotary = patch.rotary_emb
        output = cache.fused_attention(module.layer_idx, query, scaling=module.scaling, inv_freq=rotary.inv_freq,
                                       attention_scaling=getattr(rotary, "attention_scaling", 1.0),
                                       query_rotary=query_rotary)
        weights = None
        cache.step_paths[cache.fused_path_name] += 1  # "fused-tc": the tensor-core kernel ran
    else:  # the reference path: reconstruct, rotate, the model's own attention function
        if query_rotary is not None:
            query = apply_rotary(query, cos, sin)
        # [B,Hkv,T,d] keys rotated, values, and the mask for their columns (the cache's layout for this step;
        # HF's padded columns when the attention weights are returned)
        keys, values, mask = cache.attention_inputs(module.layer_idx, key, value, patch.rotary_emb, attention_mask,
                                                    padded_layout=bool(kwargs.get("output_attentions")))
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                          _eager_attention(module))
        output, weights = attention(
            module, query, keys, values, mask,
            dropout=0.0 if not module.training else module.attention_dropout,
            scaling=module.scaling,
            **quirks,
            **kwargs,
        )
        if query.shape[2] <= MAX_FUSED_QUERY:  # decode steps only: the share the fused path should serve
            cache.step_paths[cache.reference_path_name] += 1  # "fallback": the Triton reconstruction
    cache.compress_pending(module.layer_idx)  # after attending: what left the buffer is compressed
    return output, weights


# kwargs the attention forward receives on a plain step, which the operator carries (position_ids) or which the
# step does not read (use_cache, cache_position, MoE models' output_router_logits); anything else
# (output_attentions=True: weights whose length the graph cannot know; a flash-attention packing argument) takes
# the compiler-disabled call: one graph break there
_OP_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "output_router_logits"})


def _op_serves(kwargs: dict) -> bool:
    return all(name in _OP_KWARGS for name in kwargs) and not kwargs.get("output_attentions")


_cache_step_boundary = torch.compiler.disable(cache_step, reason="gear_hf: a step the cache_step operator "
                                              "does not carry (attention weights or extra attention arguments)")


if OPAQUE_STEP:  # (else every compiled step takes `_cache_step_boundary`: one graph break per layer)
    @torch.library.custom_op("gear_hf::cache_step", mutates_args=())
    def _cache_step_op(module: StepRef, cache: StepRef, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, attention_mask: Optional[torch.Tensor],
                       position_ids: Optional[torch.Tensor], padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """`cache_step` as the compiled graph calls it: the attention output [B,q,Hq,d], contiguous (as the fake).
        padding_mask [B, T_past+q]: the step's 2D mask, which the first layer of a step plans with (dynamo replays the
        hook's `observe_attention_mask` only after the graph, so each call hands it over itself and takes it back)."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        gear_cache = cache.target
        gear_cache.observe_attention_mask(padding_mask)
        try:
            output, _ = cache_step(module.target, gear_cache, query, key, value, cos, sin, attention_mask, kwargs)
        finally:
            gear_cache.observe_attention_mask(None)  # planned with by the step's first layer, or not needed
        return output.contiguous()


    @_cache_step_op.register_fake
    def _(module, cache, query, key, value, cos, sin, attention_mask, position_ids, padding_mask):
        batch, heads, length, _ = query.shape  # [B,Hq,q,d]
        return query.new_empty((batch, length, heads, value.shape[-1]))
