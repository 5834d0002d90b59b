"""tests/vllm: the vLLM plugin (gear_hf.vllm). Every test here is marked `vllm` and skips unless the real vllm
package imports (`make test-vllm` builds .venv-vllm for them; the main suite in .venv skips them).

Why not `importorskip("vllm")`: `pythonpath = tests` (setup.cfg) makes this folder a namespace package called
`vllm` wherever the real one is missing, so `import vllm` succeeds there; a module of the real package does not.
"""

from __future__ import annotations

import importlib.util

import pytest

try:
    HAS_VLLM = importlib.util.find_spec("vllm.v1.attention.backends.registry") is not None
except ModuleNotFoundError:
    HAS_VLLM = False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="vllm is not installed (make test-vllm runs these in .venv-vllm)")
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.vllm)
            if not HAS_VLLM:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random Llama and Qwen2 checkpoints with a tokenizer: GQA 4/2, head_dim 64 (CPU_ATTN's sizes)."""
    from gear_hf.lm_eval.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_vllm")
    return {arch: build_tiny_model(root / arch, model_type=arch, hidden_size=256, num_heads=4, num_kv_heads=2,
                                   max_position_embeddings=2048)
            for arch in ("llama", "qwen2")}

