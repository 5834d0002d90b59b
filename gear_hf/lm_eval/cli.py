"""`gear-lm-eval` / `python -m gear_hf.lm_eval`: lm-eval's own CLI with the `gear_hf` model registered and
this package's task folder on `--include_path`.

lm-eval discovers no plugins: `lm_eval --model gear_hf` cannot find a model registered by another package,
and a task folder's Python is imported too late to register one. So this entry point registers the model,
adds `--include_path <gear_hf task folder>` when the user gave none (neither on the command line nor in a
`--config` YAML), and hands every argument unchanged to lm-eval's CLI, so all its flags keep working:

    gear-lm-eval --model gear_hf --model_args pretrained=DIR,preset=gear-2 --tasks gsm8k_cot_gear
    accelerate launch --multi_gpu --num_processes N -m gear_hf.lm_eval --model gear_hf ...  # data parallel
    torchrun --nproc_per_node N -m gear_hf.lm_eval --model gear_hf ...                     # the same

On top of lm-eval's CLI: `--help` ends with a gear_hf section; gear_hf's INFO lines (method, data parallel) are
shown; a missing offline data directory is one line naming GEAR_HF_DATA_DIR / --metadata data_dir; after the
results table, one line with the GEAR method, KV bits/element and generated tokens/s.
"""

from __future__ import annotations

import importlib.util
import logging
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


HELP = """
gear_hf (this wrapper adds the `gear_hf` model and the task folder {task_dir}):
  --model gear_hf --model_args pretrained=DIR_OR_HUB_ID,preset=gear-2[,KEY=VALUE...]
    GEAR keys: none = GearConfig() ("balanced"); recommended (by purpose: {recommended});
      preset (alias method: fp16 | kivi | kcvt | outlier | gear-l | gear, or with bits: gear-2, kivi-4, gear-k4v2),
      bits, and every GearConfig setting (key_bits, value_bits, group_size, buffer_size, sink_tokens, rank_prefill,
      rank_decode, outlier_ratio, gear_backend) and advanced option (rotation, key_buffer, hold, ...);
      gear_warmup=false skips the untimed warm-up generate (kernel compilation) before the timed ones.
    Model keys: those of lm-eval's `hf` model (dtype, device, batch_size, gguf_file, attn_implementation, ...).
  --tasks gsm8k_cot_gear | aqua_cot_gear | bbh_cot_gear (27 subtasks, bbh_cot_gear_<subtask>) | gear_hf_cot (all)
  Data offline: --metadata '{{"data_dir": "DIR"}}' or GEAR_HF_DATA_DIR=DIR with DIR/gsm8k/test.jsonl,
    DIR/aqua/{{test,dev}}.json, DIR/bbh/data/<subtask>.json, DIR/bbh/cot-prompts/<subtask>.txt; without either,
    the Hub datasets (openai/gsm8k, deepmind/aqua_rat, SaylorTwift/bbh).
  Data parallel: accelerate launch --multi_gpu --num_processes N -m gear_hf.lm_eval ... (GPUs, or CPU processes
    on a machine without CUDA), or torchrun --nproc_per_node N -m gear_hf.lm_eval ...
  Results: results["config"] gains gear_config (GearConfig.to_dict()), gear_name (how --model_args named it:
    recommended=smallest, preset=gear-2, default), gear_method and gear_stats (generated tokens, tokens/s after a
    warm-up generate, compile_seconds of that warm-up, KV bits/element); the console shows them after lm-eval's table.
"""


def gear_help() -> str:
    try:
        folder = str(task_dir())
    except FileNotFoundError:
        folder = "(not found)"
    from gear_hf.config import RECOMMENDED

    return HELP.format(task_dir=folder, recommended=" | ".join(name for name, _, _, _ in RECOMMENDED))


def show_gear_logs() -> None:
    """gear_hf's INFO lines on the console (lm-eval configures only its own logger)."""
    logger = logging.getLogger("gear_hf")
    if not any(getattr(h, "_gear_hf", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s [%(name)s] %(message)s",
                                               "%Y-%m-%d:%H:%M:%S"))
        handler._gear_hf = True
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def run_summary(info: dict | None) -> str | None:
    """The line printed after lm-eval's table: GEAR configuration, KV bits/element, generated tokens/s (timed after
    the warm-up) and the warm-up's seconds (kernel compilation)."""
    if not info or "gear_stats" not in info:
        return None
    stats = info["gear_stats"]
    bits, speed = stats.get("kv_bits_per_element"), stats.get("tokens_per_second")
    world = info.get("gear_world_size", 1)
    share = f" (rank 0's share of {world} processes)" if world > 1 else ""
    warm_s, compile_s = stats.get("warmup_seconds"), stats.get("compile_seconds") or 0.0
    warm = f" (after a {warm_s:.1f} s warm-up, kernel compilation excluded: {compile_s:.1f} s)" \
        if warm_s is not None else ""
    if stats.get("timed_compile_seconds"):
        warm += f" (timed calls compiled kernels for {stats['timed_compile_seconds']:.1f} s: included)"
    name, method = info.get("gear_name"), info.get("gear_method", "?")
    label = f"{name} ({method})" if name and name != method else method
    return (f"gear_hf: {label} | KV bits/elem "
            f"{'-' if bits is None else f'{bits:.2f}'} | tokens/s {'-' if speed is None else f'{speed:.1f}'}{warm} | "
            f"{stats.get('new_tokens', 0)} tokens generated in {stats.get('sequences', 0)} sequences{share}")


def register() -> None:
    """Register the `gear_hf` model with lm-eval's model registry (importing the module does it)."""
    import gear_hf.lm_eval.model  # noqa: F401


def main(argv: Sequence[str] | None = None) -> None:
    from gear_hf.lm_eval import sharding

    args = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in args)
    show_gear_logs()
    if not wants_help:
        sharding.refuse_unsharded_launch()
        sharding.prepare_process_group()
    register()
    sys.argv = [sys.argv[0] if sys.argv else "gear-lm-eval", *with_task_dir(args)]
    from lm_eval.__main__ import cli_evaluate

    from gear_hf.lm_eval import model
    from gear_hf.lm_eval.args import ModelArgsError
    from gear_hf.lm_eval.task_utils import DataUnavailable

    try:
        cli_evaluate()
    except DataUnavailable as err:
        raise SystemExit(f"gear-lm-eval: error: {err}") from None
    except ModelArgsError as err:  # a usage error, reported as argparse reports one: one line, exit status 2
        print(f"gear-lm-eval: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if wants_help:
            print(gear_help())
    sharding.close_process_group()
    summary = run_summary(model.LAST_MODEL_INFO)
    if summary:
        print(summary)
