"""Answer extraction and normalization for the generative CoT tasks (pure Python, no lm-eval import).

Every extractor returns a *canonical* answer string (or `INVALID`), and the gold answers are put through
the same normalization, so scoring is plain string equality and two runs can be compared answer by answer
(the sweep's agreement-with-fp16 column reads these canonical strings from the logged samples).

* numbers:  "$1,234.50" -> "1234.5", "-$5" / "$-5" / "−5" -> "-5", "18.00" -> "18", "3." -> "3"
* letters:  "(C)", "C)", "C", "(c)" -> "C"  (AQuA), "(C)" (BBH multiple choice, the BBH target form)
* BBH:      binary labels lower-cased, free-form answers whitespace-collapsed (Dyck: whitespace removed)
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

INVALID = "[invalid]"

_MINUS = "\u2212\u2013"  # unicode minus sign, en dash, both seen as minus signs in model output
# One number as written in text: optional sign, optional "$", optional sign after the "$", digits with
# optional thousands commas, optional decimals. A trailing "." (end of sentence) is never part of it.
NUMBER_RE = re.compile(
    rf"(?<![\w.])(?:[-{_MINUS}]\s?)?\$?\s?(?:[-{_MINUS}]\s?)?(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)"
)
_GSM8K_STRICT_RE = re.compile(r"[Tt]he answer is:?\s*(" + NUMBER_RE.pattern + r")")


def normalize_number(text: str | None) -> str | None:
    """Canonical decimal string of a number written with optional sign, `$`, commas; None if not one."""
    if text is None:
        return None
    s = str(text).strip()
    for ch in _MINUS:
        s = s.replace(ch, "-")
    s = s.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    negative = s.count("-") % 2 == 1
    s = s.replace("-", "")
    if not s:
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if negative:
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def last_number(text: str) -> str:
    matches = NUMBER_RE.findall(text or "")
    for m in reversed(matches):
        n = normalize_number(m)
        if n is not None:
            return n
    return INVALID


def first_number(text: str) -> str:
    for m in NUMBER_RE.findall(text or ""):
        n = normalize_number(m)
        if n is not None:
            return n
    return INVALID


# GSM8K --------------------------------------------------------------------------------------------------------
def gsm8k_gold(answer: str) -> str:
    """Gold of a GSM8K record: the text after '####' (or the whole string when it is a bare number)."""
    return normalize_number(str(answer).split("####")[-1]) or INVALID


def gsm8k_strict(text: str) -> str:
    """'The answer is N' (first occurrence, as lm-eval's gsm8k-cot strict-match), N with sign, $, commas."""
    m = _GSM8K_STRICT_RE.search(text or "")
    if not m:
        return INVALID
    return normalize_number(m.group(1)) or INVALID


def gsm8k_flexible(text: str) -> str:
    """The last number in the generation (negative signs, commas, `$`, decimals kept)."""
    return last_number(text)


# AQuA ---------------------------------------------------------------------------------------------------------
_AQUA_STRICT_RE = re.compile(r"[Tt]he (?:correct |final )?answer is:?\s*(?:option\s*)?\(?([A-Ea-e])\b\)?")
_PAREN_LETTER_RE = re.compile(r"\(([A-E])\)")
_ANSWER_LETTER_RE = re.compile(r"\b(?:answer|option|choice)\s*(?:is|:)?\s*:?\s*\(?([A-E])\b", re.IGNORECASE)


def aqua_strict(text: str) -> str:
    m = _AQUA_STRICT_RE.search(text or "")
    return m.group(1).upper() if m else INVALID


def aqua_flexible(text: str) -> str:
    """Strict form, else the last '(X)', else the last 'answer/option X'."""
    strict = aqua_strict(text)
    if strict != INVALID:
        return strict
    text = text or ""
    found = _PAREN_LETTER_RE.findall(text)
    if found:
        return found[-1]
    found = _ANSWER_LETTER_RE.findall(text)
    if found:
        return found[-1].upper()
    return INVALID


def aqua_gold(correct: str) -> str:
    m = re.search(r"[A-Ea-e]", str(correct))
    return m.group(0).upper() if m else INVALID


# BBH ----------------------------------------------------------------------------------------------------------
MULTIPLE_CHOICE = "multiple_choice"
BINARY = "binary"
NUMERIC = "numeric"
FREE_FORM = "free_form"
DYCK = "dyck"

# The 27 BBH subtasks and the form of their answers.
BBH_SUBTASKS: dict[str, str] = {
    "boolean_expressions": BINARY,
    "causal_judgement": BINARY,
    "date_understanding": MULTIPLE_CHOICE,
    "disambiguation_qa": MULTIPLE_CHOICE,
    "dyck_languages": DYCK,
    "formal_fallacies": BINARY,
    "geometric_shapes": MULTIPLE_CHOICE,
    "hyperbaton": MULTIPLE_CHOICE,
    "logical_deduction_five_objects": MULTIPLE_CHOICE,
    "logical_deduction_seven_objects": MULTIPLE_CHOICE,
    "logical_deduction_three_objects": MULTIPLE_CHOICE,
    "movie_recommendation": MULTIPLE_CHOICE,
    "multistep_arithmetic_two": NUMERIC,
    "navigate": BINARY,
    "object_counting": NUMERIC,
    "penguins_in_a_table": MULTIPLE_CHOICE,
    "reasoning_about_colored_objects": MULTIPLE_CHOICE,
    "ruin_names": MULTIPLE_CHOICE,
    "salient_translation_error_detection": MULTIPLE_CHOICE,
    "snarks": MULTIPLE_CHOICE,
    "sports_understanding": BINARY,
    "temporal_sequences": MULTIPLE_CHOICE,
    "tracking_shuffled_objects_five_objects": MULTIPLE_CHOICE,
    "tracking_shuffled_objects_seven_objects": MULTIPLE_CHOICE,
    "tracking_shuffled_objects_three_objects": MULTIPLE_CHOICE,
    "web_of_lies": BINARY,
    "word_sorting": FREE_FORM,
}

# Labels of the binary tasks (lower case). "invalid" must be tried before "valid".
BBH_LABELS: dict[str, tuple[str, ...]] = {
    "boolean_expressions": ("true", "false"),
    "causal_judgement": ("yes", "no"),
    "formal_fallacies": ("invalid", "valid"),
    "navigate": ("yes", "no"),
    "sports_understanding": ("yes", "no"),
    "web_of_lies": ("yes", "no"),
}

_BBH_STRICT_RE = re.compile(r"the answer is:?[ \t]*([^\n]*)", re.IGNORECASE)
_MC_OPTION_RE = re.compile(r"\(([A-Ra-r])\)")
_MC_BARE_RE = re.compile(r"^\(?([A-R])\)?(?:[\s.,:;)]|$)")


def _kind(subtask: str) -> str:
    try:
        return BBH_SUBTASKS[subtask]
    except KeyError:
        raise ValueError(f"unknown BBH subtask {subtask!r}; known: {sorted(BBH_SUBTASKS)}") from None


def normalize_bbh(subtask: str, answer: str | None) -> str:
    """Canonical form of a BBH answer span (the text after 'the answer is', or a gold target)."""
    if answer is None:
        return INVALID
    kind = _kind(subtask)
    s = str(answer).strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    if not s:
        return INVALID
    if kind == MULTIPLE_CHOICE:
        m = _MC_OPTION_RE.search(s)
        if m:
            return f"({m.group(1).upper()})"
        m = _MC_BARE_RE.match(s)
        # A few BBH golds are option texts, not letters (movie_recommendation "Monsters, Inc").
        return f"({m.group(1)})" if m else " ".join(s.lower().split())
    if kind == BINARY:
        low = s.lower().strip(" .,!\"'`*")
        for label in BBH_LABELS[subtask]:
            if re.fullmatch(rf"\(?{label}\)?", low) or re.match(rf"{label}\b", low):
                return label
        return INVALID
    if kind == NUMERIC:
        return first_number(s)
    if kind == DYCK:
        return re.sub(r"\s+", "", s)
    return " ".join(s.lower().split())  # FREE_FORM (word sorting)


def bbh_gold(subtask: str, target: str) -> str:
    return normalize_bbh(subtask, target)


def bbh_strict(subtask: str, text: str) -> str:
    """The answer after the first 'the answer is' (the form of the standard CoT prompts), normalized."""
    m = _BBH_STRICT_RE.search(text or "")
    if not m:
        return INVALID
    return normalize_bbh(subtask, m.group(1))


def bbh_flexible(subtask: str, text: str) -> str:
    """The strict answer, else by answer form: the last '(X)' / label word / number / non-empty line."""
    strict = bbh_strict(subtask, text)
    if strict != INVALID:
        return strict
    text = text or ""
    kind = _kind(subtask)
    if kind == MULTIPLE_CHOICE:
        found = _MC_OPTION_RE.findall(text)
        return f"({found[-1].upper()})" if found else INVALID
    if kind == BINARY:
        labels = BBH_LABELS[subtask]
        pattern = re.compile(r"\b(" + "|".join(labels) + r")\b", re.IGNORECASE)
        found = pattern.findall(text)
        return found[-1].lower() if found else INVALID
    if kind == NUMERIC:
        return last_number(text)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return normalize_bbh(subtask, lines[-1]) if lines else INVALID
