"""Shared helpers of the scripts/bench_*.py drivers and scripts/ablation.py (not a benchmark itself).

* `Conditions`: what a result depends on (CPU model, cores, threads, torch/transformers versions, load
  average before and after, whether the machine was shared), printed and written with every result.
* Methods by name: ``dynamic`` (transformers' DynamicCache), ``hf-quanto-int2/4`` and ``hf-hqq-int2/4``
  (transformers' QuantizedCache), and gear_hf presets ``fp16``, ``kivi-2``, ``gear-4``, ... (`gear_hf.demo`
  naming). `Method.generate` runs one greedy `generate` with that cache and times the decode steps.
* `PeakRSS`: peak resident memory during a call, sampled by a thread (ru_maxrss never goes down, so it
  cannot tell methods apart inside one process); freed heap is returned to the OS first (malloc_trim).
* `tensor_bytes`: an independent count of the bytes of every tensor reachable from an object (unique
  storages), used to cross-check `GearCache.memory_report()` and to measure HF's caches.
* GSM8K prompts are read from ../shared/data/gsm8k at run time; no dataset text is stored in the repo.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gear_hf.demo import StepClock  # the decode-step clock, shared with the demo

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO.parent / "shared" / "data" / "gsm8k"
RESULTS = REPO / "results"

GEAR_PRESETS = ("fp16", "kivi-2", "kcvt-2", "outlier-2", "gear-l-2", "gear-2",
                "kivi-4", "kcvt-4", "outlier-4", "gear-l-4", "gear-4")
HF_METHODS = ("hf-quanto-int2", "hf-quanto-int4", "hf-hqq-int2", "hf-hqq-int4")


# -- conditions -------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


@dataclass
class Conditions:
    extra: dict = field(default_factory=dict)
    load_before: tuple = field(default_factory=load_average)
    load_after: tuple | None = None
    started: float = field(default_factory=time.time)

    def finish(self) -> "Conditions":
        self.load_after = load_average()
        return self

    def as_dict(self) -> dict:
        import transformers

        cores = os.cpu_count() or 1
        load = max(self.load_before[0], (self.load_after or self.load_before)[0])
        return {
            "cpu": cpu_model(), "cores": cores, "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "load_avg_1m_before": round(self.load_before[0], 2),
            "load_avg_1m_after": round((self.load_after or self.load_before)[0], 2),
            # Our own process adds about torch_threads to the load: more than that means someone else ran too.
            "machine_shared": bool(load > torch.get_num_threads() + 0.5),
            "wall_s": round(time.time() - self.started, 1),
            **self.extra,
        }

    def markdown(self) -> str:
        d = self.as_dict()
        shared = ("**the machine was shared** (load average above this process's threads: timings are noisy; "
                  "compare ratios measured side by side, not absolute numbers)" if d["machine_shared"]
                  else "machine not visibly shared")
        extra = ", ".join(f"{k}={v}" for k, v in self.extra.items())
        return (f"Conditions: {d['cpu']} ({d['cores']} cores), torch threads {d['torch_threads']}, torch {d['torch']}, "
                f"transformers {d['transformers']}, Python {d['python']}; load average (1 min) {d['load_avg_1m_before']} "
                f"before / {d['load_avg_1m_after']} after: {shared}. {extra}. Wall time {d['wall_s']} s.")


def print_conditions(cond: Conditions) -> None:
    print(cond.markdown(), flush=True)


# -- files ------------------------------------------------------------------------------------------------------

def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format) with format like '{:.2f}'; missing/None values print '-'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and v != v) else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_summary(path: Path, title: str, cond: Conditions, body: str, command: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    command = command or " ".join([Path(sys.executable).name, *sys.argv])
    text = f"# {title}\n\nCommand: `{command}`\n\n{cond.markdown()}\n\n{body}\n"
    path.write_text(text)
    (path.with_suffix(".conditions.json")).write_text(json.dumps(cond.as_dict(), indent=2))


def median(values) -> float:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else float("nan")


# -- data and models ------------------------------------------------------------------------------------------

def gsm8k_prompts(n: int, shots: int = 8, data_dir: Path | None = None):
    """The first n GSM8K test problems as 8-shot CoT prompts (gear_hf.demo's format) with their gold answers."""
    from gear_hf.demo import gsm8k_problems

    data_dir = Path(data_dir or DATA_DIR)
    if not (data_dir / "test.jsonl").exists():
        raise SystemExit(f"GSM8K data not found in {data_dir} (expected test.jsonl and train.jsonl)")
    return gsm8k_problems(str(data_dir), hub=False, shots=shots)[:n]


def long_text(min_chars: int = 40000, data_dir: Path | None = None) -> str:
    """A long natural text for prefill lengths: GSM8K train problems with worked answers, concatenated."""
    data_dir = Path(data_dir or DATA_DIR)
    parts, size = [], 0
    for line in (data_dir / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        parts.append(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n")
        size += len(parts[-1])
        if size >= min_chars:
            break
    return "".join(parts)


def load_model(name: str, dtype: str = "bfloat16"):
    from gear_hf.weights import load_gguf_model

    model, tokenizer = load_gguf_model(name, dtype=getattr(torch, dtype), snapshot=True)
    model.eval()
    return model, tokenizer


def fixed_length_batch(tokenizer, prompts: list[str], length: int, batch: int) -> torch.Tensor:
    """[batch, length] ids: the last `length` tokens of each prompt (cycled), so rows need no padding and every
    row ends where its question asks for an answer."""
    rows = []
    for i in range(batch):
        ids = tokenizer(prompts[i % len(prompts)], return_tensors="pt").input_ids[0]
        if ids.shape[0] < length:
            filler = tokenizer(long_text(length * 8), return_tensors="pt").input_ids[0]
            ids = torch.cat([filler[: length - ids.shape[0]], ids])
        rows.append(ids[-length:])
    return torch.stack(rows)


# -- methods ----------------------------------------------------------------------------------------------------

def gear_config(name: str):
    from gear_hf.demo import method_config

    return method_config(name)


def method_bits(name: str) -> int | None:
    if name in ("dynamic", "fp16"):
        return None
    return int(name.rsplit("-", 1)[1].replace("int", ""))


def check_method(name: str) -> str:
    if name == "dynamic" or name in HF_METHODS:
        return name
    gear_config(name)  # raises SystemExit on a bad name
    return name


def parse_bench_args(parser, argv, name: str):
    """parser.parse_known_args: `make bench` hands one BENCH_ARGS to every scripts/bench_*.py, so options meant
    for another benchmark are reported and ignored, not fatal."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"{name}: ignoring options meant for other benchmarks: {unknown}", file=sys.stderr)
    return args


def select_methods(listed: str | None, default) -> tuple[list[str], list[str]]:
    """(methods to run, HF methods skipped because their backend is not installed) from a comma list or the
    default; unknown names raise."""
    methods = [check_method(m.strip()) for m in listed.split(",") if m.strip()] if listed else list(default)
    skipped = [m for m in methods if m in HF_METHODS and not hf_backend_available(m.split("-")[1])]
    return [m for m in methods if m not in skipped], skipped


def hf_backend_available(backend: str) -> bool:
    import importlib.util

    module = {"quanto": "optimum.quanto", "hqq": "hqq"}[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def make_hf_quantized_cache(model, name: str, residual_length: int = 128, group_size: int = 64):
    """transformers' QuantizedCache for 'hf-quanto-int2' etc. (its defaults: per-token axes, post-RoPE)."""
    from transformers import QuantizedCache

    _, backend, bits = name.split("-")
    return QuantizedCache(backend=backend, config=model.config, nbits=int(bits.replace("int", "")),
                          q_group_size=group_size, residual_length=residual_length)


def cache_arg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def quantile(values, q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    pos = q * (len(values) - 1)
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so that the RSS before a
    measured call does not include what an earlier call freed but the allocator kept."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident set size (bytes) of this process while the block runs, sampled every `interval` s."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.before = self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        release_free_memory()
        self.before = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


@dataclass
class GenerateResult:
    tokens: torch.Tensor  # [B, new]
    decode_steps: int
    decode_seconds: float
    prefill_seconds: float
    peak_rss: int
    rss_before: int
    cache: object
    step_seconds: list = field(default_factory=list)


@torch.no_grad()
def run_generate(model, input_ids: torch.Tensor, method: str, max_new_tokens: int, *, force_length: bool = True,
                 tokenizer=None, stop_strings=None, attention_mask=None, hf_residual: int = 128) -> GenerateResult:
    """One greedy `generate` with `method`'s cache; decode timing from the step clock."""
    import gear_hf
    from transformers import LogitsProcessorList

    kwargs: dict = {}
    if method in HF_METHODS:
        gear_hf.disable(model)
        kwargs[cache_arg(model)] = make_hf_quantized_cache(model, method, residual_length=hf_residual)
    elif method == "dynamic":
        gear_hf.disable(model)
    else:
        gear_hf.enable(model, gear_config(method))
    if force_length:
        kwargs["min_new_tokens"] = max_new_tokens
    if stop_strings:
        kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    clock = StepClock()
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    start = time.perf_counter()
    with PeakRSS() as rss:
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]),
                             **kwargs)
    steps, seconds = clock.decode()
    prefill = (clock.times[0] - start) if clock.times else float("nan")
    cache = kwargs.get(cache_arg(model))
    if cache is None and gear_hf.is_enabled(model):
        cache = gear_hf.last_cache(model)
    return GenerateResult(out[:, input_ids.shape[1]:], steps, seconds, prefill, rss.peak, rss.before, cache,
                          clock.step_seconds())


# -- independent byte count -------------------------------------------------------------------------------------

def tensor_bytes(obj, skip_types: tuple = ()) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` through attributes, dicts, lists and tuples,
    and through tensor subclasses' inner tensors (quanto's packed tensors). Independent of any memory report."""
    seen_objs: set[int] = set()
    storages: dict[tuple, int] = {}

    def visit(x, depth=0):
        if depth > 12 or id(x) in seen_objs:
            return
        seen_objs.add(id(x))
        if isinstance(x, torch.Tensor):
            inner = getattr(x, "__tensor_flatten__", None)
            if inner is not None and type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                names, _ = x.__tensor_flatten__()
                for name in names:
                    visit(getattr(x, name), depth + 1)
                return
            if x.numel() == 0:
                return
            storage = x.untyped_storage()
            storages[(storage.data_ptr(), x.device.type)] = storage.nbytes()
            return
        if isinstance(x, (torch.nn.Module, type)) or isinstance(x, skip_types) or callable(x) and not hasattr(x, "__dict__"):
            return
        if isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                visit(v, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (str, bytes, int, float)):
            for v in vars(x).values():
                visit(v, depth + 1)

    visit(obj)
    return sum(storages.values())
