"""The eval_tasks/ YAMLs build their prompts from the local data directory (../shared/data) with the right
number of shots, in the standard formats, and the few-shot exemplars come from where they should."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from gear_hf.lm_eval import answers as A  # noqa: E402
from gear_hf.lm_eval import task_utils as tu  # noqa: E402
from gear_hf.lm_eval.cli import task_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """The project's offline data: $GEAR_HF_DATA_DIR, else ../shared/data next to the repository."""
    path = Path(os.environ.get(tu.DATA_DIR_ENV) or REPO.parent / "shared" / "data")
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"no offline data at {path} (set ${tu.DATA_DIR_ENV})")
    return path


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return shared_data_dir()


@pytest.fixture(scope="module")
def tasks(data_dir):
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(task_dir()), metadata={"data_dir": str(data_dir)})
    names = ["gsm8k_cot_gear", "aqua_cot_gear", "bbh_cot_gear_boolean_expressions",
             "bbh_cot_gear_date_understanding", "bbh_cot_gear_sports_understanding", "bbh_cot_gear_word_sorting"]
    if hasattr(tm, "load"):  # lm-eval >= 0.4.12
        return tm, tm.load(names)["tasks"]
    return tm, tm.load_task_or_group(names)


def _prompt(task, i=0, shots=None):
    doc = task.test_docs()[i]
    return doc, task.fewshot_context(doc, task.config.num_fewshot if shots is None else shots)


def test_all_tasks_and_group_are_indexed(tasks):
    tm, _ = tasks
    names = set(tm.all_tasks)
    assert {"gsm8k_cot_gear", "aqua_cot_gear", "bbh_cot_gear"} <= names
    subtasks = {n for n in names if n.startswith("bbh_cot_gear_")}
    assert subtasks == {f"bbh_cot_gear_{s}" for s in A.BBH_SUBTASKS}


def test_gsm8k_prompt_8_shots_from_lm_eval(tasks, data_dir):
    _, loaded = tasks
    task = loaded["gsm8k_cot_gear"]
    assert len(task.test_docs()) == 1319
    doc, ctx = _prompt(task)
    assert ctx.count("Q: ") == 9 and ctx.count("\nA:") == 9       # 8 exemplars + the question
    assert ctx.endswith(f"Q: {doc['question']}\nA:")
    exemplars = tu.gsm8k_cot_exemplars()
    assert len(exemplars) == 8
    for ex in exemplars:  # lm-eval's installed gsm8k-cot exemplars, verbatim
        assert f"Q: {ex['question']}\nA: {ex['cot']}\n\n" in ctx
    assert doc["gold"] == A.gsm8k_gold(doc["answer"])
    gk = task.config.generation_kwargs
    assert gk["max_gen_toks"] == 256 and gk["do_sample"] is False
    assert task.config.num_fewshot == 8


def test_gsm8k_num_fewshot_override(tasks):
    _, loaded = tasks
    _, ctx = _prompt(loaded["gsm8k_cot_gear"], shots=2)
    assert ctx.count("Q: ") == 3


def test_aqua_prompt_8_shots_with_options(tasks):
    _, loaded = tasks
    task = loaded["aqua_cot_gear"]
    assert len(task.test_docs()) == 254
    doc, ctx = _prompt(task)
    assert ctx.count("Q: ") == 9
    assert ctx.count("Answer Choices: (A) ") == 9
    assert ctx.count("The answer is (") == 8
    assert ctx.endswith(f"Q: {doc['question']}\nAnswer Choices: {doc['choices_text']}\nA:")
    assert doc["gold"] in "ABCDE" and len(doc["gold"]) == 1
    for shot in task.fewshot_docs():
        assert shot["cot"].endswith(f"The answer is ({shot['gold']}).")
        # the dataset's own closing line ("Answer: C", "Correct answer - A") is gone
        assert shot["cot"].count("\n") >= 1 and "answer -" not in shot["cot"].lower()


@pytest.mark.parametrize("subtask", ["boolean_expressions", "date_understanding", "sports_understanding",
                                     "word_sorting"])
def test_bbh_prompt_3_shots_standard_format(tasks, data_dir, subtask):
    _, loaded = tasks
    task = loaded[f"bbh_cot_gear_{subtask}"]
    doc, ctx = _prompt(task)
    text = (data_dir / "bbh" / "cot-prompts" / f"{subtask}.txt").read_text()
    description, exemplars = tu.parse_bbh_cot_prompt(text)
    assert len(exemplars) == 3
    # exactly the standard prompt: description, 3 exemplars, then the question
    expected = description + "\n\n" + "\n\n".join(
        f"Q: {e['input']}\nA: Let's think step by step.{e['cot']}" for e in exemplars)
    assert ctx == expected + f"\n\nQ: {doc['input']}\nA: Let's think step by step."
    assert ctx.count("A: Let's think step by step.") == 4
    assert "\nQ:" in task.config.generation_kwargs["until"] and "Q" not in task.config.generation_kwargs["until"]


def test_bbh_prompts_match_lm_eval_copies(data_dir):
    """The local cot-prompts parse to the same exemplars lm-eval ships in its bbh/cot_fewshot YAMLs (the
    hub-free fallback), for all 27 subtasks."""
    for subtask in A.BBH_SUBTASKS:
        desc, ours = tu.parse_bbh_cot_prompt((data_dir / "bbh" / "cot-prompts" / f"{subtask}.txt").read_text())
        desc2, theirs = tu._bbh_prompt_from_lm_eval(subtask)
        assert desc == desc2, subtask
        assert [(e["input"], e["cot"].strip()) for e in ours] == [(e["input"], e["cot"].strip()) for e in theirs]


def test_bbh_golds_parse(data_dir):
    for subtask in A.BBH_SUBTASKS:
        ds = tu.bbh_dataset(str(data_dir), bbh_subtask=subtask)
        golds = ds["test"]["gold"]
        assert all(g != A.INVALID for g in golds), subtask
        # exemplars' own answers are well-formed too
        assert all(g != A.INVALID for g in ds["fewshot"]["gold"]), subtask


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        tu.resolve_data_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="gsm8k/test.jsonl"):
        tu.gsm8k_dataset(str(tmp_path))
    with pytest.raises(ValueError, match="bbh_subtask"):
        tu.bbh_dataset(str(tmp_path), bbh_subtask="nope")


def test_data_dir_from_environment(monkeypatch, data_dir):
    monkeypatch.setenv(tu.DATA_DIR_ENV, str(data_dir))
    assert tu.resolve_data_dir(None) == data_dir.resolve()
    assert tu.resolve_data_dir(str(data_dir)) == data_dir.resolve()
    monkeypatch.delenv(tu.DATA_DIR_ENV)
    assert tu.resolve_data_dir(None) is None  # -> hub datasets


def test_no_dataset_text_in_repository():
    """eval_tasks/ holds configuration only: no copied questions, rationales or prompts."""
    for path in Path(task_dir()).rglob("*"):
        data_like = path.suffix in (".yaml", ".txt", ".json", ".jsonl", "")
        if path.is_file() and data_like and "__pycache__" not in str(path):
            assert path.stat().st_size < 4000, path
