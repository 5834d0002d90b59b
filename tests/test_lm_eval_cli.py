"""`python -m gear_hf.lm_eval` end to end: a tiny random Llama (with a real BPE tokenizer) on every task with
`--limit 2`, SmolLM2 real weights on one task, a `--model_args` error, and loglikelihood == stock `hf`."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from gear_hf.config import CONFIG_VERSION  # noqa: E402
from gear_hf.lm_eval import answers as A  # noqa: E402
from gear_hf.lm_eval.task_utils import DATA_DIR_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    path = Path(os.environ.get(DATA_DIR_ENV) or REPO.parent / "shared" / "data")
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"no offline data at {path} (set ${DATA_DIR_ENV})")
    return path


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return shared_data_dir()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, data_dir) -> Path:
    from gear_hf.lm_eval.tiny import build_tiny_model

    texts = [json.loads(line)["question"] for line in (data_dir / "gsm8k" / "train.jsonl").open()][:2000]
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), texts=texts)


def run_cli(args: list[str], *, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}  # data dir only as given here
    full_env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    return subprocess.run([sys.executable, "-m", "gear_hf.lm_eval", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


def read_output(out_dir: Path) -> tuple[dict, dict[str, list[dict]]]:
    results = [json.loads(Path(p).read_text()) for p in glob.glob(str(out_dir / "*" / "results_*.json"))]
    assert len(results) == 1, results
    samples = {}
    for path in glob.glob(str(out_dir / "*" / "samples_*.jsonl")):
        task = Path(path).name[len("samples_"):].rsplit("_20", 1)[0]
        samples[task] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return results[0], samples


@pytest.mark.slow
def test_every_task_end_to_end(tiny_model, data_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["--model", "gear_hf",
                    "--model_args", f"pretrained={tiny_model},preset=gear,bits=2,buffer_size=64,dtype=float32",
                    "--tasks", "gsm8k_cot_gear,aqua_cot_gear,bbh_cot_gear", "--limit", "2",
                    "--gen_kwargs", "max_gen_toks=8", "--batch_size", "16",
                    "--metadata", json.dumps({"data_dir": str(data_dir)}),
                    "--output_path", str(out), "--log_samples"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Including path: {REPO / 'eval_tasks'}" in proc.stderr or "Including path:" in proc.stderr
    results, samples = read_output(out)
    subtasks = {f"bbh_cot_gear_{s}" for s in A.BBH_SUBTASKS}
    assert {"gsm8k_cot_gear", "aqua_cot_gear", "bbh_cot_gear"} | subtasks <= set(results["results"])
    for task in ["gsm8k_cot_gear", "aqua_cot_gear", *subtasks]:
        assert results["n-samples"][task]["effective"] == 2, task
        for filt in ("strict-match", "flexible-extract"):
            assert f"exact_match,{filt}" in results["results"][task], task
        assert len(samples[task]) == 2 * 2  # 2 docs x 2 filters
    shots = {"gsm8k_cot_gear": 8, "aqua_cot_gear": 8, "bbh_cot_gear_navigate": 3}
    for task, k in shots.items():
        prompt = samples[task][0]["arguments"]["gen_args_0"]["arg_0"]
        assert prompt.count("Q: ") == k + 1, task
        assert samples[task][0]["arguments"]["gen_args_0"]["arg_1"]["max_gen_toks"] == 8
    group = results["results"]["bbh_cot_gear"]
    assert "exact_match,strict-match" in group and "exact_match,flexible-extract" in group
    # generation went through the GEAR cache, with the requested config
    config = results["config"]
    assert config["gear_method"] == "gear-2" and config["gear_config"]["buffer_size"] == 64
    stats = config["gear_stats"]
    assert stats["sequences"] == 58 and stats["new_tokens"] > 0 and stats["tokens_per_second"] > 0
    assert stats["kv_reports"] == stats["calls"] and stats["kv_bits_per_element"] is not None
    assert stats["warmup_seconds"] > 0 and config["gear_config"]["gear_config_version"] == CONFIG_VERSION


@pytest.mark.slow
def test_bad_model_args_fail_clearly(tiny_model, data_dir):
    proc = run_cli(["--model", "gear_hf", "--model_args", f"pretrained={tiny_model},preset=gear,bits=5",
                    "--tasks", "gsm8k_cot_gear", "--limit", "1"], env={DATA_DIR_ENV: str(data_dir)})
    assert proc.returncode == 2  # a usage error, as argparse reports one
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "gear-lm-eval: error: gear_hf --model_args: bits=5 is invalid; allowed: 2, 3, 4, 8 (sets key_bits " \
                   "and value_bits)"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("warmup", [True, False])
def test_recommended_is_recorded_by_name_and_the_warm_up_apart(tiny_model, warmup):
    """recommended=smallest is named in the results; tokens/s is timed after an untimed warm-up
    generate, whose seconds are reported apart (gear_warmup=false: no warm-up)."""
    from lm_eval.api.instance import Instance

    from gear_hf import GearConfig
    from gear_hf.lm_eval.cli import run_summary
    from gear_hf.lm_eval.model import GearHFLM
    from gear_hf.measure import max_positions, warm_up_generates

    lm = GearHFLM(pretrained=str(tiny_model), recommended="smallest", gear_warmup=warmup, dtype="float32",
                  device="cpu", batch_size=1)
    gen = [Instance(request_type="generate_until", doc={}, arguments=("Q: 3 boxes of 4 pens.\nA:", {
        "until": ["\n\n"], "max_gen_toks": 4, "do_sample": False}), idx=0)]
    lm.generate_until(gen, disable_tqdm=True)
    info = lm.get_model_info()
    config = GearConfig.recommended(name="smallest")
    assert info["gear_name"] == info["gear_stats"]["gear_name"] == "recommended=smallest"
    assert info["gear_method"] == config.describe() and GearConfig.from_dict(info["gear_config"]) == config
    stats = info["gear_stats"]
    assert stats["calls"] == 1 and stats["new_tokens"] <= 4  # the warm-up is in neither the calls nor the tokens
    line = run_summary(info)
    assert line.startswith(f"gear_hf: recommended=smallest ({config.describe()}) | KV bits/elem ")
    if warmup:
        runs = warm_up_generates(config, max_positions(lm.model))  # (every warm-up generate's new tokens)
        assert stats["warmup_seconds"] > 0 and stats["warmup_tokens"] == sum(new for _, new in runs)
        assert stats["warmup_tokens"] >= config.buffer_size + 1
        assert f"after a {stats['warmup_seconds']:.1f} s warm-up, kernel compilation excluded" in line
        assert stats["timed_compile_seconds"] == 0 and 0 <= stats["compile_seconds"] <= stats["warmup_seconds"]
    else:
        assert stats["warmup_seconds"] is None and "warm-up" not in line


@pytest.mark.slow
@pytest.mark.realweights
def test_smollm2_gguf_real_weights(data_dir, tmp_path):
    import realweights

    gguf = realweights.require("smollm2")
    out = tmp_path / "out"
    proc = run_cli(["--model", "gear_hf",
                    "--model_args", f"pretrained={gguf.parent},gguf_file={gguf.name},preset=gear,bits=4,dtype=float32",
                    "--tasks", "gsm8k_cot_gear", "--limit", "1", "--num_fewshot", "2",
                    "--gen_kwargs", "max_gen_toks=24",
                    "--output_path", str(out), "--log_samples"], env={DATA_DIR_ENV: str(data_dir)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results, samples = read_output(out)
    stats = results["config"]["gear_stats"]
    # a 2-shot prompt of ~250 tokens, compressed to 4 bits apart from the full-precision buffer: smaller
    # than an fp16 cache even in this fp32 model (memory_report counts allocated capacity)
    assert stats["kv_bits_per_element"] < 16, stats
    resp = samples["gsm8k_cot_gear"][0]["resps"][0][0]
    assert any(ch.isdigit() for ch in resp), resp  # a real model continues the CoT with numbers


@pytest.mark.slow
def test_loglikelihood_is_stock_and_generation_uses_gear(tiny_model):
    """Loglikelihood requests run the stock forward (no cache): identical to lm-eval's `hf` model."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    import gear_hf
    from gear_hf.lm_eval.model import GearHFLM

    reqs = [("Q: There are 3 boxes with 4 pens each.\nA:", " The answer is 12."),
            ("Answer Choices: (A) 1 (B) 2\nA:", " The answer is (B).")]

    def instances():
        return [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(reqs)]

    stock = HFLM(pretrained=str(tiny_model), dtype="float32", device="cpu", batch_size=2)
    expected = stock.loglikelihood(instances(), disable_tqdm=True)
    del stock
    lm = GearHFLM(pretrained=str(tiny_model), preset="gear", bits=2, dtype="float32", device="cpu", batch_size=2)
    assert gear_hf.is_enabled(lm.model)
    got = lm.loglikelihood(instances(), disable_tqdm=True)
    assert got == expected
    assert gear_hf.last_cache(lm.model) is None  # no generate yet: loglikelihood built no GEAR cache
    gen = [Instance(request_type="generate_until", doc={}, arguments=(reqs[0][0], {"until": ["\n\n"],
                    "max_gen_toks": 4, "do_sample": False}), idx=0)]
    lm.generate_until(gen, disable_tqdm=True)
    assert isinstance(gear_hf.last_cache(lm.model), gear_hf.GearCache)
    assert lm.gear_stats.calls == 1 and lm.gear_stats.kv_reports == 1
