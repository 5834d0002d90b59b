"""What the probe scripts (scripts/probe_*.py) share: their text arguments and one result row per (text, candidate)."""

from __future__ import annotations

import time

import torch


def add_text_arguments(parser) -> None:
    """--model, --texts (GSM8K test problem indices), --prompt (tokens at prefill), --steps (teacher-forced after)."""
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--texts", type=int, nargs="+", default=[0, 1, 200])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)


def result_row(text: int, candidate: str, simulated: bool, owned: list[float], reference: torch.Tensor,
               logits: torch.Tensor, started: float) -> dict:
    """Bits owned over the decode steps (mean, max) and the next-token KL(reference || logits) over the predicted
    positions (mean, max) with top-1 agreement; reference / logits [steps, V]."""
    from gear_hf import diagnostics

    kl = diagnostics.kl_divergence(reference, logits)
    return {"text": text, "candidate": candidate, "simulated": simulated,
            "mean_owned": sum(owned) / len(owned), "max_owned": max(owned),
            "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "top1_agreement": (reference.argmax(-1) == logits.argmax(-1)).float().mean().item(),
            "seconds": round(time.perf_counter() - started)}
