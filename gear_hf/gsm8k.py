"""GSM8K from a local data directory: the one loader of the demo, the diagnostics, the lm-eval task and the
benchmark scripts (no dataset text is stored in the repository; it is read at run time).

A data directory holds `gsm8k/{train,test}.jsonl` (the layout of the project's `shared/data/`); the GSM8K folder
itself is accepted too. `default_data_dir()`: $GEAR_HF_DATA_DIR, else `../shared/data` next to a source checkout.
Prompts are few-shot chain of thought: the first `shots` train problems with their worked answers, then the
question, in the "Question: ...\\nAnswer:" format the demo and the benchmarks share.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .lm_eval.answers import gsm8k_gold

DATA_DIR_ENV = "GEAR_HF_DATA_DIR"
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # a source checkout's ../shared/data


@dataclass
class Problem:
    prompt: str  # few-shot prompt ending with "Answer:"
    gold: str  # canonical final answer (gear_hf.lm_eval.answers.gsm8k_gold)


def default_data_dir() -> Path | None:
    """$GEAR_HF_DATA_DIR, else ../shared/data of a source checkout when it holds GSM8K, else None."""
    chosen = os.environ.get(DATA_DIR_ENV)
    if chosen:
        return Path(chosen).expanduser()
    return SHARED_DATA if (SHARED_DATA / "gsm8k" / "test.jsonl").is_file() else None


def gsm8k_dir(data_dir: str | os.PathLike) -> Path:
    """The folder holding {train,test}.jsonl: DATA_DIR/gsm8k, or DATA_DIR itself."""
    root = Path(data_dir).expanduser()
    return root / "gsm8k" if (root / "gsm8k").is_dir() else root


def load(split: str, data_dir: str | os.PathLike) -> list[dict]:
    """The records of `split` ("train" | "test"): {"question", "answer"} with the worked answer ending '#### N'."""
    path = gsm8k_dir(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K {split} split not found: {path} (a data directory holds "
                                f"gsm8k/{{train,test}}.jsonl; give it with --data-dir or ${DATA_DIR_ENV})")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def worked_answer(answer: str) -> str:
    """'reasoning #### 42' -> 'reasoning The answer is 42.' (the CoT target format of the prompts)."""
    reasoning, _, final = answer.rpartition("####")
    return f"{reasoning.strip()} The answer is {final.strip()}."


def few_shot_prefix(train: list[dict], shots: int) -> str:
    return "".join(f"Question: {r['question']}\nAnswer: {worked_answer(r['answer'])}\n\n" for r in train[:shots])


def problems(data_dir: str | os.PathLike, shots: int = 8, limit: int | None = None) -> list[Problem]:
    """The first `limit` test problems as `shots`-shot chain-of-thought prompts with their gold answers."""
    prefix = few_shot_prefix(load("train", data_dir), shots)
    test = load("test", data_dir)[:limit]
    return [Problem(f"{prefix}Question: {r['question']}\nAnswer:", gsm8k_gold(r["answer"])) for r in test]


def solved_text(data_dir: str | os.PathLike, index: int = 0, shots: int = 8) -> str:
    """Test problem `index` as a few-shot prompt followed by its own worked answer (a realistic CoT text whose
    continuation is known: what teacher-forced measurements feed)."""
    record = load("test", data_dir)[index]
    prefix = few_shot_prefix(load("train", data_dir), shots)
    return f"{prefix}Question: {record['question']}\nAnswer: {worked_answer(record['answer'])}\n\n"


def train_text(min_chars: int, data_dir: str | os.PathLike) -> str:
    """At least `min_chars` of natural text: train problems with their worked answers, concatenated."""
    parts, size = [], 0
    for r in load("train", data_dir):
        parts.append(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n")
        size += len(parts[-1])
        if size >= min_chars:
            break
    return "".join(parts)
