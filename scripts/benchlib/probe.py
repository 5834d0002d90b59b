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


def parse_probe_args(doc: str, candidates: str, name: str, argv=None):
    """(args, candidate names) of a probe script: the text arguments, --candidates (a comma list, default
    `candidates`) and --out (default out/<name>); doc: the script's docstring (its first paragraph describes it)."""
    import argparse

    import benchlib

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_text_arguments(parser)
    parser.add_argument("--candidates", default=candidates)
    benchlib.add_out_argument(parser, "probe.csv/.md")
    args = benchlib.parse_bench_args(parser, argv, name)
    return args, [n.strip() for n in args.candidates.split(",") if n.strip()]


def start(args, simulated: str):
    """(conditions, model, tokenizer) of a probe run: its conditions printed (with what it simulates), gradients off,
    the model loaded in bf16."""
    import benchlib

    cond = benchlib.Conditions(extra={"model": args.model, "dtype": "bfloat16", "texts": args.texts,
                                      "prompt": args.prompt, "steps": args.steps, "simulated": simulated})
    benchlib.print_conditions(cond)
    torch.set_grad_enabled(False)
    return (cond, *benchlib.load_model(args.model, "bfloat16"))


def finish(args, cond, rows: list[dict], title: str, description: str, candidate_header: str,
           simulated_column: bool = False) -> None:
    """Write <out>/probe.md: the conditions, `description` and one table row per (text, candidate); print it."""
    import benchlib

    cond.finish()
    columns = [("text", "text", "{}"), ("candidate", candidate_header, "{}")]
    columns += [("simulated", "simulated", "{}")] if simulated_column else []
    columns += [("mean_owned", "mean owned", "{:.3f}"), ("max_owned", "max owned", "{:.3f}"),
                ("mean_kl", "mean KL", "{:.4f}"), ("max_kl", "max KL", "{:.3f}"), ("top1_agreement", "top-1", "{:.3f}")]
    path = benchlib.Path(args.out) / "probe.md"
    benchlib.write_summary(path, title, cond, description + "\n\n" + benchlib.markdown_table(rows, columns))
    print(path.read_text())


def texts_with_reference(run, model, tokenizer, args):
    """(text, ids [1, prompt + steps], the stock cache's next-token logits [steps, V]) for each of args.texts: GSM8K
    test problem N's 8-shot CoT prompt + worked answer, its last prompt + steps tokens."""
    from transformers import DynamicCache

    from .data import gsm8k_text

    for text in args.texts:
        ids = tokenizer(gsm8k_text(text), return_tensors="pt").input_ids[:, -(args.prompt + args.steps):]
        yield text, ids, run(model, ids, args.prompt, DynamicCache(config=model.config))[0]


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


def run_enabled(run, model, ids: torch.Tensor, prompt: int, config, note):
    """`run(model, ids, prompt, cache, note=note)` (bench_tail.run) through a fresh GearCache of `config`, the model
    enabled for it while it runs."""
    import gear_hf

    gear_hf.enable(model, config)
    try:
        return run(model, ids, prompt, gear_hf.GearCache(model, config), note=note)
    finally:
        gear_hf.disable(model)
