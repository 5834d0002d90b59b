"""The `vllm.general_plugins` entry point: swap CPU_ATTN's class for the GEAR backend when GEAR_HF_VLLM=1.

vLLM calls `register()` in each of its processes (front end, engine core, workers) before it picks attention
backends; the CPU platform always asks for CPU_ATTN, so overriding that member is the way in on CPU.
"""

from __future__ import annotations

import os

ENABLE_ENV = "GEAR_HF_VLLM"
CONFIG_ENV = "GEAR_HF_VLLM_CONFIG"
BACKEND_PATH = "gear_hf.vllm.backend.GearAttentionBackend"
_TRUE = ("1", "true", "yes", "on")


def enabled() -> bool:
    value = os.environ.get(ENABLE_ENV, "")
    if value.lower() not in (*_TRUE, "", "0", "false", "no", "off"):
        raise ValueError(f"{ENABLE_ENV}={value!r} is invalid; allowed: 1/true/yes/on or 0/false/no/off (or unset)")
    return value.lower() in _TRUE


def register() -> None:
    """Override CPU_ATTN with the GEAR backend (only when enabled; otherwise vLLM is left untouched)."""
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .format import config_from_env

    config_from_env()  # a bad GEAR_HF_VLLM_CONFIG fails here, in the first process, with the field named
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
