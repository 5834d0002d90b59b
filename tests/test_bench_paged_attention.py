"""scripts/bench_paged_attention.py runs end to end (--smoke: tiny shapes in Triton's CPU interpreter) and its rows
hold what they say: every format's output within bf16 rounding of the float32 oracle, pages smaller than the dense
cache; the GPU run itself is scripts/gpu_check.sh's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_paged_attention.py"


@pytest.mark.slow
def test_smoke_mode_writes_every_format(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--requests", "2", "--context", "100", "--iters",
                           "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench_paged_attention.json").read_text())["rows"]}
    assert set(rows) == {"sdpa", "fp16", "default", "kivi-4", "gear-2"}
    for name in ("fp16", "default", "kivi-4", "gear-2"):
        assert rows[name]["ms"] > 0 and rows[name]["max_rel_error"] < 1e-2, rows[name]
    assert rows["fp16"]["bytes"] == rows["sdpa"]["bytes"]
    assert rows["default"]["bytes_per_token"] < rows["sdpa"]["bytes_per_token"] / 2.5
