"""Compile the CPU kernels before a user's first generate: `python -m gear_hf.warmup` (`make venv` runs it).

numba compiles a kernel the first time it is called with a new set of argument types and keeps the machine code on
disk (`gear_hf.kernels.cpu.jit`); a later process loads it in about a second. The types do not depend on the model's
dtype (float32, bf16), head_dim, batch or padding, only on the storage format: the recommended configurations share
GearConfig()'s kernels, and the paper presets share them but for a few (statistics and outlier indices reach the
kernels as their bytes, whatever their format). So one short generate per shipped configuration, on a tiny
random-weight model, compiles everything a generate with it reaches on any model (`tests/test_warmup.py` checks it).

    python -m gear_hf.warmup                        # every shipped configuration (recommended + paper presets)
    python -m gear_hf.warmup --configs balanced     # GearConfig() alone
    python -m gear_hf.warmup --serving              # the kernels of gear_hf.vllm (`make venv-vllm` runs it)
    python -m gear_hf.warmup --jobs 1               # in this process (default: two worker processes)

numba compiles on one core, so the warm-up spreads over two worker processes: every configuration's generates on
one torch thread (which reach the serial kernels) in one, on two torch threads (the parallel kernels,
`kernels.cpu.threads`) in the other (README: the times on a fresh 2-core machine). The workers share numba's on-disk
cache, whose saves and loads take a file lock (`kernels.cpu.jit`).

`CompileWatch` counts the kernels numba compiles while it is open, and their seconds: the demo, lm-eval's
`gear_stats` and the benchmarks report compilation apart with it, and check that their timed runs compile nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib.util
import multiprocessing
import os
import sys
import time

from .config import GearConfig
from .config.names import METHODS
from .config.presets import RECOMMENDED

RECOMMENDED_NAMES = tuple(name for name, *_ in RECOMMENDED)
PAPER_PRESETS = tuple(f"{method}-{bits}" for method in METHODS if method != "fp16" for bits in (2, 4))
# GearConfig() first: what a user runs first is compiled first
SHIPPED = ("balanced", *(name for name in RECOMMENDED_NAMES if name != "balanced"), *PAPER_PRESETS)


def shipped_config(name: str) -> GearConfig:
    """A recommended configuration by name ("balanced" = GearConfig()), or a paper preset ("gear-2")."""
    return GearConfig.recommended(name=name) if name in RECOMMENDED_NAMES else GearConfig.preset(name)


class CompileWatch:
    """While open, counts the kernels numba compiles (gear_hf's own; a cache hit loads and is not counted) and the
    seconds spent compiling (helpers and numba's own library code compiled on the way included). Without numba
    installed it counts nothing."""

    def __init__(self) -> None:
        self.compiled: list[str] = []  # gear_hf kernels compiled, by name, once per new signature
        self.seconds = 0.0
        self._depth = 0
        self._started = 0.0
        self._listener = None

    @property
    def count(self) -> int:
        return len(self.compiled)

    def __enter__(self) -> "CompileWatch":
        if importlib.util.find_spec("numba") is None:
            return self
        from numba.core import event

        watch = self

        class _Listener(event.Listener):
            def on_start(self, ev):
                if watch._depth == 0:
                    watch._started = time.perf_counter()
                watch._depth += 1
                function = ev.data["dispatcher"].py_func
                if function.__module__.startswith("gear_hf."):
                    watch.compiled.append(function.__qualname__)

            def on_end(self, ev):
                watch._depth -= 1
                if watch._depth == 0:
                    watch.seconds += time.perf_counter() - watch._started

        self._listener = _Listener()
        event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc) -> None:
        if self._listener is not None:
            from numba.core import event

            event.unregister("numba:compile", self._listener)
            self._listener = None


def tiny_model(dtype="float32", head_dim: int = 64):
    """A 2-layer Llama with random weights and SmolLM2's head layout (9 query / 3 KV heads), for compiling."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = LlamaConfig(vocab_size=128, hidden_size=9 * head_dim, head_dim=head_dim, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
    spec._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(spec).to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval()
    model.generation_config.eos_token_id = None
    return model


# A generate on one torch thread reaches the serial kernels, on several the parallel ones (`kernels.cpu.threads`)
THREAD_COUNTS = (1, 2)


def warm_up_config(model, config: GearConfig, threads=THREAD_COUNTS) -> None:
    """Greedy generates of `model` with `config` that reach every kernel a generate with it can
    (`gear_hf.measure.warm_up_generates`: a prompt chunk and a decode chunk compressed, then a prompt chunk long
    enough for 16-bit outlier indices), each on two rows, the second left-padded, on each count of torch threads."""
    import torch

    from .api import enabled
    from .measure import max_positions, warm_up_generates

    before = torch.get_num_threads()
    try:
        with enabled(model, config), torch.no_grad():
            for prompt, new in warm_up_generates(config, max_positions(model)):
                ids = torch.randint(3, model.config.vocab_size, (2, prompt),
                                    generator=torch.Generator().manual_seed(0))
                mask = torch.ones_like(ids)
                mask[1, : min(5, prompt - 1)] = 0
                for count in threads:
                    torch.set_num_threads(count)
                    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0)
    finally:
        torch.set_num_threads(before)


def warm_up_kernels(names=SHIPPED, dtypes=("float32", "bfloat16"), report=print, threads=THREAD_COUNTS) -> CompileWatch:
    """Compile the CPU kernels that generates with the named configurations reach, in `dtypes`, on each count of
    torch threads (their seconds reported per configuration through `report`). Returns the watch over all of them."""
    configs = {name: shipped_config(name) for name in names}
    total = CompileWatch()
    with total:
        for dtype in dtypes:
            model = tiny_model(dtype)
            for name, config in configs.items():
                with CompileWatch() as watch:
                    start = time.perf_counter()
                    warm_up_config(model, config, threads)
                report(f"{name} ({dtype}){_on(threads)}: {watch.count} kernel signature(s) compiled in "
                       f"{watch.seconds:.1f} s ({time.perf_counter() - start:.1f} s in all)")
    return total


def warm_up_serving_config(config: GearConfig, dtype: str, threads=THREAD_COUNTS) -> None:
    """The paged attention gear_hf.vllm runs over pages of `config` in model dtype `dtype`, on each count of threads:
    one request of a page and an open block, one query token. (Its kernel types depend on the page format's field
    types and the model dtype only.)"""
    import numpy as np
    import torch

    from .kernels.cpu import paged
    from .vllm.format import PageFormat

    bs, d, H = 32, 64, 2
    model_dtype = getattr(torch, dtype)
    fmt = PageFormat(config, bs, d, model_dtype)
    if fmt.not_read_in_place():
        return
    pages = fmt.encode(torch.randn(1, H, bs, d).to(model_dtype), torch.randn(1, H, bs, d).to(model_dtype))
    layouts = [paged.page_layout(spec, tuple((name, *where) for name, where in layout.items()), bs, d)
               for spec, layout in zip(fmt.specs, fmt.layout)]
    tails = torch.randn(1, bs, H, d).to(model_dtype)
    tails = (tails.view(torch.int16) if model_dtype == torch.bfloat16 else tails).numpy()
    angles = torch.arange(2 * bs, dtype=torch.float32)[:, None] * torch.ones(d // 2)
    table = np.array([[0, -1]], dtype=np.int64)
    before = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            paged.paged_attention(np.ones((1, H, d), np.float32), np.array([0, 1], np.int64),
                                  np.array([bs + 8], np.int64), table, bs, angles.cos().numpy(),
                                  angles.sin().numpy(), pages.numpy(), *layouts, tails, tails, tails[:0], tails[:0],
                                  1, np.empty((1, H, d), np.float32))
    finally:
        torch.set_num_threads(before)


def warm_up_serving(names=SHIPPED, dtypes=("bfloat16", "float32"), report=print, threads=THREAD_COUNTS) -> CompileWatch:
    """`warm_up_serving_config` of the named configurations in `dtypes`."""
    total = CompileWatch()
    with total:
        for dtype in dtypes:
            for name in names:
                with CompileWatch() as watch:
                    warm_up_serving_config(shipped_config(name), dtype, threads)
                report(f"{name} ({dtype}, vLLM pages){_on(threads)}: {watch.count} kernel signature(s) compiled in "
                       f"{watch.seconds:.1f} s")
    return total


def _on(threads) -> str:
    """How a report line names the torch threads its generates ran on (nothing: each count)."""
    return "" if tuple(threads) == THREAD_COUNTS else f" on {', '.join(map(str, threads))} torch thread(s)"


def _warm_up_task(serving: bool, names: list[str], dtypes: list[str], threads: tuple) -> tuple[list[str], int, float]:
    """One worker's task: (its report lines, signatures compiled, compile seconds)."""
    lines: list[str] = []
    watch = (warm_up_serving if serving else warm_up_kernels)(names, dtypes, report=lines.append, threads=threads)
    return lines, watch.count, watch.seconds


def default_jobs() -> int:
    """One worker per core this process may use; 1 where the OS has no file locks (Windows): in this process."""
    if importlib.util.find_spec("fcntl") is None:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def _passive_openmp():
    """The workers' OpenMP threads sleep while they wait: a worker's two-thread generates (which reach the parallel
    kernels) run while another worker compiles on a core, and threads that spin for a descheduled partner made
    generates that compile nothing take seconds instead of a fraction of one. (Inherited by the spawned workers.)"""
    previous = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_WAIT_POLICY")
        else:
            os.environ["OMP_WAIT_POLICY"] = previous


def warm_up_in_workers(names, dtypes, serving: bool = False, report=print) -> tuple[int, float]:
    """The named configurations warmed up by a worker process per count of torch threads (`THREAD_COUNTS`): the
    serial kernels in one, the parallel ones in the other, each task's lines reported as it ends. Returns (signatures
    compiled, compile seconds), summed over the workers. (Both compile the kernels the two reach alike, such as the
    compression's, at the same time.)"""
    count, seconds = 0, 0.0
    context = multiprocessing.get_context("spawn")  # (no fork of a process that may hold OpenMP threads)
    with _passive_openmp(), concurrent.futures.ProcessPoolExecutor(len(THREAD_COUNTS), mp_context=context) as pool:
        tasks = [pool.submit(_warm_up_task, serving, list(names), list(dtypes), (threads,))
                 for threads in THREAD_COUNTS]
        for task in concurrent.futures.as_completed(tasks):
            lines, compiled, spent = task.result()
            for line in lines:
                report(line)
            count, seconds = count + compiled, seconds + spent
    return count, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gear_hf.warmup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(SHIPPED),
                        help=f"comma list of recommended names or paper presets (default: all shipped: "
                             f"{','.join(SHIPPED)})")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes (default: float32,bfloat16)")
    parser.add_argument("--serving", action="store_true",
                        help="the kernels gear_hf.vllm's backend runs (attention over pages) instead of the "
                             "Transformers path's")
    parser.add_argument("--jobs", type=int, default=None,
                        help="worker processes: 2 (the default on 2 or more cores) compiles the serial and the "
                             "parallel kernels side by side; 1: in this process")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs {args.jobs} is invalid; allowed: a positive number of worker processes")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for name in names:
        try:
            shipped_config(name)
        except ValueError as err:
            parser.error(f"--configs {name!r}: {err}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad:
        parser.error(f"--dtypes {bad[0]!r} is invalid; allowed: float32, bfloat16, float16")
    if importlib.util.find_spec("numba") is None:
        print("gear_hf.warmup: numba is not installed (pip install 'gear-hf[cpu]'): the CPU runs the torch path, "
              "which compiles nothing")
        return 0
    from .kernels.cpu.jit import cache_dir

    start = time.perf_counter()
    report = functools.partial(print, flush=True)
    jobs = min(default_jobs() if args.jobs is None else args.jobs, len(THREAD_COUNTS))
    if jobs > 1 and importlib.util.find_spec("fcntl") is None:  # (no file locks for the shared cache: one process)
        jobs = 1
    if jobs > 1:
        count, seconds = warm_up_in_workers(names, dtypes, args.serving, report)
    else:
        watch = (warm_up_serving if args.serving else warm_up_kernels)(names, dtypes, report=report)
        count, seconds = watch.count, watch.seconds
    workers = f", summed over {jobs} worker processes" if jobs > 1 else ""
    print(f"gear_hf.warmup: {count} kernel signature(s) compiled in {seconds:.0f} s{workers} "
          f"({time.perf_counter() - start:.0f} s in all), cached in {cache_dir()}")
    return 0


if __name__ == "__main__":
    from gear_hf.warmup import main as importable_main  # (whose functions the worker processes can unpickle)

    sys.exit(importable_main())
