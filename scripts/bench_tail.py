"""Bits/element a cache owns at every decode step and next-token KL vs the stock cache, teacher-forced on real
weights after a long prompt, for GearConfig() and named variants side by side with kivi-4. Writes <out>/tail.csv,
tail.md and tail.conditions.json (--out, default out/, untracked); scripts/tail_texts.py compares many texts.

    python scripts/bench_tail.py                       # SmolLM2 bf16, GSM8K text 200, 1024-token prompt, 96 steps
    python scripts/bench_tail.py --configs default,values-final

Each text is an 8-shot GSM8K CoT prompt plus its worked answer; its last --prompt + --steps tokens are used, the
first --prompt at prefill, the rest teacher-forced one token per step through each config's real cache (as generate
fills it). After every decode step `memory_report()["bits_per_element"]` (owned: held + spare + kernel state +
workspaces) is read; reported: its mean and max over the steps, KL(DynamicCache || config) of the next-token
distribution (mean, max) and top-1 agreement.
"""

from __future__ import annotations

import argparse
import sys
import time

import benchlib
import torch

# name -> GearConfig fields over config version 4's GearConfig() ("accurate": k3.125v3, keys query-allocated, values
# rotated per token, groups of 128, prompt groups of 256, 4 sinks, a 128-token buffer); None: a paper preset
_B64 = dict(buffer_size=64, key_group_size=64)  # a 64-token buffer (its decode chunks need 64-token key groups)
_VC3 = dict(value_bits=3, value_axis="channel", range_search="values", key_bits=3)  # "balanced" with 3-bit values
CONFIGS = {
    "full": dict(key_buffer="full", value_buffer="full"),  # the paper's buffer (GearConfig() of config version 1)
    "values-final": dict(key_buffer="full", value_buffer="final"),
    "keys-int8": dict(key_buffer="int8", value_buffer="full"),
    "keys-int8+values-final": dict(key_buffer="int8", value_buffer="final"),
    "keys-int8+values-int8": dict(key_buffer="int8", value_buffer="int8"),
    "keys-int8+values-int4": dict(key_buffer="int8", value_buffer="int4"),
    "keys-int4+values-int4": dict(key_buffer="int4", value_buffer="int4"),
    "b64+keys-int8+values-int8": dict(_B64, key_buffer="int8", value_buffer="int8"),
    "b64+keys-int8+values-int4": dict(_B64, key_buffer="int8", value_buffer="int4"),
    "b64+keys-int4+values-int4": dict(_B64, key_buffer="int4", value_buffer="int4"),
    "vc3+keys-int4+values-int4": dict(_VC3, key_buffer="int4", value_buffer="int4"),
    "vc3+keys-int8+values-int4": dict(_VC3, key_buffer="int8", value_buffer="int4"),
    "vc3g64+b64+keys-int8+values-int4": dict(_VC3, **_B64, value_group_size=64, key_buffer="int8", value_buffer="int4"),
    "vc3g64+b64+keys-int8+values-int8": dict(_VC3, **_B64, value_group_size=64, key_buffer="int8", value_buffer="int8"),
    "vc3k2.875+keys-int8+values-int4": dict(_VC3, key_bits=2.875, key_buffer="int8", value_buffer="int4"),
    "vc3s1+keys-int8+values-int4": dict(_VC3, sink_tokens=1, key_buffer="int8", value_buffer="int4"),
    "default": {},  # today's GearConfig() (config version 10: "centered-chunks"; 9: "centered-kv"; 8: "centered")
    "accurate": {},  # config version 4's GearConfig()
    "value-stats8": dict(key_buffer="int8", value_buffer="int4", value_statistics="8"),  # GearConfig()'s, 8-bit stats
    # keys flushing every 64 tokens, values one chunk later (value_buffer_size: 64..128 values buffered at 4 bits)
    "k64v128": dict(_B64, value_buffer_size=128, key_buffer="int8", value_buffer="int4"),
    "k64v128+stats8": dict(_B64, value_buffer_size=128, key_buffer="int8", value_buffer="int4", value_statistics="8"),
    # the same with rotated 8-bit keys in the buffer: recommended(name="steady")
    "steady": dict(_B64, value_buffer_size=128, key_buffer="int8-rotated", value_buffer="int4", value_statistics="8"),
    "default-int8-keys": dict(key_buffer="int8", value_buffer="int4"),  # GearConfig() of config versions 2-3
    "kivi-4": None,
}
# Where Qwen2.5's KL goes: "steady" with one field changed ("s+..." names)
_STEADY = CONFIGS["steady"]
_HELD = dict(value_buffer_size=128)
# shorter buffers with both streams held a chunk longer (key groups follow the buffer)
_B32_HELD = dict(buffer_size=32, key_group_size=32, value_buffer_size=64, key_buffer_size=64)
_B48_HELD = dict(buffer_size=48, key_group_size=48, value_buffer_size=96, key_buffer_size=96)
ABLATIONS = {
    "s+kbuf16": dict(key_buffer="full"),  # 16-bit keys in the buffer (values still held at 4 bits)
    "s+vbuf8r": dict(value_buffer="int8-rotated"),  # the held values at 8 bits (rotated)
    "s+vbuf8": dict(value_buffer="int8"),  # the held values at 8 bits (unrotated)
    "s+kbuf16+vbuf8r": dict(key_buffer="full", value_buffer="int8-rotated"),  # both buffers near-exact
    "s+bufs16": dict(key_buffer="full", value_buffer="full", value_buffer_size=None),  # 16-bit buffers, none held
    "s+k8": dict(key_bits=8),  # keys' history near-exact (isolates the values' history)
    "s+v8": dict(value_bits=8),  # values' history near-exact (isolates the keys' history)
    "s+k4": dict(key_bits=4),
    "s+k3.5": dict(key_bits=3.5),
    "s+k2.75": dict(key_bits=2.75),  # a cheaper key history (to pay for recent keys)
    "s+k3": dict(key_bits=3),  # (with the newest key chunk a bit wider)
    # keys held a chunk longer too (key_buffer_size: the newest 64..127 keys at 8 bits, rotated), paid for
    # by narrower keys in the chunks
    "s+kh": dict(key_buffer_size=128),
    "s+kh+k3": dict(key_buffer_size=128, key_bits=3),
    "s+kh+k2.875": dict(key_buffer_size=128, key_bits=2.875),
    "s+kh+k2.75": dict(key_buffer_size=128, key_bits=2.75),
    "s+kh+k2.5": dict(key_buffer_size=128, key_bits=2.5),
    "s+kh+vbuf8r": dict(key_buffer_size=128, value_buffer="int8-rotated"),  # both held chunks at 8 bits
    "s+kh+vbuf8r+k2.75": dict(key_buffer_size=128, value_buffer="int8-rotated", key_bits=2.75),
    "s+kh+vbuf8r+k2.5": dict(key_buffer_size=128, value_buffer="int8-rotated", key_bits=2.5),
    "b32+kh+vbuf8r": dict(_B32_HELD, value_buffer="int8-rotated"),
    "b48+kh": _B48_HELD,
    "b48+kh+k3": dict(_B48_HELD, key_bits=3),
    "b48+kh+k2.875": dict(_B48_HELD, key_bits=2.875),
    "b48+kh+vbuf8r+k2.75": dict(_B48_HELD, value_buffer="int8-rotated", key_bits=2.75),
    "b48+kh+vbuf8r+k2.5": dict(_B48_HELD, value_buffer="int8-rotated", key_bits=2.5),
    "b32+kh": _B32_HELD,
    "b32+kh+vbuf8r+k2.75": dict(_B32_HELD, value_buffer="int8-rotated", key_bits=2.75),
    "s+v4": dict(value_bits=4),
    "s+stats16": dict(value_statistics="16"),
    "s+sinks0": dict(sink_tokens=0),
    "s+sinks16": dict(sink_tokens=16),
    "s+kg32": dict(key_group_size=32),
    "s+pg128": dict(prompt_group_size=128),
    "s+pg64": dict(prompt_group_size=None),
    "s+vg32": dict(value_group_size=32),
    "s+gear-l": dict(method="gear-l"),
    "s+norot": dict(rotation="none"),
    "s+pg512": dict(prompt_group_size=512),
    # a 32-token key buffer (32-token key groups in decode chunks), values held 32..63 tokens
    "b32": dict(buffer_size=32, key_group_size=32, value_buffer_size=64),
    "b32+kbuf16": dict(buffer_size=32, key_group_size=32, value_buffer_size=64, key_buffer="full"),
    "b32+vbuf8r": dict(buffer_size=32, key_group_size=32, value_buffer_size=64, value_buffer="int8-rotated"),
    "b32+kbuf16+vbuf8r": dict(buffer_size=32, key_group_size=32, value_buffer_size=64, key_buffer="full",
                              value_buffer="int8-rotated"),
    "b32+stats16": dict(buffer_size=32, key_group_size=32, value_buffer_size=64, value_statistics="16"),
    "b32+sinks0": dict(buffer_size=32, key_group_size=32, value_buffer_size=64, sink_tokens=0),
    "b32+sinks0+stats16": dict(buffer_size=32, key_group_size=32, value_buffer_size=64, sink_tokens=0,
                               value_statistics="16"),
    # both held chunks released early ("eN": held_for (N - 64) / 64, at most N - 1 tokens buffered, not
    # 127), paid back in wider keys; e96+k3 = GearConfig() of config version 7 ("held-early")
    "e112+k2.875": dict(key_buffer_size=128, held_for=0.75, key_bits=2.875),
    "e96+k2.875": dict(key_buffer_size=128, held_for=0.5, key_bits=2.875),
    "e96+k3": dict(key_buffer_size=128, held_for=0.5, key_bits=3),
    # the key buffer centered and scaled per channel (key_buffer_centered)
    "e96+k3+c": dict(key_buffer_size=128, held_for=0.5, key_bits=3, key_buffer_centered=True),
    "e96+k2.875+c": dict(key_buffer_size=128, held_for=0.5, key_bits=2.875, key_buffer_centered=True),
    # the value buffer centered too (value_buffer_centered; = config version 9's GearConfig())
    "e96+k3+cv": dict(key_buffer_size=128, held_for=0.5, key_bits=3, key_buffer_centered=True,
                      value_buffer_centered=True),
}
# the two buffers' widths traded ("cv+..." names: "e96+k3+cv" with the fields named changed)
_CV = ABLATIONS["e96+k3+cv"]
ABLATIONS.update({
    "cv+kbuf4+vbuf8r": dict(_CV, key_buffer="int4", value_buffer="int8-rotated"),  # same bytes as "e96+k3+cv"
    # the value chunks coded by the value buffer's centers too (value_chunks_centered; = config version 10's GearConfig())
    "e96+k3+cvc": dict(_CV, value_chunks_centered=True),
})
for _name, _fields in ABLATIONS.items():
    CONFIGS[_name] = {**_STEADY, **_fields}


def config_of(name: str):
    from gear_hf import GearConfig

    fields = CONFIGS[name]
    if fields is None:
        return GearConfig.preset(name)
    if name == "default":
        return GearConfig()
    if name == "accurate":
        return GearConfig.from_dict({"gear_config_version": 4})
    return GearConfig.from_dict({"gear_config_version": 4, **fields})


def teacher_forced(model_name: str, dtype: str, text: int, prompt: int, steps: int):
    """What every run on one text shares: (model, ids [1, prompt + steps]: the text's last tokens, reference: the
    next-token logits [steps, V] of DynamicCache, teacher forced as `run` does). Turns autograd off."""
    from transformers import DynamicCache

    torch.set_grad_enabled(False)
    model, tokenizer = benchlib.load_model(model_name, dtype)
    ids = tokenizer(benchlib.gsm8k_text(text), return_tensors="pt").input_ids[:, -(prompt + steps):]
    reference, _ = run(model, ids, prompt, DynamicCache(config=model.config))
    return model, ids, reference


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """How a run's next-token logits [steps, V] agree with the reference's: mean and max KL(reference || run), and the
    share of positions whose top-1 token is the reference's."""
    from gear_hf import diagnostics as D

    kl = D.kl_divergence(reference, logits)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "top1_agreement": (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()}


def run(model, ids: torch.Tensor, prompt: int, cache, note=None) -> tuple[torch.Tensor, list[float]]:
    """Next-token logits [steps, V] predicting ids[prompt:], and the owned bits after each decode step.
    note: called after each decode step as note(cache, its memory report) (probes read the stores there)."""
    from gear_hf.hf_compat import model_cache_kwarg

    name = model_cache_kwarg(model)
    logits, bits = [model(input_ids=ids[:, :prompt], **{name: cache}).logits[0, -1:]], []
    for t in range(prompt, ids.shape[1] - 1):
        logits.append(model(input_ids=ids[:, t : t + 1], **{name: cache}).logits[0])
        if hasattr(cache, "memory_report"):
            report = cache.memory_report()
            bits.append(report["bits_per_element"])
            if note is not None:
                note(cache, report)
    return torch.cat(logits).float(), bits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", type=int, default=200, help="GSM8K test problem index")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    benchlib.add_out_argument(parser, "tail.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, "tail")
    import gear_hf

    names = benchlib.config_names(args.configs, CONFIGS)
    cond = benchlib.Conditions(extra={"model": args.model, "dtype": args.dtype, "text": args.text,
                                      "prompt": args.prompt, "steps": args.steps})
    benchlib.print_conditions(cond)
    started = time.perf_counter()
    model, ids, reference = teacher_forced(args.model, args.dtype, args.text, args.prompt, args.steps)
    print(f"stock (and loading): {time.perf_counter() - started:.0f}s", flush=True)
    rows = []
    for name in names:
        started = time.perf_counter()
        config = config_of(name)
        gear_hf.enable(model, config)
        cache = gear_hf.GearCache(model, config)
        logits, bits = run(model, ids, args.prompt, cache)
        if gear_hf.is_enabled(model):
            gear_hf.disable(model)
        rows.append({"config": name, "describe": config.describe(), "key_buffer": config.key_buffer,
                     "value_buffer": config.value_buffer, "buffer_size": config.buffer_size,
                     "mean_owned": sum(bits) / len(bits), "max_owned": max(bits), "min_owned": min(bits),
                     **agreement(reference, logits), "paths": dict(cache.step_paths),
                     "seconds": round(time.perf_counter() - started)})
        print(rows[-1], flush=True)
        benchlib.write_csv(benchlib.Path(args.out) / "tail.csv", rows)
    cond.finish()
    body = [f"{args.model} {args.dtype}, GSM8K test text {args.text} (8-shot CoT prompt + worked answer), its last "
            f"{args.prompt + args.steps} tokens: {args.prompt} at prefill, then {args.steps} teacher-forced one per "
            "step. Bits owned (memory_report()['bits_per_element']) after each decode step, T = "
            f"{args.prompt + 1}..{args.prompt + args.steps}; KL(DynamicCache || config) of the next-token "
            f"distribution over the {args.steps} predicted positions (the first at prefill).",
            benchlib.markdown_table(rows, [
                ("config", "config", "{}"), ("key_buffer", "key buffer", "{}"),
                ("value_buffer", "value buffer", "{}"), ("mean_owned", "mean owned", "{:.3f}"),
                ("max_owned", "max owned", "{:.3f}"), ("min_owned", "min owned", "{:.3f}"),
                ("mean_kl", "mean KL", "{:.4f}"), ("max_kl", "max KL", "{:.3f}"),
                ("top1_agreement", "top-1", "{:.3f}")])]
    benchlib.write_summary(benchlib.Path(args.out) / "tail.md", "Buffer formats: bits owned per step and KL", cond,
                           "\n\n".join(body))
    print((benchlib.Path(args.out) / "tail.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
