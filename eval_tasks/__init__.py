"""lm-eval task configurations shipped with gear_hf (installed as `gear_hf.eval_tasks`).

YAML (plus one-line `utils.py` shims); the loaders, answer filters and scoring they reference live in
`gear_hf.lm_eval.task_utils`.
`gear-lm-eval` / `python -m gear_hf.lm_eval` add this folder to lm-eval's `--include_path`.
"""
