"""The demo's methods (default, every recommended name, presets), its labels and its prompt choice
(no weights needed here; the real run: tests/test_lm_eval_user_path.py::test_demo_as_in_the_readme)."""

from __future__ import annotations

import argparse

import pytest

from gear_hf import GearConfig
from gear_hf.config import RECOMMENDED
from gear_hf.demo import BASELINE, METHODS, choose_problems, method_config, method_label


def test_default_and_every_recommended_name_are_methods():
    assert METHODS[0] == "default" and method_config("default") == GearConfig() == method_config("recommended")
    for name, _, _, _ in RECOMMENDED:
        assert method_config(f"rec-{name}") == GearConfig.recommended(name=name)
        assert method_config(name) == GearConfig.recommended(name=name)  # names no preset has
    assert method_config("gear-4") == GearConfig.preset("gear-4")  # the preset, int8 factors
    assert method_config(BASELINE) is None  # the stock model


def test_a_bad_method_names_what_is_allowed():
    message = r"--methods: 'smalest': did you mean 'smallest'\? .*\(or: default, smallest, balanced"
    with pytest.raises(SystemExit, match=message):
        method_config("smalest")


def test_labels_name_the_baseline_by_its_dtype():
    assert method_label(BASELINE, "float32") == "float32 (uncompressed)"
    assert method_label("default", "bfloat16") == "default (GearConfig())"
    assert method_label("kivi-2", "float32") == "kivi-2"


def _args(**kw):
    return argparse.Namespace(**{"builtin": False, "gsm8k": False, "data_dir": None, "model": "smollm2",
                                 "num_prompts": 2, **kw})


def test_smollm2_defaults_to_the_builtin_problems(tmp_path):
    problems, label = choose_problems(_args())
    assert label.startswith("built-in 8-shot one-step") and len(problems) == 2
    assert problems[0].prompt.count("Question:") == 9
    (tmp_path / "gsm8k").mkdir()
    for split in ("train", "test"):
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text(
            "".join(f'{{"question": "q{i}?", "answer": "r #### {i}"}}\n' for i in range(9)))
    problems, label = choose_problems(_args(data_dir=str(tmp_path)))  # GSM8K where asked
    assert label.startswith("GSM8K test, 8-shot") and problems[1].gold == "1"
    problems, label = choose_problems(_args(model="qwen25", data_dir=str(tmp_path)))
    assert label.startswith("GSM8K test, 8-shot")
