"""A probe, not a format: would cheaper quantization statistics keep GearConfig()'s KL? (issue 25, "<= 3.6 bits")

GearConfig() stores each value vector (after the Walsh–Hadamard rotation) at 3 bits per channel in its chunks and
4 bits in the buffer, with one 16-bit scale and one 16-bit minimum per token and head: 32 bits per token, 0.5
bit/element on d=64 heads, 0.25 on d=128: after the key buffer, the largest item of the default's bits. This measures
what storing them in 16 bits would cost where it is consumed: the next-token KL vs DynamicCache on real weights.

How (a SIMULATION of the candidate statistics, labelled as such; nothing here is stored in fewer bits): the config runs
on the torch backend, whose compression is the oracle (`gear_hf.compress.quant.quantize`). The probe wraps the
oracle's choice of a group's stored (minimum, scale) for the value groups only (per-token groups whose highest code is
an integer 7 or 15: 3-bit chunk values, the 4-bit value buffer; keys use per-channel widths, the key buffer code 255)
so that they take the values the candidate can represent; codes are computed against them, as the oracle always
does, so the values attended and kept carry the candidate's error. The bits are computed, not held: the report's bits
minus the statistics bits a candidate saves per (scale, minimum) pair the cache allocates for the groups it applies to
(the stores' own "scale" fields, counted after every step as the report counts them).

A candidate is FORMAT[:GROUPS] parts joined by "+", GROUPS letters of "vkb" (default "v"): v = the values (3-bit
chunks and the 4-bit buffer: per-token groups with highest code 7 or 15), k = the key chunks (per-channel groups,
per-channel widths), b = the 8-bit key buffer (highest code 255). These tell GearConfig()'s groups apart, not any
config's. E.g. log8z8:v+m16s8:kb.

Formats (per group, [lo, hi] its range):
  base     the real format: 16-bit minimum and 16-bit scale (this run's baseline)
  sym      symmetric, the scale alone (16 bits): minimum = -scale * top / 2, range [-a, a], a = max(|lo|, |hi|)
  z8       16-bit scale + an 8-bit zero point z (minimum = -z * scale, z on a grid of top/255): 24 bits
  log8z8   8-bit scale (a power of 2^(1/8), rounded up) + the 8-bit zero point: 16 bits
  m16s8    16-bit minimum + the 8-bit scale: 24 bits (a zero point cannot follow a key channel far from 0)

    GEAR_HF_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/probe_value_stats.py \
        --texts 0 1 200 --candidates base,sym,z8,log8z8,log8z8:vk,m16s8:k,log8z8:v+m16s8:kb
"""

from __future__ import annotations

import sys
import time

import benchlib
import torch
from bench_tail import run
from benchlib import probe

SAVED_BITS = {"base": 0, "sym": 16, "z8": 8, "log8z8": 16, "m16s8": 8}  # bits saved per (scale, minimum) pair


def parse_candidate(name: str) -> dict[str, str]:
    """'FORMAT[:GROUPS]' parts joined by '+' -> {group kind: format}; GROUPS letters of 'vkb', default 'v'."""
    formats: dict[str, str] = {}
    for part in name.split("+"):
        fmt, _, groups = part.partition(":")
        groups = groups or "v"
        if fmt not in SAVED_BITS or set(groups) - set("vkb") or set(groups) & set(formats):
            raise SystemExit(f"--candidates: {name!r} is not FORMAT[:GROUPS] parts joined by '+' (FORMAT one of "
                             f"{', '.join(SAVED_BITS)}, GROUPS letters of 'vkb', each group once; e.g. "
                             "log8z8, log8z8:v+m16s8:kb)")
        formats.update(dict.fromkeys(groups, fmt))
    return formats


def _group_kind(top) -> str:
    """Which of GearConfig()'s groups a `_stored_stats` call is for, by its highest code."""
    if not isinstance(top, int):
        return "k"  # per-channel widths: the key chunks
    return "b" if top == 255 else "v"


def _up(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t (float32) in dtype, rounded toward +inf (a stored scale must cover its range)."""
    s = t.to(dtype)
    return torch.where(s.float() < t, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def _down(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = t.to(dtype)
    return torch.where(s.float() > t, torch.nextafter(s, torch.full_like(s, float("-inf"))), s)


def _log8(scale: torch.Tensor) -> torch.Tensor:
    """scale rounded up to a power of 2^(1/8) (an 8-bit code covers 2^-16 .. 2^16; not clamped here)."""
    return torch.exp2(torch.ceil(torch.log2(scale.clamp_min(2.0**-126)) * 8) / 8)


def candidate_stats(name: str, stored_stats):
    """A replacement for `quant._stored_stats(lo, hi, top, stats_dtype)` giving each group the candidate names its
    format's (minimum, scale); every other group gets the real one. Every format covers [lo, hi] as the real one does."""
    formats = parse_candidate(name)

    def stats(lo: torch.Tensor, hi: torch.Tensor, top, stats_dtype: torch.dtype):
        fmt = formats.get(_group_kind(top), "base")
        if fmt == "base":
            return stored_stats(lo, hi, top, stats_dtype)
        top_f = top.float() if isinstance(top, torch.Tensor) else float(top)
        if fmt == "sym":
            a = torch.maximum(-lo, hi)
            scale = _up(a / (top_f / 2) * (1 + 2.0**-7), stats_dtype)  # headroom for the minimum's rounding
            minimum = _down(-scale.float() * (top_f / 2), stats_dtype)
            return minimum, scale
        if fmt == "m16s8":  # the real minimum; the scale an 8-bit power of 2^(1/8) covering the range from it
            minimum = _down(lo, stats_dtype)
            return minimum, _up(_log8((hi - minimum.float()) / top_f), stats_dtype)
        # zero point z in [0, top] on a grid of top/255 (8 bits): minimum = -z * scale. A range of one sign gets
        # z = 0 (positive) or top (negative) and a scale covering [0, hi] / [lo, 0]: coarse when far from 0
        step = top_f / 255
        width = (hi - lo).clamp_min(1e-30)
        scale = width / (top_f - step)  # so a z rounded up by < one step still covers hi
        scale = torch.where(lo > 0, hi / top_f, torch.where(hi < 0, -lo / top_f, scale))
        if fmt == "log8z8":
            scale = _log8(scale)
        scale = _up(scale, stats_dtype)
        s = scale.float()
        z = torch.ceil(torch.minimum((-lo / s).clamp_min(0), torch.as_tensor(top_f)) / step) * step
        minimum = _down(-z * s, stats_dtype)
        return minimum, scale

    return stats


def main(argv=None) -> int:
    args, names = probe.parse_probe_args(__doc__, ",".join(SAVED_BITS), "probe-value-stats", argv)
    from gear_hf import GearConfig
    from gear_hf.compress import quant

    for n in names:
        parse_candidate(n)
    cond, model, tokenizer = probe.start(
        args, "candidate statistics (values, key chunks, key buffer) chosen inside the oracle's quantize")
    config = GearConfig(backend="torch")  # the oracle compresses (the probe wraps its choice of statistics)
    stored_stats = quant._stored_stats
    rows = []
    for text, ids, reference in probe.texts_with_reference(run, model, tokenizer, args):
        for name in names:
            started = time.perf_counter()
            quant._stored_stats = candidate_stats(name, stored_stats)
            pairs = []  # ({group kind: pairs}, key + value elements held) after each decode step
            try:
                logits, bits = probe.run_enabled(run, model, ids, args.prompt, config, lambda c, report:
                                                 pairs.append((scale_pairs(c), report["elements"])))
            finally:
                quant._stored_stats = stored_stats
            saved = {g: SAVED_BITS[fmt] for g, fmt in parse_candidate(name).items()}
            owned = [b - sum(saved[g] * p[g] for g in saved) / elements for b, (p, elements) in zip(bits, pairs)]
            rows.append(probe.result_row(text, name, name != "base", owned, reference, logits, started))
            print(rows[-1], flush=True)
            benchlib.write_csv(benchlib.Path(args.out) / "probe.csv", rows)
    description = (
        "SmolLM2-135M-Instruct bf16 (d=64), GearConfig(backend='torch'); per text (GSM8K test problem N's 8-shot "
        f"CoT prompt + worked answer, its last {args.prompt + args.steps} tokens): {args.prompt} at prefill, "
        f"{args.steps} teacher-forced one per step. KL(DynamicCache || config) of the next-token distribution. "
        "**Simulated**: every candidate but base picks its groups' stored minimum and scale as it could "
        "represent them (inside the oracle's quantize; groups: v = values, chunks and buffer, k = key chunks, "
        "b = key buffer); its bits are the report's minus the statistics bits it saves per (scale, minimum) pair "
        "the cache allocates for those groups (computed, not held).")
    probe.finish(args, cond, rows, "Probe: cheaper statistics (simulated)", description, "statistics (groups)")
    return 0


def scale_pairs(cache) -> dict[str, int]:
    """{group kind: (scale, minimum) pairs allocated} over layers: the "scale" fields of each layer's stores (v: the
    value stream's chunks and buffer, k: the key stream's chunks, b: its buffer), spare capacity included as the report
    counts it."""
    def scales(store) -> int:
        return store.fields["scale"].numel() if store is not None and "scale" in store.fields else 0

    n = {"v": 0, "k": 0, "b": 0}
    for layer in cache.layers:
        if hasattr(layer, "value_stream"):
            values, keys = layer.value_stream, layer.key_stream
            n["v"] += scales(values.prefill) + scales(values.decode) + scales(values.buffer)
            n["k"] += scales(keys.prefill) + scales(keys.decode)
            n["b"] += scales(keys.buffer)
    return n


if __name__ == "__main__":
    sys.exit(main())
