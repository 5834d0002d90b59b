"""Key bits allocated per channel, where the queries make a key channel's quantization error costly.

A key's quantization error e moves an attention logit by q·e. RoPE rotates each channel pair (i, i + d/2) by an
angle that changes with the distance, so over positions a pair's share of the squared logit error averages to
½|q_pair|²|e_pair|²: channel c costs its pair's query energy w_c times its own squared error. A b-bit uniform code
over a group spanning r errs by ∝ (r / (2^b - 1))², so one more bit for channel c is worth
w_c r_c² (1/(2^b - 1)² - 1/(2^(b+1) - 1)²); each head's budget of mean_bits·d bits goes to the largest such gains
(greedy, which is optimal here: a channel's gains fall with every bit it gets). Every channel keeps 1 to 8 bits.

Why (scripts/frontier.py, bf16, T=1028, next-token KL on GSM8K texts 0/1/2, keys unrotated, values 3 bits per
channel, 3.22 bits/element held): 3 bits per key channel allocated this way 0.0073 / 0.0078 / 0.0112 on SmolLM2 and
0.0048 / 0.0026 / 0.0033 on Qwen2.5, where 3 bits for every channel gave 0.0271 / 0.0197 / 0.0270 and 0.0140 /
0.0157 / 0.0167 (docs/results.md, "Accuracy per byte" (8)).

A head's budget is a whole number of bits: mean_bits·d rounded down (`head_bit_budget`). key_bits is a multiple of
1/8, so on head_dims that are not a multiple of 8 the product can fall between two whole numbers (the default's
3.125 bits over 20 channels: 62.5 -> 62 bits, a mean of 3.1). Rounding down keeps what the cache holds at or below
what was asked (a recommendation for b bits owns <= b bits), and costs under one bit per head; `summary()` names
the mean really allocated when it differs.
"""

from __future__ import annotations

import math

import torch

from .quant import MAX_CHANNEL_BITS

MIN_CHANNEL_BITS = 1


def query_pair_energy(query: torch.Tensor, kv_heads: int, valid: torch.Tensor) -> torch.Tensor:
    """Per key channel, the summed squared query of its RoPE pair: query [B,Hq,q,d] (before or after RoPE: a pair's
    energy is the same), valid [B,q] bool (real tokens) -> [B,Hkv,d] float64, summed over the valid tokens and over
    the query heads that share each key head (each channel of a pair gets the pair's mean)."""
    B, Hq, q, d = query.shape
    sums = torch.empty(B, Hq, d, dtype=torch.float64, device=query.device)
    mask = valid[:, None, :, None]
    for h in range(Hq):  # one query head at a time: a float64 copy of one head [B,1,q,d], not of every query
        torch.sum(query[:, h : h + 1].double().square_().mul_(mask), dim=2, out=sums[:, h : h + 1])
    energy = sums.view(B, kv_heads, Hq // kv_heads, d).sum(dim=2)  # [B,Hkv,d]
    half = d // 2
    pair = (energy[..., :half] + energy[..., half:]) / 2
    return torch.cat([pair, pair], dim=-1)


def head_bit_budget(mean_bits: float, d: int) -> int:
    """The bits a head's d key channels share for a mean of mean_bits: mean_bits·d rounded down to a whole number
    (62.5 -> 62 for 3.125 bits over 20 channels; see the module docstring). Between MIN_CHANNEL_BITS·d and
    MAX_CHANNEL_BITS·d for a mean in [1, 8]."""
    if isinstance(mean_bits, bool) or not MIN_CHANNEL_BITS <= mean_bits <= MAX_CHANNEL_BITS or d < 1:
        raise ValueError(f"cannot allocate a mean of {mean_bits!r} bits over {d} channels: the mean must lie in "
                         f"[{MIN_CHANNEL_BITS}, {MAX_CHANNEL_BITS}] and head_dim be >= 1")
    return math.floor(mean_bits * d + 1e-9)  # + 1e-9: a whole product computed in floats stays whole


def allocated_mean_bits(mean_bits: float, d: int) -> float:
    """The mean key width really allocated on d channels for a requested mean (head_bit_budget / d)."""
    return head_bit_budget(mean_bits, d) / d


def allocate_channel_bits(weight: torch.Tensor, x: torch.Tensor, group: int, mean_bits: float) -> torch.Tensor:
    """Bits for each key channel of each row and head: weight [B,H,d] (query energy, >= 0), x [B,H,n,d] the keys
    whose group ranges set the errors (groups of `group` tokens) -> uint8 [B,H,d] in [1, 8], summing to
    head_bit_budget(mean_bits, d) over every row and head."""
    B, H, n, d = x.shape
    total = head_bit_budget(mean_bits, d)
    grouped = x.view(B, H, n // group, group, d)
    # (max and min are exact in the keys' dtype: taken before the float64 cast, with no float64 copy of the chunk)
    spread = (grouped.amax(dim=3).double() - grouped.amin(dim=3).double()).square_().mean(dim=2)  # [B,H,d]
    steps = torch.arange(MIN_CHANNEL_BITS, MAX_CHANNEL_BITS, dtype=torch.float64, device=x.device)  # b -> b+1
    error_drop = (2.0 ** steps - 1).pow(-2) - (2.0 ** (steps + 1) - 1).pow(-2)  # [7]
    gains = (weight.double() * spread).unsqueeze(-1) * error_drop  # [B,H,d,7]
    extra = total - MIN_CHANNEL_BITS * d
    # stable: equal gains (e.g. a channel no query reads) are taken in channel order, so the choice is reproducible
    order = gains.flatten(2).sort(dim=-1, descending=True, stable=True).indices[..., :extra]  # [B,H,extra]
    chosen = torch.zeros(B, H, d * len(steps), dtype=torch.uint8, device=x.device).scatter_(-1, order, 1)
    return chosen.view(B, H, d, len(steps)).sum(dim=-1, dtype=torch.uint8).add_(MIN_CHANNEL_BITS)


def even_channel_bits(batch: int, heads: int, d: int, mean_bits: float, device=None) -> torch.Tensor:
    """An allocation with the same total as `allocate_channel_bits` and no data (sizing probes): [B,H,d] uint8."""
    total = head_bit_budget(mean_bits, d)
    bits = torch.full((d,), total // d, dtype=torch.uint8, device=device)
    bits[: total % d] += 1
    return bits.expand(batch, heads, d).clone()
