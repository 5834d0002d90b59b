"""The Triton kernels compile for real GPUs (sm_90 = H100/H200, sm_80 = A100) — checked on CPU.

The interpreter (TRITON_INTERPRET=1) checks numerics only; this runs `scripts/dev/compile_check.py` in a
subprocess *without* the interpreter: it plans the real launches on small CPU caches and compiles them with
triton.compile + ptxas (shipped in the triton wheel), catching what only the compiler sees (tl.dot shape
and dtype rules, layouts, types).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:  # another triton API
        pytest.skip(f"triton {triton.__version__} lacks the ahead-of-time compile API: {exc}")
    if not (Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    tool = ROOT / "scripts" / "dev" / "compile_check.py"
    proc = subprocess.run([sys.executable, str(tool), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_kernels_compile_for_sm90_and_sm80_quick():
    out = _run("--arch", "90", "80", "--quick").stdout
    assert "_decode_attention_kernel" in out and "_quant_channel_kernel" in out and "0 failed" in out


@pytest.mark.slow
def test_kernels_compile_all_configurations():
    assert "0 failed" in _run("--arch", "90", "80").stdout


def test_sass_report_counts_the_main_loop():
    """`--sass-report --breakdown`: compiles the decode kernel for sm_90 at Llama-3-8B shapes and ends with the
    figure line; the step has no fenced atomics and no spills (the per-token figure itself is reported, not
    asserted); every instruction of each main loop is attributed to a kernel function through the line table; and
    compiling without any one of GEAR's terms (both outlier terms, both low-rank terms) shortens gear2's loop."""
    import re

    out = _run("--sass-report", "--breakdown", "--register-only").stdout  # (the other sections: the tests below)
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"instructions/token/kv-head: \d+", last), last
    for bits in (2, 4):
        line = next(x for x in out.splitlines() if x.startswith(f"gear{bits}: main loop"))
        assert "spill ops 0," in line and "fenced atomics 0 " in line and "stack 0B" in line, line
    breakdowns = [x for x in out.splitlines() if "main loop by source" in x]
    assert len(breakdowns) == 6, out
    for line in breakdowns:
        total, parts = re.search(r"\((\d+) instructions\): (.*)$", line).groups()
        counts = {name: int(n) for name, n in (part.rsplit(" ", 1) for part in parts.split(", "))}
        assert sum(counts.values()) == int(total), line
        assert "?" not in counts and "_softmax_step" in counts and "_per_channel_tile" in counts, line
    gear2 = breakdowns[-1]  # the cases print in order, gear2 last: its low-rank and both outlier terms are there
    assert all(name in gear2 for name in ("_value_tile", "_key_outlier_scores", "_lowrank_a", "_lowrank_bt")), gear2
    terms = [x for x in out.splitlines() if "each term costs" in x][-1]
    saved = {name: int(n) for name, n in (part.rsplit(" ", 1) for part in terms.split(": ", 1)[1].split(", "))}
    assert set(saved) == {"value outliers", "key outliers", "key low-rank", "value low-rank", "all four"}, terms
    assert all(n > 0 for n in saved.values()) and saved["all four"] > max(
        n for name, n in saved.items() if name != "all four"), terms


def test_tensor_core_kernel_report():
    """`--sass-report --tensor-core-only`: the tensor-core kernel's main loop for GearConfig() and gear-2 compiles
    without spills and counts fewer instructions per token and KV head than the register kernel's (the issue's
    targets, 90 and 140, are reported in results/decode-kernel-sass, not asserted)."""
    import re

    out = _run("--sass-report", "--tensor-core-only").stdout
    for label in ("default", "gear2"):
        figures = {}
        for name in ("register", "tensor-core"):
            line = next(x for x in out.splitlines() if x.startswith(f"{label} {name} ("))
            figures[name] = int(re.search(r"= (\d+) instructions/token/kv-head", line).group(1))
            assert "spill ops 0" in line and "stack 0B" in line, line
        assert figures["tensor-core"] < figures["register"], (label, figures)


def test_reconstruct_report_counts_per_element():
    """`--reconstruct-report` (the reconstruction kernel's section of --sass-report): for every configuration the
    library ships (GearConfig() as "default", gear-2 as "gear2", the recommended names, the paper presets), one line
    per store kind (keys/values x prompt/decode chunks) with its main loop's instructions per element, no spills and
    no stack; the target, 12, holds for every line (and so for the worst store, the last line)."""
    import re

    sys.path.insert(0, str(ROOT / "scripts" / "dev"))
    from sass_reconstruct import cases

    out = _run("--reconstruct-report").stdout
    labels = [label for label, _ in cases()]
    assert {"default", "gear2", "rec:smallest", "rec:precise", "kivi-2", "gear-l-2", "gear-8"} <= set(labels), labels
    for label in ("default", "gear2"):
        for kind in ("keys prompt", "keys decode", "values prompt", "values decode"):
            line = next((x for x in out.splitlines() if x.startswith(f"reconstruct {label} {kind} sm_90:")), None)
            assert line is not None, out
    lines = [x for x in out.splitlines() if re.match(r"reconstruct \S+ (keys|values) (prompt|decode) sm_90:", x)]
    assert {x.split()[1] for x in lines} == set(labels), out
    for line in lines:
        assert re.search(r": \d+\.\d instructions/element \(main loop \d+ SASS", line), line
        assert "spill ops 0," in line and "stack 0B" in line, line
        assert float(re.search(r": (\d+\.\d) instructions/element", line).group(1)) <= 12.0, line
    worst = float(re.fullmatch(r"reconstruct instructions/element \(worst store\): (\d+\.\d)",
                               out.strip().splitlines()[-1]).group(1))
    assert worst <= 12.0, out
