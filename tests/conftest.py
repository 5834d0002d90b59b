"""Shared pytest setup for gear_hf.

* Offline by default (``HF_HUB_OFFLINE=1``): nothing here may reach the Hugging Face Hub.
* Without CUDA: ``TRITON_INTERPRET=1`` is set before any test module imports the Triton kernels
  (Triton launches fail on a machine without a GPU otherwise), and ``gpu``-marked tests are skipped.
* Real-weights fixtures: ``smollm2`` (SmolLM2-135M-Instruct, llama, fp32), ``smollm2_bf16`` and
  ``qwen25`` (Qwen2.5-Coder-0.5B-Instruct, qwen2, bf16), session-scoped, each ``(model, tokenizer)``.
  The models are shared: after every test ``gear_hf.disable(model)`` runs on any of them left enabled. Tests that
  use them get the ``realweights`` marker automatically (``-m "not realweights"`` for a quick run).
  See tests/realweights.py for when they skip and when they fail instead.
* Step workspaces (gear_hf.cache.workspace) start filled with NaN: they are uninitialised memory in use, so a
  read of a column nothing wrote fails every time here instead of now and then.
* ``reference_path``: decode steps take the reconstruct-then-attend path even where a fused kernel applies (on
  CPU the numba kernel serves every decode step it covers), for tests of that path itself.
* Hypothesis: no deadline (a 2-core CI machine is slow and noisy); derandomized when ``CI`` is set.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import realweights  # noqa: E402

try:
    from hypothesis import settings as _hyp_settings
except ImportError:  # hypothesis comes with the `test` extra; tests that need it importorskip it
    _hyp_settings = None
if _hyp_settings is not None:
    _hyp_settings.register_profile("gear_hf", deadline=None, print_blob=True)
    _hyp_settings.register_profile("gear_hf-ci", deadline=None, print_blob=True, derandomize=True)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE",
                                              "gear_hf-ci" if os.environ.get("CI") else "gear_hf"))

_WEIGHT_FIXTURES = {"smollm2", "smollm2_bf16", "qwen25"}


def pytest_report_header(config):
    import transformers

    cuda = torch.cuda.get_device_name(0) if HAS_CUDA else "no CUDA (gpu tests skipped, TRITON_INTERPRET=1)"
    return f"gear_hf: torch {torch.__version__}, transformers {transformers.__version__}, {cuda}"


# Kernel compilation over the run (`gear_hf.warmup.CompileWatch`), summed over the xdist workers and printed at the end:
# `make venv` compiles the shipped configurations' kernels first, so what shows here is what only tests reach.
_COMPILES: dict = {}


def pytest_sessionstart(session):
    from gear_hf.warmup import CompileWatch

    _COMPILES["watch"] = CompileWatch().__enter__()


def pytest_sessionfinish(session):
    watch = _COMPILES.pop("watch", None)
    if watch is None:
        return
    watch.__exit__(None, None, None)
    _COMPILES["total"] = [watch.seconds, watch.count]
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand it to the controller
        session.config.workeroutput["numba_compile"] = _COMPILES["total"]


@pytest.hookimpl(optionalhook=True)  # (an xdist hook: environments without xdist, e.g. .venv-vllm, do not know it)
def pytest_testnodedown(node, error):
    seconds, count = getattr(node, "workeroutput", {}).get("numba_compile", (0.0, 0))
    workers = _COMPILES.setdefault("workers", [0.0, 0])
    workers[0] += seconds
    workers[1] += count


def pytest_terminal_summary(terminalreporter):
    seconds, count = _COMPILES.get("workers") or _COMPILES.get("total") or (0.0, 0)
    terminalreporter.write_line(f"numba: {count} kernel signature(s) compiled in {seconds:.0f} s over the run "
                                "(summed over workers)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if _WEIGHT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.realweights)


@pytest.fixture(autouse=True)
def _disable_gear_left_enabled():
    """Safety net for the shared real-weights models: a test that enabled GEAR on one and did not
    disable it gets it disabled here, so the next test sees the stock model."""
    yield
    loaded = realweights.loaded_models()
    if not loaded:
        return
    import gear_hf

    is_enabled = getattr(gear_hf, "is_enabled", None)
    disable = getattr(gear_hf, "disable", None)
    if is_enabled is None or disable is None:
        return
    for model in loaded:
        if is_enabled(model):
            disable(model)


@pytest.fixture
def reference_path(monkeypatch):
    """Every step of gear_hf's attention takes the reference path (reconstruct, rotate, the model's attention)."""
    monkeypatch.setattr("gear_hf.cache.GearCache.use_fused", lambda *args, **kwargs: False)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (Llama arch), fp32, eval mode, left padding."""
    return realweights.load("smollm2", "float32")


@pytest.fixture(scope="session")
def smollm2_bf16():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in bfloat16."""
    return realweights.load("smollm2", "bfloat16")


@pytest.fixture(scope="session")
def qwen25():
    """``(model, tokenizer)``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch), bf16. Needs `make weights-qwen`."""
    return realweights.load("qwen25", "bfloat16")


@pytest.fixture(autouse=True)
def _workspaces_start_as_nan(monkeypatch):
    """A fresh workspace tensor holds NaN (floating dtypes): whatever the cache reads of it must be written first."""
    from gear_hf.cache.workspace import StepWorkspace

    get = StepWorkspace.get

    def poisoned_get(self, role, shape, dtype, device):
        fresh = (role, tuple(shape), dtype, device) not in self._tensors
        tensor = get(self, role, shape, dtype, device)
        return tensor.fill_(float("nan")) if fresh and tensor.is_floating_point() else tensor

    monkeypatch.setattr(StepWorkspace, "get", poisoned_get)
