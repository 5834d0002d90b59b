"""`gear-lm-eval` / `python -m gear_hf.lm_eval`: lm-eval's own CLI with the `gear_hf` model registered and
this package's task folder on `--include_path`.

lm-eval discovers no plugins: `lm_eval --model gear_hf` cannot find a model registered by another package,
and a task folder's Python is imported too late to register one. So this entry point registers the model,
adds `--include_path <gear_hf task folder>` when the user gave none (neither on the command line nor in a
`--config` YAML), and hands every argument unchanged to lm-eval's CLI, so all its flags keep working:

    gear-lm-eval --model gear_hf --model_args pretrained=DIR,preset=gear,bits=2 --tasks gsm8k_cot_gear
    accelerate launch -m gear_hf.lm_eval --model gear_hf ...          # data parallel (GPUs)
    torchrun --nproc_per_node 2 -m gear_hf.lm_eval --model gear_hf ... # data parallel, CPU processes too
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Sequence

_SUBCOMMANDS = ("run", "ls", "validate")


def task_dir() -> Path:
    """The folder of the gear_hf task YAMLs: installed `gear_hf.eval_tasks`, else the repository's eval_tasks/."""
    try:
        spec = importlib.util.find_spec("gear_hf.eval_tasks")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    repo = Path(__file__).resolve().parents[2] / "eval_tasks"
    if repo.is_dir():
        return repo
    raise FileNotFoundError("gear_hf task folder not found (neither gear_hf.eval_tasks nor <repo>/eval_tasks)")


def _has_option(argv: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in argv)


def _option_value(argv: Sequence[str], *names: str) -> str | None:
    for i, a in enumerate(argv):
        for name in names:
            if a == name and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
    return None


def _config_sets_include_path(argv: Sequence[str]) -> bool:
    path = _option_value(argv, "--config", "-C")
    if not path:
        return False
    try:
        import yaml

        cfg = yaml.safe_load(Path(path).read_text())
    except Exception:  # lm-eval reports a bad config itself
        return False
    return isinstance(cfg, dict) and bool(cfg.get("include_path"))


def with_task_dir(argv: Sequence[str]) -> list[str]:
    """argv plus `--include_path <task_dir()>` when it is a run/ls/validate command without one."""
    argv = list(argv)
    if not argv or any(a in ("-h", "--help") for a in argv[:1]):
        return argv
    if argv[0] in _SUBCOMMANDS:
        command = argv[0]
    elif len(argv) >= 2:  # lm-eval's legacy form: no subcommand means "run"
        command = "run"
    else:
        return argv
    if command == "ls" and len(argv) >= 2 and argv[1] not in ("tasks", "groups", "subtasks", "tags"):
        return argv
    if _has_option(argv, "--include_path") or (command == "run" and _config_sets_include_path(argv)):
        return argv
    return argv + ["--include_path", str(task_dir())]


def register() -> None:
    """Register the `gear_hf` model with lm-eval's model registry (importing the module does it)."""
    import gear_hf.lm_eval.model  # noqa: F401


def main(argv: Sequence[str] | None = None) -> None:
    from gear_hf.lm_eval import sharding

    args = list(sys.argv[1:] if argv is None else argv)
    sharding.prepare_process_group()
    register()
    sys.argv = [sys.argv[0] if sys.argv else "gear-lm-eval", *with_task_dir(args)]
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
