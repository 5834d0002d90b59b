"""Answer extraction of the CoT tasks (gear_hf.lm_eval.answers / task_utils filters): pure Python, fast."""

from __future__ import annotations

import pytest

from gear_hf.lm_eval import answers as A
from gear_hf.lm_eval.answers import INVALID


@pytest.mark.parametrize("text, expected", [
    ("18", "18"), ("-5", "-5"), ("$1,234.50", "1234.5"), ("-$5", "-5"), ("$-5", "-5"), ("\u22127", "-7"),
    ("18.00", "18"), ("3.", "3"), ("0.50", "0.5"), ("1,000,000", "1000000"), ("$ 40", "40"), ("abc", None),
    ("", None), ("-0", "0"),
])
def test_normalize_number(text, expected):
    assert A.normalize_number(text) == expected


@pytest.mark.parametrize("text, strict, flexible", [
    ("Natalia sold 48 + 24 = 72 clips. The answer is 72.", "72", "72"),
    ("He lost money: 5 - 12 = -7. The answer is -7.", "-7", "-7"),
    ("The answer is $1,250.", "1250", "1250"),
    ("So she pays 3 * $4.50 = $13.50. The answer is 13.5.", "13.5", "13.5"),
    ("The answer is $-15.", "-15", "-15"),
    ("It costs $18.00 in total.", INVALID, "18"),             # no "The answer is": only flexible finds it
    ("Sum: 1,000 + 2,000 = 3,000 dollars", INVALID, "3000"),   # commas inside numbers are kept together
    ("10-4 = 6 so 6 remain", INVALID, "6"),                    # a minus between numbers is not a sign
    ("The answer is 6. Then 7 more.", "6", "7"),               # strict takes the first statement
    ("I do not know.", INVALID, INVALID),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert A.gsm8k_strict(text) == strict
    assert A.gsm8k_flexible(text) == flexible


def test_gsm8k_gold():
    assert A.gsm8k_gold("Janet sells 9 eggs.\nShe makes $18.\n#### 18") == "18"
    assert A.gsm8k_gold("... #### 1,080") == "1080"
    assert A.gsm8k_gold("#### -3") == "-3"


@pytest.mark.parametrize("text, strict, flexible", [
    ("So the speed is 250 m. The answer is (C).", "C", "C"),
    ("The answer is C", "C", "C"),
    ("the answer is (d).", "D", "D"),
    ("The correct answer is option B.", "B", "B"),
    ("Between (A) and (E), (E) fits best.", INVALID, "E"),
    ("Answer: B", INVALID, "B"),
    ("no idea", INVALID, INVALID),
])
def test_aqua_extraction(text, strict, flexible):
    assert A.aqua_strict(text) == strict
    assert A.aqua_flexible(text) == flexible


@pytest.mark.parametrize("subtask, text, strict, flexible", [
    # multiple choice (BBH targets are "(X)")
    ("date_understanding", "So the answer is (B).", "(B)", "(B)"),
    ("date_understanding", "So the answer is B.", "(B)", "(B)"),
    ("logical_deduction_three_objects", "The blue book is leftmost: option (A) is right.", INVALID, "(A)"),
    ("reasoning_about_colored_objects", "So the answer is (Q).", "(Q)", "(Q)"),
    # binary labels, compared case-insensitively
    ("boolean_expressions", "Z = not True = False. So the answer is False.", "false", "false"),
    ("sports_understanding", "So the answer is yes.", "yes", "yes"),
    ("causal_judgement", "Most people would say No here", INVALID, "no"),
    ("formal_fallacies", "So the answer is invalid.", "invalid", "invalid"),
    ("formal_fallacies", "The argument is deductively valid", INVALID, "valid"),
    # numbers
    ("multistep_arithmetic_two", "So the answer is -219.", "-219", "-219"),
    ("object_counting", "1 + 2 + 3 = 6 objects", INVALID, "6"),
    # free form
    ("dyck_languages", "So the answer is ] ) }.", "])}", "])}"),
    ("word_sorting", "So the answer is apple Banana cherry.", "apple banana cherry", "apple banana cherry"),
    ("word_sorting", "apple banana\ncherry date", INVALID, "cherry date"),
])
def test_bbh_extraction(subtask, text, strict, flexible):
    assert A.bbh_strict(subtask, text) == strict
    assert A.bbh_flexible(subtask, text) == flexible


@pytest.mark.parametrize("subtask, target, gold", [
    ("date_understanding", "(B)", "(B)"), ("boolean_expressions", "False", "false"),
    ("sports_understanding", "no", "no"), ("dyck_languages", "] ] >", "]]>"),
    ("object_counting", "15", "15"), ("word_sorting", "syndrome therefrom", "syndrome therefrom"),
    ("movie_recommendation", "Monsters, Inc", "monsters, inc"),  # a BBH gold that is an option text
])
def test_bbh_gold(subtask, target, gold):
    assert A.bbh_gold(subtask, target) == gold


def test_bbh_capital_q_is_not_a_stop():
    """lm-eval's own BBH CoT tasks stop at a bare "Q", which would cut "(Q)" / "Queen"; ours stop at "\\nQ:"."""
    from pathlib import Path

    import yaml

    from gear_hf.lm_eval.cli import task_dir

    template = Path(task_dir()) / "bbh" / "_bbh_cot_gear_template_yaml"
    cfg = yaml.load(template.read_text(), Loader=_IgnoreTagsLoader)
    until = cfg["generation_kwargs"]["until"]
    assert "Q" not in until
    text = "The Queen of hearts is (Q). So the answer is (Q).\n\nQ: next question"
    cut = min((text.find(s) for s in until if s in text), default=len(text))
    assert A.bbh_strict("reasoning_about_colored_objects", text[:cut]) == "(Q)"


class _IgnoreTagsLoader(__import__("yaml").SafeLoader):
    pass


_IgnoreTagsLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def test_bbh_subtasks_are_the_27():
    assert len(A.BBH_SUBTASKS) == 27
    assert set(A.BBH_LABELS) == {k for k, v in A.BBH_SUBTASKS.items() if v == A.BINARY}


def test_answer_filter_and_process_results():
    pytest.importorskip("lm_eval")
    from gear_hf.lm_eval.task_utils import AnswerFilter, process_results

    docs = [{"gold": "72", "subtask": "x"}, {"gold": "5", "subtask": "x"}]
    resps = [["The answer is 72."], ["No number here"]]
    out = AnswerFilter(extractor="gsm8k_strict").apply(resps, docs)
    assert out == [["72"], [INVALID]]
    assert process_results(docs[0], ["72"]) == {"exact_match": 1.0}
    assert process_results(docs[1], [INVALID]) == {"exact_match": 0.0}
    assert process_results({"gold": INVALID}, [INVALID]) == {"exact_match": 0.0}  # invalid never matches
    with pytest.raises(ValueError, match="extractor"):
        AnswerFilter(extractor="nope")
