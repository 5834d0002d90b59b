"""scripts/bench_gpu_generate.py runs end to end (--smoke: tiny Llama on the CPU) and refuses to measure without
CUDA; the GPU run itself is scripts/gpu_check.sh's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu_generate.py"


@pytest.mark.slow
def test_smoke_mode_writes_every_method(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--T", "40", "--new", "3", "--methods",
                           "dynamic,hf-quanto-int4,default,gear-2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_gpu_generate.json").read_text())["rows"]
    timed = [r for r in rows if "tokens_per_s" in r]
    assert {r["method"] for r in timed} == {"dynamic", "default", "gear-2"}
    for method in ("dynamic", "default", "gear-2"):
        kinds = {r["kind"]: r for r in timed if r["method"] == method}
        assert set(kinds) == {"probe", "equal memory"}
        assert kinds["equal memory"]["batch"] >= kinds["probe"]["batch"]  # the budget holds more than one row
        assert all(r["tokens_per_s"] > 0 and r["new_tokens"] == 3 for r in kinds.values())
    gear = [r for r in timed if r["method"] == "gear-2"]
    assert all(sum(r["decode_paths"].values()) == 2 * 3 for r in gear)  # 2 layers x 3 one-token steps
    quanto = [r for r in rows if r["method"] == "hf-quanto-int4"]
    assert len(quanto) >= 1 and ("skipped" in quanto[0] or "tokens_per_s" in quanto[0])
    assert (tmp_path / "bench_gpu_generate.csv").read_text().startswith("method,")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_it_says_so():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "--smoke" in done.stderr
