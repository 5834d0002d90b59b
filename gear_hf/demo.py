"""`make demo`: few-shot chain-of-thought math on real weights, every method side by side, one table.

    python -m gear_hf.demo                                   # SmolLM2-135M, the built-in prompts
    python -m gear_hf.demo --model qwen25                    # Qwen2.5-0.5B (needs `make weights-qwen`)
    python -m gear_hf.demo --data-dir ../shared/data/gsm8k   # real GSM8K test problems (8-shot from train)
    python -m gear_hf.demo --model /path/model.gguf          # a GGUF file, or a HF model directory

For each method: KV bytes and bits/element from `memory_report()` (what the cache holds at the end of
generation), decode tokens/s, how many greedy tokens match the fp16 run before the first difference, and
whether the final answers agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import gear_hf
from gear_hf.lm_eval.answers import gsm8k_flexible

METHODS = ("fp16", "kivi-2", "gear-l-2", "gear-2", "kivi-4", "gear-4")

# Few-shot chain-of-thought exemplars and questions written for this project (no dataset text).
EXEMPLARS = [
    ("A baker makes 24 rolls in the morning and 18 in the afternoon. She sells 30 of them. How many rolls "
     "are left?", "She makes 24 + 18 = 42 rolls. After selling 30 she has 42 - 30 = 12 left. The answer is 12."),
    ("Tom reads 15 pages a day for 6 days, then 20 pages on the seventh day. How many pages does he read in "
     "the week?", "In 6 days he reads 15 * 6 = 90 pages. With the seventh day that is 90 + 20 = 110 pages. "
     "The answer is 110."),
    ("A box holds 8 pencils. A teacher buys 7 boxes and gives away 19 pencils. How many pencils does she "
     "keep?", "She buys 8 * 7 = 56 pencils. She keeps 56 - 19 = 37 pencils. The answer is 37."),
    ("A bike costs $240. Maya has saved $96 and saves $36 more each week. How many weeks until she can buy "
     "it?", "She still needs 240 - 96 = 144 dollars. At 36 a week that takes 144 / 36 = 4 weeks. "
     "The answer is 4."),
]
QUESTIONS = [
    ("A garden has 9 rows of 14 tulips. A storm ruins 27 of them. How many tulips are left?", "99"),
    ("Sam buys 3 shirts at $17 each and a hat for $12. He pays with a $100 bill. How much change does he "
     "get?", "37"),
    ("A train travels 84 km in the first hour and 12 km less each hour after that. How far does it go in "
     "3 hours?", "216"),
    ("Lena has 5 times as many stamps as Omar. Together they have 126 stamps. How many stamps does Omar "
     "have?", "21"),
    ("A tank holds 450 liters. It is filled at 25 liters per minute and drained at 10 liters per minute at "
     "the same time. How many minutes to fill it from empty?", "30"),
    ("Each of 6 classes collects 35 cans on Monday and twice as many on Tuesday. How many cans are "
     "collected in total?", "630"),
]


@dataclass
class Problem:
    prompt: str
    gold: str


def builtin_problems() -> list[Problem]:
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXEMPLARS)
    return [Problem(f"{shots}Question: {q}\nAnswer:", gold) for q, gold in QUESTIONS]


def gsm8k_problems(data_dir: str | None, hub: bool, shots: int = 8) -> list[Problem]:
    """Real GSM8K test problems, with the first `shots` train problems as chain-of-thought exemplars."""
    if data_dir:
        root = Path(data_dir)
        if (root / "gsm8k").is_dir():
            root = root / "gsm8k"
        read = lambda split: [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()
                              if line.strip()]
        train, test = read("train"), read("test")
    elif hub:
        try:
            from datasets import load_dataset
        except ImportError as err:
            raise SystemExit("--dataset gsm8k needs the `datasets` package (pip install datasets)") from err
        data = load_dataset("openai/gsm8k", "main")
        train, test = list(data["train"]), list(data["test"])
    else:
        return builtin_problems()

    def worked(answer: str) -> str:
        reasoning, final = answer.split("####")
        return f"{reasoning.strip()} The answer is {final.strip()}."

    prefix = "".join(f"Question: {r['question']}\nAnswer: {worked(r['answer'])}\n\n" for r in train[:shots])
    return [Problem(f"{prefix}Question: {r['question']}\nAnswer:", r["answer"].split("####")[1].strip())
            for r in test]


def method_config(name: str) -> gear_hf.GearConfig:
    """'fp16', 'kivi-2', 'gear-l-4', ... -> GearConfig (bits after the last dash)."""
    if name == "fp16":
        return gear_hf.GearConfig.preset("fp16")
    method, _, bits = name.rpartition("-")
    if not method or not bits.isdigit():
        raise SystemExit(f"--methods: {name!r} is not fp16 or METHOD-BITS (e.g. gear-2, kivi-4)")
    try:
        return gear_hf.GearConfig.preset(method, bits=int(bits))
    except ValueError as err:
        raise SystemExit(f"--methods: {err}") from err


def load_model(spec: str, dtype: torch.dtype):
    from gear_hf.weights import load_gguf_model

    path = Path(spec)
    if path.is_dir() and not any(path.glob("*.gguf")):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return model, AutoTokenizer.from_pretrained(path)
    return load_gguf_model(spec, dtype=dtype)


def matched_prefix(a: list[int], b: list[int]) -> int:
    """Greedy tokens identical before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StepClock:
    """A logits processor that only notes when each step's logits arrive (the first right after prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def decode(self) -> tuple[int, float]:
        """(decode steps, their seconds): everything after the prefill step."""
        return len(self.times) - 1, (self.times[-1] - self.times[0]) if len(self.times) > 1 else 0.0

    def step_seconds(self) -> list[float]:
        """Duration of each decode step (between consecutive logits)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int):
    """Greedy tokens, (decode steps, decode seconds), and the cache's memory report (None for stock)."""
    from transformers import LogitsProcessorList

    batch = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    clock = StepClock()
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                         stop_strings=["\nQuestion:"], tokenizer=tokenizer,
                         logits_processor=LogitsProcessorList([clock]))
    cache = gear_hf.last_cache(model) if gear_hf.is_enabled(model) else None
    return out[0, batch["input_ids"].shape[1]:].tolist(), clock.decode(), cache.memory_report() if cache else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gear-hf-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | qwen25 | a .gguf file | a HF model directory (default: smollm2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--data-dir", help="a directory with gsm8k/{train,test}.jsonl: real GSM8K problems")
    parser.add_argument("--dataset", choices=["builtin", "gsm8k"], default="builtin",
                        help="gsm8k: the hub dataset openai/gsm8k (needs internet and `datasets`)")
    parser.add_argument("-n", "--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list (default: {','.join(METHODS)})")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts and --max-new-tokens must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    configs = {name: method_config(name) for name in methods}
    if "fp16" not in configs:
        configs = {"fp16": method_config("fp16"), **configs}

    from tqdm.auto import tqdm

    problems = gsm8k_problems(args.data_dir, args.dataset == "gsm8k")[: args.num_prompts]
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    torch.set_grad_enabled(False)

    results: dict[str, list] = {}
    bar = tqdm(total=len(configs) * len(problems), desc="generating", unit="prompt")
    for name, config in configs.items():
        gear_hf.enable(model, config)
        bar.set_postfix_str(name)
        results[name] = []
        for problem in problems:
            results[name].append(generate(model, tokenizer, problem.prompt, args.max_new_tokens))
            bar.update()
    gear_hf.disable(model)
    bar.close()

    reference = results["fp16"]
    rows = []
    for name, runs in results.items():
        answers = [gsm8k_flexible(tokenizer.decode(tokens)) for tokens, _, _ in runs]
        fp16_answers = [gsm8k_flexible(tokenizer.decode(tokens)) for tokens, _, _ in reference]
        reports = [r for _, _, r in runs if r]
        rows.append({
            "method": name,
            "kv_bytes": statistics.mean(r["total_bytes"] for r in reports) if reports else None,
            "bits_per_element": statistics.mean(r["bits_per_element"] for r in reports) if reports else None,
            "tokens_per_s": sum(n for _, (n, _), _ in runs) / max(sum(s for _, (_, s), _ in runs), 1e-9),
            "matched_tokens": statistics.mean(matched_prefix(t, r[0]) for (t, _, _), r in zip(runs, reference)),
            "answers_agree": sum(a == b for a, b in zip(answers, fp16_answers)),
            "correct": sum(a == p.gold for a, p in zip(answers, problems)),
            "n": len(problems),
        })
    print_table(rows, args, model)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def print_table(rows: list[dict], args, model) -> None:
    print(f"\nmodel={args.model} ({model.config.model_type}, {args.dtype}), prompts={rows[0]['n']}, "
          f"max_new_tokens={args.max_new_tokens}, torch threads={torch.get_num_threads()}")
    header = ("method", "KV bytes", "bits/elem", "decode tok/s", "matched tokens", "answer = fp16", "correct")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in rows:
        kv = f"{r['kv_bytes'] / 1e6:.2f} MB" if r["kv_bytes"] is not None else "-"
        bits = f"{r['bits_per_element']:.2f}" if r["bits_per_element"] is not None else "-"
        print(" | ".join([r["method"], kv, bits, f"{r['tokens_per_s']:.1f}", f"{r['matched_tokens']:.1f}",
                          f"{r['answers_agree']}/{r['n']}", f"{r['correct']}/{r['n']}"]))


if __name__ == "__main__":
    sys.exit(main())
