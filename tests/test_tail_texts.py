"""scripts/tail_texts.py: many texts' bench_tail results side by side, with a paired bootstrap interval."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import tail_texts  # noqa: E402


def _result(root: Path, model: str, text: int, kl: dict[str, float]) -> None:
    out = root / f"{model}-t{text}"
    out.mkdir(parents=True)
    (out / "tail.conditions.json").write_text(json.dumps({"model": model, "text": text}))
    lines = ["config,mean_owned,max_owned,mean_kl"] + [f"{c},3.5,3.6,{v}" for c, v in kl.items()]
    (out / "tail.csv").write_text("\n".join(lines) + "\n")


def test_mean_ratio_interval_and_texts_at_or_below(tmp_path):
    kls = [(0.010, 0.008), (0.020, 0.030), (0.012, 0.012), (0.006, 0.005)]  # (kivi-4, candidate) per text
    for text, (base, kl) in enumerate(kls):
        _result(tmp_path, "smollm2", text, {"kivi-4": base, "cand": kl})
    _result(tmp_path, "smollm2", 9, {"cand": 1.0})  # no baseline on this text: not compared
    rows = {r["config"]: r for r in tail_texts.summarize(tail_texts.collect([tmp_path])["smollm2"], "kivi-4", None)}
    cand = rows["cand"]
    assert cand["texts"] == 4
    assert cand["ratio"] == pytest.approx(sum(k for _, k in kls) / sum(b for b, _ in kls))
    assert cand["at_or_below"] == 3
    assert cand["low"] < cand["ratio"] < cand["high"]
    assert rows["kivi-4"]["ratio"] == rows["kivi-4"]["low"] == rows["kivi-4"]["high"] == 1.0


def test_a_config_measured_twice_on_a_text_is_an_error(tmp_path):
    _result(tmp_path / "a", "qwen25", 1, {"kivi-4": 0.01})
    _result(tmp_path / "b", "qwen25", 1, {"kivi-4": 0.02})
    with pytest.raises(SystemExit, match="measured twice"):
        tail_texts.collect([tmp_path])


def test_unknown_names_are_named(tmp_path):
    _result(tmp_path, "qwen25", 1, {"kivi-4": 0.01})
    found = tail_texts.collect([tmp_path])
    with pytest.raises(SystemExit, match="'steady' not measured; measured: kivi-4"):
        tail_texts.summarize(found["qwen25"], "steady", None)
    with pytest.raises(SystemExit, match="model 'llama' not measured"):
        tail_texts.main([str(tmp_path), "--model", "llama"])
