"""`make demo`: few-shot chain-of-thought math on real weights, every method side by side, one table.

    python -m gear_hf.demo                                   # SmolLM2-135M, the built-in 8-shot one-step problems
    python -m gear_hf.demo --gsm8k                           # SmolLM2-135M, 8-shot GSM8K (../shared/data)
    python -m gear_hf.demo --model qwen25                    # Qwen2.5-0.5B, 8-shot GSM8K (`make weights-qwen`)
    python -m gear_hf.demo --data-dir DIR                    # GSM8K from DIR/gsm8k/{train,test}.jsonl
    python -m gear_hf.demo --methods default,rec-precise,gear-l-4   # rows after the uncompressed baseline
    python -m gear_hf.demo --model /path/model.gguf          # a GGUF file, or a HF model directory

Prompts: SmolLM2's default is the built-in 8-shot one-step problems written for this project (~420 prompt tokens
against ~900 for 8-shot GSM8K). SmolLM2 (135M) solves none of GSM8K's problems (0/3 in a measured run) but 8 of these
10 uncompressed, so its table shows whether a method keeps answers the model gets right (and, as for every model, how
long it agrees with the uncompressed run: matched tokens, same answer). Other models (and --gsm8k) take real GSM8K
test problems, 8-shot chain of thought from the train split, read from --data-dir, else $GEAR_HF_DATA_DIR, else
../shared/data of a source checkout (the built-in problems when none is there). Rows: the stock model, labelled by its
dtype ("float32 (uncompressed)"), then `default` (GearConfig()), then the --methods (default: the recommended
"smallest" and the paper presets). For each: KV bits/element the cache owns at the end of generation
(`memory_report()["bits_per_element"]`: held by tokens, side information, spare capacity and kernel state included;
the dtype's bits for the stock cache), decode tokens/s (after one untimed warm-up generate per method), the seconds
numba spent compiling CPU kernels for it (0 once `python -m gear_hf.warmup` has run: `make venv` runs it), how many
greedy tokens match the uncompressed run before the first difference, whether the final answers agree, and how many
are correct. float32 by default: the dtype a CPU runs
fastest and the one transformers recommends there.
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import sys
from pathlib import Path

import torch

import gear_hf
from gear_hf import gsm8k
from gear_hf.gsm8k import Problem
from gear_hf.lm_eval.answers import gsm8k_flexible
from gear_hf.measure import StepClock, matched_prefix, warm_up
from gear_hf.warmup import CompileWatch
from gear_hf.weights import load_model

BASELINE = "uncompressed"  # the stock model (transformers' DynamicCache), the reference every row is compared with
METHODS = ("default", "smallest", "kivi-2", "gear-2", "kivi-4", "gear-4")
RECOMMENDED_PREFIX = "rec-"  # rec-NAME: GearConfig.recommended(name=NAME), also where NAME is a preset ("rec-gear-4")

# Few-shot chain-of-thought exemplars and questions written for this project (no dataset text): one-step problems,
# since SmolLM2-135M solves none of the two-step ones it was first given (0/6 measured) and 8 of these 10 uncompressed
# (the last two wrong: it subtracts 45 - 15 = 20 and 40 - 25 = 10; float32, 8-shot, greedy). A row then shows
# whether compression keeps answers the model gets right.
EXEMPLARS = [
    ("A farmer has 9 cows and buys 4 more cows. How many cows does he have?",
     "He has 9 + 4 = 13 cows. The answer is 13."),
    ("A shelf has 25 books. 8 books are taken away. How many books are on the shelf?",
     "There are 25 - 8 = 17 books left. The answer is 17."),
    ("A pack has 6 cards. How many cards are in 7 packs?", "There are 6 * 7 = 42 cards. The answer is 42."),
    ("36 cookies are shared equally by 4 children. How many cookies does each child get?",
     "Each child gets 36 / 4 = 9 cookies. The answer is 9."),
    ("A team scores 14 points in the first half and 19 points in the second half. How many points does it score?",
     "It scores 14 + 19 = 33 points. The answer is 33."),
    ("A rope is 50 meters long. A piece of 18 meters is cut off. How long is the rope now?",
     "The rope is 50 - 18 = 32 meters long. The answer is 32."),
    ("A spider has 8 legs. How many legs do 6 spiders have?", "Six spiders have 8 * 6 = 48 legs. The answer is 48."),
    ("A teacher puts 40 chairs into 5 equal rows. How many chairs are in each row?",
     "Each row has 40 / 5 = 8 chairs. The answer is 8."),
]
QUESTIONS = [
    ("Anna has 8 apples. She buys 6 more apples. How many apples does she have?", "14"),
    ("A bag holds 4 balls. How many balls are in 3 bags?", "12"),
    ("A class has 10 boys and 12 girls. How many children are in the class?", "22"),
    ("A box has 3 rows of 8 crayons. How many crayons are in the box?", "24"),
    ("A ticket costs 6 dollars. How much do 9 tickets cost?", "54"),
    ("Sara walks 16 km on Monday and 11 km on Tuesday. How far does she walk in total?", "27"),
    ("A farm has 7 horses and 5 pigs. How many animals are on the farm?", "12"),
    ("A pizza has 8 slices. How many slices are in 4 pizzas?", "32"),
    ("There are 45 students. 15 of them go home. How many students stay?", "30"),
    ("A bus has 40 seats. 25 seats are taken. How many seats are empty?", "15"),
]


def builtin_problems() -> list[Problem]:
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXEMPLARS)
    return [Problem(f"{shots}Question: {q}\nAnswer:", gold) for q, gold in QUESTIONS]


def method_config(name: str) -> gear_hf.GearConfig | None:
    """A --methods name -> GearConfig (None: the stock model). "default" (or "recommended"): GearConfig(); a
    `GearConfig.recommended` name ("smallest", "precise"; also as "rec-NAME"); else a preset name ("fp16", "kivi-2",
    "gear-l-4", "gear-k4v2": GearConfig.preset reads it)."""
    from gear_hf.config import RECOMMENDED

    recommended = [n for n, _, _, _ in RECOMMENDED]
    try:
        if name == BASELINE:
            return None
        if name in ("default", "recommended"):
            return gear_hf.GearConfig()
        if name.startswith(RECOMMENDED_PREFIX):
            return gear_hf.GearConfig.recommended(name=name[len(RECOMMENDED_PREFIX):])
        try:
            return gear_hf.GearConfig.preset(name)
        except ValueError:
            if name in recommended:
                return gear_hf.GearConfig.recommended(name=name)
            raise
    except ValueError as err:
        close = difflib.get_close_matches(name, ["default", *recommended], n=1, cutoff=0.7)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SystemExit(f"--methods: {name!r}: {hint}{err} (or: default, {', '.join(recommended)}, "
                         f"{RECOMMENDED_PREFIX}NAME)") from err


def method_label(name: str, dtype: str) -> str:
    """The table's name of a method: the baseline by its dtype, the default by what it is."""
    if name == BASELINE:
        return f"{dtype} (uncompressed)"
    if name in ("default", "recommended"):
        return "default (GearConfig())"
    return name


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int):
    """Greedy tokens, (decode steps, decode seconds), the cache's memory report (None for stock), prompt tokens."""
    from transformers import LogitsProcessorList

    batch = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    clock = StepClock()
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                         stop_strings=["\nQuestion:"], tokenizer=tokenizer,
                         logits_processor=LogitsProcessorList([clock]))
    cache = gear_hf.last_cache(model) if gear_hf.is_enabled(model) else None
    report = cache.memory_report() if cache is not None else None
    return out[0, batch["input_ids"].shape[1]:].tolist(), clock.decode(), report, batch["input_ids"].shape[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gear-hf-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | qwen25 | a .gguf file | a HF model directory (default: smollm2)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                        help="model dtype (default float32: what a CPU runs fastest)")
    parser.add_argument("--data-dir", help="directory with gsm8k/{train,test}.jsonl (default: "
                                           f"${gsm8k.DATA_DIR_ENV}, else ../shared/data when present)")
    parser.add_argument("--builtin", action="store_true", help="the built-in 8-shot one-step problems instead of GSM8K")
    parser.add_argument("--gsm8k", action="store_true", help="GSM8K even where the model's default is the built-in "
                                                             "problems (smollm2)")
    parser.add_argument("-n", "--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma list, after the uncompressed baseline (default: {','.join(METHODS)}); also "
                             "any GearConfig.recommended name (small, balanced, accurate, precise), rec-NAME, or a "
                             "preset (fp16, gear-l-2, kcvt-4, gear-k4v2, ...)")
    parser.add_argument("--no-warmup", action="store_true", help="time the first generate of each method too "
                                                                 "(kernel compilation included)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts and --max-new-tokens must be >= 1")
    if args.builtin and (args.gsm8k or args.data_dir):
        parser.error("--builtin and --gsm8k/--data-dir exclude each other")
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != BASELINE]
    configs = {BASELINE: None, **{name: method_config(name) for name in methods}}
    problems, args.prompts = choose_problems(args)

    from tqdm.auto import tqdm

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    torch.set_grad_enabled(False)

    results: dict[str, list] = {}
    warmups: dict[str, object] = {}  # name -> measure.WarmUp, or None (--no-warmup)
    timed_compiles: dict[str, CompileWatch] = {}  # what the timed generates compiled (nothing, after a warm-up)
    bar = tqdm(total=len(configs) * len(problems), desc="generating", unit="prompt")
    for name, config in configs.items():
        if config is None:
            if gear_hf.is_enabled(model):
                gear_hf.disable(model)
        else:
            gear_hf.enable(model, config)
        bar.set_postfix_str(name)
        warmups[name] = None if args.no_warmup else warm_up(model, tokenizer(problems[0].prompt, return_tensors="pt")
                                                              ["input_ids"], config, pad_token_id=pad_id(tokenizer))
        results[name] = []
        with CompileWatch() as timed_compiles[name]:
            for problem in problems:
                results[name].append(generate(model, tokenizer, problem.prompt, args.max_new_tokens))
                bar.update()
    if gear_hf.is_enabled(model):
        gear_hf.disable(model)
    bar.close()

    reference = results[BASELINE]
    base_answers = [gsm8k_flexible(tokenizer.decode(tokens)) for tokens, *_ in reference]
    dense_bits = torch.finfo(getattr(torch, args.dtype)).bits
    rows = []
    for name, runs in results.items():
        answers = [gsm8k_flexible(tokenizer.decode(tokens)) for tokens, *_ in runs]
        reports = [r for _, _, r, _ in runs if r]
        config = configs[name]
        rows.append({
            "method": method_label(name, args.dtype),
            "name": name,
            "config": config.describe() if config is not None else f"stock {args.dtype} DynamicCache",
            "bits_per_element": statistics.mean(r["bits_per_element"] for r in reports) if reports else dense_bits,
            "prompt_tokens": statistics.mean(n for _, _, _, n in runs),
            "tokens_per_s": sum(n for _, (n, _), *_ in runs) / max(sum(s for _, (_, s), *_ in runs), 1e-9),
            "warmup_seconds": None if warmups[name] is None else warmups[name].seconds,
            "compile_seconds": (0.0 if warmups[name] is None else warmups[name].compile_seconds)
            + timed_compiles[name].seconds,
            "timed_compile_seconds": timed_compiles[name].seconds,
            "matched_tokens": statistics.mean(matched_prefix(t[0], r[0]) for t, r in zip(runs, reference)),
            "answers_agree": sum(a == b for a, b in zip(answers, base_answers)),
            "correct": sum(a == p.gold for a, p in zip(answers, problems)),
            "n": len(problems),
        })
    print_table(rows, args, model)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def choose_problems(args) -> tuple[list[Problem], str]:
    """The prompts and how to name them. SmolLM2 (135M): the built-in 8-shot one-step problems, which it solves
    uncompressed, unlike GSM8K (`--gsm8k`); other models: GSM8K 8-shot when the data is there, else the built-in
    problems."""
    builtin = args.builtin or (args.model == "smollm2" and not (args.gsm8k or args.data_dir))
    data_dir = None if builtin else (args.data_dir or gsm8k.default_data_dir())
    if data_dir is not None:
        return (gsm8k.problems(data_dir, limit=args.num_prompts),
                f"GSM8K test, 8-shot CoT ({gsm8k.gsm8k_dir(data_dir)})")
    if args.gsm8k:
        raise SystemExit(f"--gsm8k: no GSM8K data found (give --data-dir or ${gsm8k.DATA_DIR_ENV})")
    return builtin_problems()[: args.num_prompts], "built-in 8-shot one-step CoT problems (gear_hf/demo.py)"


def print_table(rows: list[dict], args, model) -> None:
    print(f"\nmodel={args.model} ({model.config.model_type}, {args.dtype}), prompts: {args.prompts}, n={rows[0]['n']}, "
          f"mean prompt tokens={rows[0]['prompt_tokens']:.0f}, max_new_tokens={args.max_new_tokens}, "
          f"torch threads={torch.get_num_threads()}")
    print(f"KV bits/elem: what the cache owns at the end (codes + scales/minimums + low-rank factors + outliers + "
          f"full-precision buffer + spare capacity + kernel state), per key/value element; {rows[0]['method']} = "
          f"{rows[0]['bits_per_element']}")
    if args.no_warmup:
        print("tokens/s: decode steps of every generate, the first included (kernel compilation counted: --no-warmup)")
    else:
        print("tokens/s: decode steps after one untimed warm-up generate per method (steady state)")
    print("compile s: seconds numba spent compiling CPU kernels for that row in this process (0 once "
          "`python -m gear_hf.warmup` or an earlier run compiled them)")
    header = ("method", "config", "KV bits/elem", "tokens/s", "compile s", "matched tokens", "answer = uncompressed",
              "correct")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in rows:
        print(" | ".join([r["method"], r["config"], f"{r['bits_per_element']:.2f}", f"{r['tokens_per_s']:.1f}",
                          f"{r['compile_seconds']:.1f}", f"{r['matched_tokens']:.1f}", f"{r['answers_agree']}/{r['n']}",
                          f"{r['correct']}/{r['n']}"]))
    late = [r for r in rows if r["timed_compile_seconds"] > 0 and r["warmup_seconds"] is not None]
    for r in late:  # (a kernel the warm-up did not reach: its tokens/s include compilation)
        print(f"note: {r['method']}'s timed generates compiled kernels for {r['timed_compile_seconds']:.1f} s after "
              "its warm-up; its tokens/s include them")


if __name__ == "__main__":
    sys.exit(main())
