"""Dataset loaders, answer filters and scoring for the tasks in `eval_tasks/` (referenced from their YAMLs).

Data comes from a local directory laid out like the project's `shared/data/`:

    <data_dir>/gsm8k/test.jsonl
    <data_dir>/aqua/test.json, <data_dir>/aqua/dev.json        (JSON lines)
    <data_dir>/bbh/data/<subtask>.json, <data_dir>/bbh/cot-prompts/<subtask>.txt

given as `--metadata '{"data_dir": ...}'` or the `GEAR_HF_DATA_DIR` environment variable. Without either,
the Hugging Face Hub datasets are used (openai/gsm8k, deepmind/aqua_rat, SaylorTwift/bbh). A data_dir that
is given but lacks a file is an error, never a silent download.

Few-shot exemplars:
* GSM8K: the 8 exemplars of lm-eval's own installed `gsm8k-cot` task, read from its YAML at run time.
* AQuA:  the first 8 usable records of the dev split (rationale cleaned of its free-form final answer line,
         then "The answer is (X)." appended); lm-eval has no generative AQuA task to borrow from.
* BBH:   the 3 standard CoT exemplars of each subtask (`cot-prompts/<subtask>.txt`; without a local copy,
         lm-eval's installed `bbh/cot_fewshot/<subtask>.yaml`, which carries the same prompts).
The loaders return a DatasetDict with a `test` split and a `fewshot` split, so lm-eval's normal few-shot
machinery builds the prompts and `--num_fewshot` keeps working.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from gear_hf import gsm8k
from gear_hf.gsm8k import DATA_DIR_ENV
from gear_hf.lm_eval import answers
from gear_hf.lm_eval.answers import INVALID

AQUA_NUM_SHOTS = 8


# Data directory ------------------------------------------------------------------------------------------------
def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The local data directory: the `data_dir` metadata if given, else $GEAR_HF_DATA_DIR, else None (hub)."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"data_dir {str(chosen)!r} ({path}) is not a directory "
                                f"(from --metadata data_dir or ${DATA_DIR_ENV})")
    return path


def _need(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"expected data file {path} (data_dir layout: gsm8k/test.jsonl, aqua/test.json, "
                                f"aqua/dev.json, bbh/data/<subtask>.json, bbh/cot-prompts/<subtask>.txt)")
    return path


def read_json_records(path: Path) -> list[dict]:
    """A JSON-lines file, or a JSON list / {"examples": [...]} document."""
    text = _need(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(doc, dict) and "examples" in doc:
        return doc["examples"]
    return [doc]


def _dataset_dict(test: list[dict], fewshot: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(test),
                                 "fewshot": datasets.Dataset.from_list(fewshot)})


class DataUnavailable(RuntimeError):
    """No local data directory was given and the Hub dataset could not be loaded (`gear-lm-eval` prints the
    message as one line)."""


def _hub_split(path: str, name: str | None, split: str) -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(path, name, split=split))
    except Exception as err:  # offline, no network, no such dataset: all need the same answer
        cause = str(err).splitlines()[0] if str(err) else ""
        raise DataUnavailable(
            f"no local data directory and the Hugging Face Hub dataset {path!r} could not be loaded "
            f"({type(err).__name__}: {cause}); give the data directory with --metadata '{{\"data_dir\": \"DIR\"}}' "
            f"or {DATA_DIR_ENV}=DIR (layout: DIR/gsm8k/test.jsonl, DIR/aqua/test.json, DIR/aqua/dev.json, "
            "DIR/bbh/data/<subtask>.json)") from err


def _read_task_yaml(path: Path) -> dict:
    """A task YAML of lm-eval's, read as data (`!function` tags kept as strings, no includes resolved)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)


def _lm_eval_task_file(*parts: str) -> Path:
    import lm_eval.tasks

    path = Path(lm_eval.tasks.__file__).parent.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"lm-eval's installed task file {path} is missing (lm-eval version changed?)")
    return path


# GSM8K ---------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def gsm8k_cot_exemplars() -> tuple[dict, ...]:
    """The 8 (question, CoT answer) exemplars of lm-eval's installed `gsm8k-cot` task."""
    cfg = _read_task_yaml(_lm_eval_task_file("gsm8k", "gsm8k-cot.yaml"))
    samples = cfg["fewshot_config"]["samples"]
    return tuple({"question": s["question"], "cot": s["target"]} for s in samples)


def gsm8k_records(data_dir: Path | None) -> list[dict]:
    if data_dir is not None:
        _need(data_dir / "gsm8k" / "test.jsonl")  # a task data_dir has the full layout (not the gsm8k folder)
        rows = gsm8k.load("test", data_dir)
    else:
        rows = _hub_split("openai/gsm8k", "main", "test")
    return [{"question": r["question"], "answer": r["answer"], "gold": answers.gsm8k_gold(r["answer"])}
            for r in rows]


def gsm8k_dataset(data_dir: str | None = None, **_metadata: Any):
    test = gsm8k_records(resolve_data_dir(data_dir))
    fewshot = [{"question": e["question"], "answer": e["cot"], "cot": e["cot"],
                "gold": answers.gsm8k_strict(e["cot"])} for e in gsm8k_cot_exemplars()]
    return _dataset_dict(test, fewshot)


# AQuA ----------------------------------------------------------------------------------------------------------
_OPTION_RE = re.compile(r"^\s*\(?([A-Ea-e])\s*\)\s*(.*)$", re.S)
# A final line that only states the answer ("Answer: C", "Correct answer - A", "ANSWER:E", "D", ...).
_ANSWER_LINE_RE = re.compile(
    r"^\W*(?:(?:the|so|hence|thus|therefore)\s+)?(?:(?:the|correct|right|final)\s+)*"
    r"(?:answer|ans|option|choice)s?\b.*$|^\W*\(?[A-E]\)?\W*$", re.IGNORECASE)
# The same statement at the end of the last line of reasoning ("... x = 250 m. Answer D").
_ANSWER_TAIL_RE = re.compile(
    r"[\s.;,]*(?:(?:the|correct|right|final)\s+)*(?:answer|ans|option)\s*(?:is)?\s*[:\-=]?\s*"
    r"(?:option\s*)?\(?[A-E]\)?\W*$", re.IGNORECASE)


def aqua_choices_text(options: Iterable[str]) -> str:
    parts = []
    for opt in options:
        m = _OPTION_RE.match(str(opt))
        parts.append(f"({m.group(1).upper()}) {m.group(2).strip()}" if m else str(opt).strip())
    return " ".join(parts)


def clean_aqua_rationale(rationale: str) -> str:
    """The reasoning of an AQuA rationale without its free-form closing answer statement."""
    lines = [line.rstrip() for line in str(rationale).strip().splitlines()]
    lines = [line for line in lines if line.strip()]
    while lines and _ANSWER_LINE_RE.match(lines[-1].strip()):
        lines.pop()
    if lines:
        lines[-1] = _ANSWER_TAIL_RE.sub("", lines[-1]).rstrip()
        if not lines[-1].strip():
            lines.pop()
    return "\n".join(lines).strip()


def _aqua_doc(r: dict) -> dict:
    return {"question": str(r["question"]).strip(), "options": list(r["options"]),
            "choices_text": aqua_choices_text(r["options"]), "gold": answers.aqua_gold(r["correct"])}


def aqua_exemplars(rows: list[dict], k: int = AQUA_NUM_SHOTS) -> list[dict]:
    """The first k records with 5 options, a one-line question and a cleaned rationale of 50-500 characters."""
    out = []
    for r in rows:
        cot = clean_aqua_rationale(r.get("rationale", ""))
        if not 50 <= len(cot) <= 500 or len(r.get("options", [])) != 5 or "\n" in str(r["question"]).strip():
            continue
        doc = _aqua_doc(r)
        if doc["gold"] == INVALID:
            continue
        doc["cot"] = f"{cot}\nThe answer is ({doc['gold']})."
        out.append(doc)
        if len(out) == k:
            break
    return out


def aqua_dataset(data_dir: str | None = None, **_metadata: Any):
    root = resolve_data_dir(data_dir)
    if root is not None:
        test_rows = read_json_records(root / "aqua" / "test.json")
        dev_rows = read_json_records(root / "aqua" / "dev.json")
    else:
        test_rows = _hub_split("deepmind/aqua_rat", "raw", "test")
        dev_rows = _hub_split("deepmind/aqua_rat", "raw", "validation")
    test = [dict(_aqua_doc(r), cot="") for r in test_rows]
    return _dataset_dict(test, aqua_exemplars(dev_rows))


# BBH -----------------------------------------------------------------------------------------------------------
def parse_bbh_cot_prompt(text: str) -> tuple[str, list[dict]]:
    """(description, [{"input", "cot"}]) from a standard `cot-prompts/<subtask>.txt` file."""
    text = text.replace("\r\n", "\n")
    if "\n-----\n" in text:  # canary header
        text = text.split("\n-----\n", 1)[1]
    text = text.strip("\n")
    head, *blocks = re.split(r"\n\nQ: ", "\n\n" + text if text.startswith("Q: ") else text)
    description = head.strip()
    exemplars = []
    for block in blocks:
        question, sep, cot = block.partition("\nA: Let's think step by step.")
        if not sep:
            raise ValueError(f"BBH CoT prompt block without \"A: Let's think step by step.\": {block[:80]!r}")
        # keep the separator after "step by step." (a newline, or a space in sports_understanding)
        exemplars.append({"input": question.strip("\n"), "cot": cot.rstrip()})
    return description, exemplars


def _bbh_prompt_from_lm_eval(subtask: str) -> tuple[str, list[dict]]:
    cfg = _read_task_yaml(_lm_eval_task_file("bbh", "cot_fewshot", f"{subtask}.yaml"))
    exemplars = [{"input": s["input"], "cot": "\n" + s["target"].strip()}
                 for s in cfg["fewshot_config"]["samples"]]
    return cfg.get("description", "").strip(), exemplars


def bbh_prompt(subtask: str, data_dir: Path | None) -> tuple[str, list[dict]]:
    if data_dir is not None and (path := data_dir / "bbh" / "cot-prompts" / f"{subtask}.txt").is_file():
        return parse_bbh_cot_prompt(path.read_text(encoding="utf-8"))
    return _bbh_prompt_from_lm_eval(subtask)


def bbh_dataset(data_dir: str | None = None, bbh_subtask: str | None = None, **_metadata: Any):
    if bbh_subtask not in answers.BBH_SUBTASKS:
        raise ValueError(f"bbh_subtask={bbh_subtask!r}; known: {sorted(answers.BBH_SUBTASKS)}")
    root = resolve_data_dir(data_dir)
    if root is not None:
        rows = read_json_records(root / "bbh" / "data" / f"{bbh_subtask}.json")
    else:
        rows = _hub_split("SaylorTwift/bbh", bbh_subtask, "test")
    description, exemplars = bbh_prompt(bbh_subtask, root)
    desc = description + "\n\n" if description else ""

    def doc(inp: str, target: str, cot: str) -> dict:
        return {"input": inp, "target": target, "cot": cot, "subtask": bbh_subtask, "description": desc,
                "gold": answers.bbh_gold(bbh_subtask, target)}

    test = [doc(r["input"], str(r["target"]), "") for r in rows]
    fewshot = [doc(e["input"], answers.bbh_strict(bbh_subtask, e["cot"]), e["cot"]) for e in exemplars]
    return _dataset_dict(test, fewshot)


# Filters and scoring -------------------------------------------------------------------------------------------
EXTRACTORS = {
    "gsm8k_strict": lambda text, doc: answers.gsm8k_strict(text),
    "gsm8k_flexible": lambda text, doc: answers.gsm8k_flexible(text),
    "aqua_strict": lambda text, doc: answers.aqua_strict(text),
    "aqua_flexible": lambda text, doc: answers.aqua_flexible(text),
    "bbh_strict": lambda text, doc: answers.bbh_strict(doc["subtask"], text),
    "bbh_flexible": lambda text, doc: answers.bbh_flexible(doc["subtask"], text),
}

try:
    from lm_eval.api.filter import Filter as _FilterBase
except ImportError:  # pragma: no cover - lm-eval is an optional dependency of gear_hf
    _FilterBase = object


class AnswerFilter(_FilterBase):
    """lm-eval filter: each response -> its canonical extracted answer (`extractor` is a key of EXTRACTORS)."""

    def __init__(self, extractor: str = "gsm8k_flexible", **kwargs: Any) -> None:
        if extractor not in EXTRACTORS:
            raise ValueError(f"extractor={extractor!r}; allowed: {sorted(EXTRACTORS)}")
        self.extract = EXTRACTORS[extractor]

    def apply(self, resps, docs):
        return [[self.extract(r if isinstance(r, str) else "", doc) for r in inst]
                for inst, doc in zip(resps, docs)]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """exact_match of the filtered (canonical) answer against the canonical gold."""
    pred = results[0] if results else INVALID
    if isinstance(pred, list):
        pred = pred[0] if pred else INVALID
    return {"exact_match": float(pred != INVALID and pred == doc["gold"])}
