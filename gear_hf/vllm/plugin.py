"""The `vllm.general_plugins` entry point: when GEAR_HF_VLLM=1, the GEAR backends in vLLM's registry.

vLLM calls `register()` in each of its processes (front end, engine core, workers) before it picks attention
backends. The CPU platform always asks for CPU_ATTN, so overriding that member is the way in on CPU; on GPUs vLLM
takes a third-party backend as AttentionBackendEnum.CUSTOM, chosen with `--attention-backend CUSTOM`
(`attention_backend="CUSTOM"` in the Python API): the Triton backend is registered there.
"""

from __future__ import annotations

import os

ENABLE_ENV = "GEAR_HF_VLLM"
CONFIG_ENV = "GEAR_HF_VLLM_CONFIG"
BACKEND_PATH = "gear_hf.vllm.backend.GearAttentionBackend"
TRITON_BACKEND_PATH = "gear_hf.vllm.triton_backend.GearTritonBackend"
_TRUE = ("1", "true", "yes", "on")


def enabled() -> bool:
    value = os.environ.get(ENABLE_ENV, "")
    if value.lower() not in (*_TRUE, "", "0", "false", "no", "off"):
        raise ValueError(f"{ENABLE_ENV}={value!r} is invalid; allowed: 1/true/yes/on or 0/false/no/off (or unset)")
    return value.lower() in _TRUE


def register() -> None:
    """CPU_ATTN overridden by the GEAR backend, CUSTOM registered as the GEAR Triton backend (only when enabled;
    otherwise vLLM is left untouched)."""
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .format import config_from_env

    config_from_env()  # a bad GEAR_HF_VLLM_CONFIG fails here, in the first process, with the field named
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, TRITON_BACKEND_PATH)
