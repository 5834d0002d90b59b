"""Rotary embeddings at read time, in one place (attention, cache, kernels' oracle and diagnostics use these).

Keys are stored before RoPE, so whoever reads them rotates them at their stored positions: the reference
path with `apply_rotary` (bit for bit HF's `apply_rotary_pos_emb`) and cos/sin from the model's own rotary
module (computed once per step by `RotaryMemo`), the oracle with `rope_tables` (what the fused kernel computes).
"""

from __future__ import annotations

from typing import Callable

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """x [B,H,T,d] rotated by cos/sin [B,T,r] (or [B,1,T,r]): bit for bit HF's apply_rotary_pos_emb,
    x*cos + rotate_half(x)*sin with rotate_half(x) = cat(-x2, x1), computed per half in place
    (a + (-b)*s == a - b*s exactly), which skips the negated copy and the concatenation: the reference path
    rotates the whole history every step.
    Partial rotary (r < d, Phi-3's partial_rotary_factor): the first r channels rotate, the rest pass through.
    cos/sin in a wider dtype than x (OLMo 2): computed in that dtype, the result cast back to x's.
    out: an optional tensor shaped and typed like x (not overlapping it) to write the result into; scratch: an
    optional [B,H,T,r/2] tensor of out's dtype for the half products (else two temporaries are allocated)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        if out is None:
            return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
        out[..., :rotary_dim].copy_(rotated)
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
        return out
    if cos.ndim < x.ndim:  # [B,T,r] -> [B,1,T,r] (already so when the caller shares them between layers)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if out is None or torch.result_type(x, cos) != out.dtype:
        rotated, scratch = x * cos, None
    else:
        rotated = torch.mul(x, cos, out=out)
    if scratch is not None and (scratch.dtype != rotated.dtype or scratch.shape != x2.shape):
        scratch = None
    rotated[..., :half].sub_(torch.mul(x2, sin[..., :half], out=scratch))
    rotated[..., half:].add_(torch.mul(x1, sin[..., half:], out=scratch))
    if out is None:
        return rotated.to(x.dtype)  # OLMo 2's float32 cos/sin: rotate in float32, back to x's dtype as HF does
    return rotated if rotated is out else out.copy_(rotated)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The float32 angles [..., d/2] of integer positions, positions x inv_freq as HF's rotary modules form them."""
    return positions.float()[..., None] * inv_freq.float()


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """cos/sin [..., d] in float32 for integer positions, as HF's rotary modules compute them."""
    ang = rope_angles(positions, inv_freq)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryMemo:
    """cos/sin of one step's read positions from a model's rotary module, computed once per step and shared
    by every layer that reads the same columns with the same rotary module (Gemma 3 has two: local and
    global). Dropped when the step ends (`clear`): kept from one step to the next it would be a table
    proportional to T beside the CPU kernel's own, and recomputing it (once per step, not per layer)
    costs little next to reading the history."""

    def __init__(self) -> None:
        self._entries: dict = {}  # (columns, rotary, dtype, device) -> (step, (cos, sin))

    def get(self, step: int, columns, rotary_emb, like: torch.Tensor, positions: Callable[[], torch.Tensor]):
        """rotary_emb(like, positions()) for this step's read of `columns` (a visible start column of the padded
        layout, or "slots"), computed once: (cos, sin) [B,1,T,d], shaped once as `apply_rotary` broadcasts them
        over the heads."""
        key = (columns, id(rotary_emb), like.dtype, like.device)
        entry = self._entries.get(key)
        if entry is not None and entry[0] == step:
            return entry[1]
        self._entries = {k: e for k, e in self._entries.items() if e[0] == step}
        cos, sin = rotary_emb(like, positions())
        cos_sin = (cos.unsqueeze(1), sin.unsqueeze(1))
        self._entries[key] = (step, cos_sin)
        return cos_sin

    def clear(self) -> None:
        """The step ended: nothing is kept for the next."""
        self._entries = {}

    def nbytes(self) -> int:
        """Bytes of the entries (cos/sin of the current step; 0 between steps)."""
        return sum(t.numel() * t.element_size() for _, cos_sin in self._entries.values() for t in cos_sin)
