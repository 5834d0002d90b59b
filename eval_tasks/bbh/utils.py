"""Shim for `!function utils.<name>` in this folder's YAMLs: the code lives in gear_hf.lm_eval.task_utils.

(lm-eval 0.4.10 resolves `!function` only as a file next to the YAML, never as an importable module.)
"""

from gear_hf.lm_eval.task_utils import (  # noqa: F401
    AnswerFilter,
    aqua_dataset,
    bbh_dataset,
    gsm8k_dataset,
    process_results,
)
