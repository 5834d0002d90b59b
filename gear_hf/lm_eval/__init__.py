"""lm-eval integration of gear_hf: the `gear_hf` model, the CLI, the CoT tasks' loaders and answer extraction.

    gear-lm-eval --model gear_hf --model_args pretrained=DIR,preset=gear,bits=2 --tasks gsm8k_cot_gear
    python -m gear_hf.lm_eval ...            # the same
    accelerate launch -m gear_hf.lm_eval ... # data parallel

Importing this package is cheap; `GearHFLM` (which imports lm-eval and transformers) loads on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GearHFLM", "main", "task_dir", "split_model_args", "parse_gear_args", "ModelArgsError"]


def __getattr__(name: str) -> Any:
    if name == "GearHFLM":
        from gear_hf.lm_eval.model import GearHFLM

        return GearHFLM
    if name in ("main", "task_dir"):
        from gear_hf.lm_eval import cli

        return getattr(cli, name)
    if name in ("split_model_args", "parse_gear_args", "ModelArgsError"):
        from gear_hf.lm_eval import args

        return getattr(args, name)
    raise AttributeError(f"module 'gear_hf.lm_eval' has no attribute {name!r}")
