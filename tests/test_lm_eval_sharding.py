"""Data parallelism over 2 CPU processes (`accelerate launch -m gear_hf.lm_eval`): the documents are split
between the processes, the results are gathered on rank 0, and every metric and every generated answer equals
the 1-process run. lm-eval alone shards only when more than one CUDA device exists."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from gear_hf.lm_eval.task_utils import DATA_DIR_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = "gsm8k_cot_gear,bbh_cot_gear_boolean_expressions"
LIMIT = 3  # odd: rank 0 gets 2 documents per task, rank 1 gets 1 (lm-eval pads its requests)


def shared_data_dir() -> Path:
    path = Path(os.environ.get(DATA_DIR_ENV) or REPO.parent / "shared" / "data")
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"no offline data at {path} (set ${DATA_DIR_ENV})")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(launcher: list[str], model_dir: Path, out: Path, data_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # one thread per process in both runs, so the float reductions (and greedy tokens) are the same
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               **{DATA_DIR_ENV: str(data_dir)})
    args = ["--model", "gear_hf", "--model_args", f"pretrained={model_dir},preset=kivi,bits=2,dtype=float32",
            "--tasks", TASKS, "--limit", str(LIMIT), "--gen_kwargs", "max_gen_toks=8",
            "--output_path", str(out), "--log_samples"]
    return subprocess.run([*launcher, "-m", "gear_hf.lm_eval", *args], capture_output=True, text=True, env=env,
                          timeout=400, cwd=REPO)


def _read(out: Path):
    (results_path,) = glob.glob(str(out / "*" / "results_*.json"))
    results = json.loads(Path(results_path).read_text())
    answers = {}
    for path in glob.glob(str(out / "*" / "samples_*.jsonl")):
        for line in Path(path).read_text().splitlines():
            s = json.loads(line)
            # resps[0][0]: lm-eval pads a rank's requests by repeating its last one, whose resps then hold
            # copies; the first entry is the real generation (and the one the filters take)
            answers[(s["doc"].get("question") or s["doc"]["input"], s["filter"])] = (
                s["doc_id"], s["resps"][0][0], s["filtered_resps"][0] if isinstance(s["filtered_resps"], list)
                else s["filtered_resps"])
    return results, answers


@pytest.mark.slow
def test_two_cpu_processes_equal_one(tmp_path):
    from gear_hf.lm_eval.tiny import build_tiny_model

    data_dir = shared_data_dir()
    texts = [json.loads(line)["question"] for line in (data_dir / "gsm8k" / "train.jsonl").open()][:2000]
    model_dir = build_tiny_model(tmp_path / "tiny", texts=texts)

    one = _run([sys.executable], model_dir, tmp_path / "one", data_dir)
    assert one.returncode == 0, one.stderr[-4000:]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port())]
    two = _run(launcher, model_dir, tmp_path / "two", data_dir)
    assert two.returncode == 0, two.stderr[-4000:]

    r1, a1 = _read(tmp_path / "one")
    r2, a2 = _read(tmp_path / "two")
    assert r2["config"]["gear_world_size"] == 2 and r1["config"]["gear_world_size"] == 1
    # rank 0 generated only its share: 2 of the 3 documents of each task
    assert r2["config"]["gear_stats"]["sequences"] < r1["config"]["gear_stats"]["sequences"] == 2 * LIMIT
    assert r2["n-samples"] == r1["n-samples"]
    assert r2["results"] == r1["results"]
    assert len(a1) == 2 * LIMIT * 2  # tasks x docs x filters
    assert a2 == a1
