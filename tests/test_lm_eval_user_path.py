"""The user's path through the lm-eval CLI and the demo: the README's commands run as written, a missing
offline data directory is one line, `--help` has a gear_hf section, results show KV bits and tokens/s, gear_hf's
INFO lines are visible, `accelerate launch --num_processes 2` without --multi_gpu stops with what to run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from gear_hf.gsm8k import DATA_DIR_ENV  # noqa: E402
from gear_hf.lm_eval import sharding  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (DATA_DIR_ENV, "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)
    return env


def _run(argv: list[str], timeout: int = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=_env(**env), timeout=timeout, cwd=REPO)


def _data_dir() -> Path:
    path = REPO.parent / "shared" / "data"
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"no offline data at {path}")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from gear_hf.lm_eval.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def readme_command(prefix: str) -> list[str]:
    """The README's command line that starts with `prefix` (one line of a ```bash block)."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


@pytest.mark.slow
def test_readme_lm_eval_command_as_written(tiny):
    """The README's lm-eval command, only MODEL replaced; results show KV bits/elem and tokens/s,
    gear_hf's INFO lines are on the console."""
    _data_dir()
    argv = [str(tiny) if a == "MODEL" else a.replace("pretrained=MODEL,", f"pretrained={tiny},")
            for a in readme_command(".venv/bin/gear-lm-eval ")]
    assert any(f"pretrained={tiny}," in a for a in argv)
    argv[0] = str(BIN / "gear-lm-eval")  # the same console script, in whichever environment runs the tests
    proc = _run(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("gear_hf: gear-2 | KV bits/elem ")]
    assert len(summary) == 1, proc.stdout
    bits, speed = re.search(r"KV bits/elem ([\d.]+) \| tokens/s ([\d.]+)", summary[0]).groups()
    assert float(bits) > 0 and float(speed) > 0
    assert "[gear_hf.lm_eval.model] gear_hf: gear-2" in proc.stderr  # gear_hf's INFO line, visible


@pytest.mark.slow
def test_offline_without_data_dir_is_one_line(tiny):
    proc = _run([str(BIN / "gear-lm-eval"), "--model", "gear_hf", "--model_args", f"pretrained={tiny},preset=gear-2",
                 "--tasks", "gsm8k_cot_gear", "--limit", "1", "--gen_kwargs", "max_gen_toks=2"])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gear-lm-eval: error: no local data directory") and DATA_DIR_ENV in last
    assert "--metadata" in last and "data_dir" in last
    assert "Traceback" not in proc.stderr


def test_help_has_a_gear_hf_section():
    proc = _run([str(BIN / "gear-lm-eval"), "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = proc.stdout[proc.stdout.index("gear_hf (this wrapper"):]
    for needle in ("preset", "gear-2", "gsm8k_cot_gear", "GEAR_HF_DATA_DIR", "--multi_gpu", "KV",
                   "recommended (by purpose: smallest | balanced | precise)",
                   "gear_warmup"):
        assert needle in section, needle


def test_lm_eval_models_entry_point():
    (entry,) = [e for e in importlib.metadata.entry_points(group="lm_eval.models") if e.name == "gear_hf"]
    from gear_hf.lm_eval.model import GearHFLM

    assert entry.load() is GearHFLM


@pytest.mark.parametrize("cmdline,stops", [
    (["python", "-m", "accelerate.commands.launch", "--num_processes", "2", "-m", "gear_hf.lm_eval"], True),
    ([".venv/bin/accelerate", "launch", "--cpu", "--num_processes=4", "-m", "gear_hf.lm_eval"], True),
    (["accelerate", "launch", "--num_processes", "1", "-m", "gear_hf.lm_eval"], False),
    (["bash"], False),
])
def test_unsharded_accelerate_launch_stops(cmdline, stops, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if stops:
        with pytest.raises(SystemExit, match="--multi_gpu --num_processes N"):
            sharding.refuse_unsharded_launch(cmdline)
    else:
        sharding.refuse_unsharded_launch(cmdline)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a real multi-process launch: nothing to say
    sharding.refuse_unsharded_launch(cmdline)


@pytest.mark.slow
def test_accelerate_launch_without_multi_gpu_stops_with_what_to_run(tiny):
    proc = _run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "gear_hf.lm_eval", "--model", "gear_hf",
                 "--model_args", f"pretrained={tiny}", "--tasks", "gsm8k_cot_gear", "--limit", "1"], timeout=200)
    assert proc.returncode != 0
    assert "gear-lm-eval: error: accelerate launch asked for 2 processes but started one" in proc.stderr
    assert "accelerate launch --multi_gpu --num_processes N" in proc.stderr


@pytest.mark.slow
@pytest.mark.realweights
def test_demo_as_in_the_readme(tmp_path):
    """`make demo` (here with a short run): SmolLM2 on the built-in 8-shot one-step problems,
    float32, the baseline labelled by its dtype, the default first after it, tokens/s after a warm-up shown apart."""
    import realweights

    realweights.require("smollm2")
    make_line = [a for a in readme_command("make demo DEMO_ARGS=")]
    demo_args = shlex.split(make_line[2].split("=", 1)[1])
    rows = tmp_path / "rows.json"
    proc = _run([sys.executable, "-m", "gear_hf.demo", *demo_args, "--methods", "default,gear-2", "--json", str(rows)],
                timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(llama, float32), prompts: built-in 8-shot one-step CoT problems" in proc.stdout
    assert "method | config | KV bits/elem | tokens/s | compile s" in proc.stdout
    assert "Pass `dtype=torch.float32`" not in proc.stderr  # transformers' advice when the demo ran bf16
    data = json.loads(rows.read_text())
    assert [r["method"] for r in data] == ["float32 (uncompressed)", "default (GearConfig())", "gear-2"]
    base, default, gear2 = data
    assert base["bits_per_element"] == 32 and max(gear2["bits_per_element"], default["bits_per_element"]) < 32
    assert all(r["warmup_seconds"] > 0 for r in data) and base["prompt_tokens"] > 300  # 4 worked exemplars
    assert all(r["timed_compile_seconds"] == 0 for r in data)  # the warm-up reached every kernel the rows use
