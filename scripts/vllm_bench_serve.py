"""scripts/bench_vllm.py's serve section: `vllm serve` (stock, or with the GEAR plugin on) answering concurrent
OpenAI-client requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def serve_once(model: Path, gear: dict | None, work: Path, prompts: list[str], max_tokens: int = 64,
               port: int = 8537) -> dict:
    """Start the OpenAI-compatible server on `model` (GEAR_HF_VLLM_CONFIG=gear; None: stock), send every prompt at
    once from its own client thread (greedy, max_tokens each), stop it. Returns the answers and the seconds from the
    first request sent to the last answer."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("GEAR_HF_VLLM", None)
    if gear is not None:
        env.update(GEAR_HF_VLLM="1", GEAR_HF_VLLM_CONFIG=json.dumps(gear))
    log = work / f"serve_{'stock' if gear is None else 'gear'}.log"
    # not the `vllm serve` console script: in vllm-cpu 0.32.0 it asks importlib.metadata for a distribution named
    # "vllm" (the CPU build's is "vllm-cpu") and exits; the module entry point serves the same app
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
           "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "16", "--port", str(port),
           "--served-model-name", "smollm2"]
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

        def ask(prompt: str):
            return client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0)

        ask(prompts[0])  # (a warm-up request: kernels compiled before the timing)
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        seconds = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    gear_line = next((line for line in log.read_text().splitlines() if "GEAR pages" in line), "")
    tokens = sum(a.usage.completion_tokens for a in answers)
    return dict(requests=len(prompts), answered=sum(bool(a.choices[0].text) for a in answers),
                completion_tokens=tokens, seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds, 1),
                first_answer=answers[0].choices[0].text, gear_log=gear_line.split("] ", 1)[-1])
