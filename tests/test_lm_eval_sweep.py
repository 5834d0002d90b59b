"""scripts/sweep.py: a tiny grid end to end (CSV/JSON/Markdown/PNG, agreement with fp16) and resuming; the
agreement arithmetic on synthetic samples."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from gear_hf.lm_eval.task_utils import DATA_DIR_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _sweep_module():
    spec = importlib.util.spec_from_file_location("gear_sweep", REPO / "scripts" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_agreement_from_samples():
    sweep = _sweep_module()

    def s(doc, answer, resp, filt="flexible-extract", task="t"):
        return {(task, doc, filt): {"answer": answer, "resp": resp}}

    base = {**s(0, "18", "abc The answer is 18."), **s(1, "5", "x = 5"), **s(2, "7", "seven 7"),
            **s(0, "18", "ignored", filt="strict-match")}
    other = {**s(0, "18", "abc The answer is 18."), **s(1, "6", "x = 6"), **s(2, "7", "seven is 7")}
    got = sweep.agreement(base, other)
    assert got["docs"] == 3
    assert got["answer_agreement"] == pytest.approx(2 / 3)
    assert got["identical_generations"] == pytest.approx(1 / 3)
    assert got["matched_prefix"] == pytest.approx((1 + 4 / 5 + 6 / 10) / 3)
    assert sweep.agreement(base, {})["answer_agreement"] is None


def test_cells_grid():
    sweep = _sweep_module()
    cells = sweep.make_cells(["gear", "fp16", "kivi"], [2, 4], {"buffer_size": 128})
    assert [c.name for c in cells] == ["fp16", "gear-2", "gear-4", "kivi-2", "kivi-4"]
    assert all(c.config.buffer_size == 128 for c in cells)


@pytest.mark.slow
def test_sweep_end_to_end_and_resume(tmp_path):
    from gear_hf.lm_eval.tiny import build_tiny_model

    data_dir = Path(os.environ.get(DATA_DIR_ENV) or REPO.parent / "shared" / "data")
    if not (data_dir / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"no offline data at {data_dir}")
    model = build_tiny_model(tmp_path / "tiny")
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "scripts" / "sweep.py"), "--pretrained", str(model), "--presets",
           "fp16,kivi", "--bits", "2", "--tasks", "gsm8k_cot_gear", "--limit", "2", "--num_fewshot", "1",
           "--gen_kwargs", "max_gen_toks=4", "--batch_size", "2", "--data_dir", str(data_dir), "--out", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 to run" in proc.stdout
    for name in ("results.csv", "results.json", "results.md", "accuracy_vs_kv.png", "conditions.json"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["cell"] for r in rows] == ["fp16", "kivi-2"]
    assert all(r["n"] == "2" and r["kv_bits_per_element"] for r in rows)
    assert rows[0]["answer_agreement_with_fp16"] == "" and rows[1]["answer_agreement_with_fp16"] != ""
    md = (out / "results.md").read_text()
    assert "| kivi-2 | gsm8k_cot_gear | 2 |" in md and "git_commit" in md and "dtype" in md
    record = json.loads((out / "cells" / "kivi-2" / "gsm8k_cot_gear.json").read_text())
    assert record["gear_config"]["method"] == "kivi" and record["tokens_per_second"] > 0

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "2 already done, 0 to run" in again.stdout
