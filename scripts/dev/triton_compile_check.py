"""Compile, for a real GPU and on a machine without one, every Triton kernel variant the kernel tests launch and
the GPU-only configurations (tests/test_kernels_gpu.py's, the GPU benchmarks') would launch.

    python scripts/dev/triton_compile_check.py                 # record the tests' launches, then compile for sm_90
    python scripts/dev/triton_compile_check.py --arch 90 80 --tests tests/test_kernels_reconstruct.py
    python scripts/dev/triton_compile_check.py --no-tests      # only the GPU-only configurations
    .venv/bin/python scripts/dev/triton_compile_check.py --record-only --record L.jsonl   # tests: this interpreter
    /other/venv/bin/python scripts/dev/triton_compile_check.py --compile L.jsonl          # compile: that Triton

Why: the interpreter (TRITON_INTERPRET=1) runs the kernels' Python, not Triton's compiler, which rejects code the
interpreter accepts (chained comparisons, code after a static `if` that returns, constexprs made of a jit
function's return). `scripts/dev/compile_check.py` compiles a few planned launches; this compiles all of them.

1. record: pytest runs the given test files under the interpreter with this file as a plugin (`-p`). Each call of a
   launcher (`reconstruct_run`, `decode_attention`, `quantize_pack`) still runs interpreted, and is also planned
   (`_plan=`) as on a GPU (`interpreting()` False: 16-bit dots, RoPE in bf16 arithmetic, hardware sin/cos): the
   launch's kernel, argument types, specialisation (16-byte-aligned pointers, integers equal to 1 or divisible by
   16) and constexprs go to a file of JSON lines.
2. cases: the GPU-only configurations, planned directly on small CPU caches (no interpreter needed).
3. compile: without the interpreter, every distinct launch is compiled by `triton.compile` for
   GPUTarget("cuda", arch, 32) down to a cubin (ptxas of the triton wheel; `compile_check._compile`, Triton's own
   binder for the specialisation). Exit status 1 when any fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD_ENV = "GEAR_TRITON_LAUNCH_RECORD"
DEFAULT_TESTS = ["tests/test_kernels_reconstruct.py", "tests/test_kernels_decode.py", "tests/test_kernels_tc.py",
                 "tests/test_kernels_quant.py", "tests/test_triton_tail.py"]
# (module, launcher): every host function that launches a kernel, each with a `_plan` argument
LAUNCHERS = [("gear_hf.kernels.triton.reconstruct", "reconstruct_run"),
             ("gear_hf.kernels.triton.launch", "decode_attention"),
             ("gear_hf.kernels.quant", "quantize_pack")]


# -- launches as JSON ------------------------------------------------------------------------------------------
def _encode(value):
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):  # what a launch specialises a pointer on: its type and 16-byte alignment
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.dtype):
        return {"tl": value.name}
    if isinstance(value, tl.constexpr):
        return _encode(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a launch argument of type {type(value).__name__}")


def _decode(value):
    import torch
    import triton.language as tl

    if isinstance(value, dict) and "tensor" in value:
        base = torch.empty(64, dtype=getattr(torch, value["tensor"]))  # (CPU allocations are 64-byte aligned)
        return base if value["aligned"] else base[1:]
    if isinstance(value, dict) and "tl" in value:
        return tl.dtype(value["tl"])
    return value


def _kernel_name(kernel) -> str:
    fn = kernel.fn
    return f"{fn.__module__}:{fn.__name__}"


def encode_plan(plan) -> list[str]:
    return [json.dumps({"kernel": _kernel_name(kernel), "args": [_encode(a) for a in args],
                        "kwargs": {k: _encode(v) for k, v in kwargs.items()}}, sort_keys=True)
            for kernel, _grid, args, kwargs in plan]


# -- 1. record (pytest plugin) ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _as_on_a_gpu():
    """The launchers' host code deciding as on a GPU: `interpreting()` False in their modules."""
    modules = [importlib.import_module(m) for m, _ in LAUNCHERS]
    saved = [m.interpreting for m in modules]
    for m in modules:
        m.interpreting = lambda: False
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.interpreting = f


def _recording(launcher, seen: set, path: str):
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        if kwargs.get("_plan") is None:
            plan = []
            with _as_on_a_gpu():
                launcher(*args, **{**kwargs, "_plan": plan})
            with open(path, "a") as f:
                for line in encode_plan(plan):
                    if line not in seen:
                        seen.add(line)
                        f.write(line + "\n")
        return launcher(*args, **kwargs)

    launch.__wrapped_launcher__ = launcher
    return launch


def pytest_configure(config):
    """Wrap every launcher, wherever a module already holds it (modules imported later take the wrapper)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    from gear_hf import kernels

    if not kernels.interpreting():
        raise RuntimeError("record the launches under the interpreter (TRITON_INTERPRET=1)")
    importlib.import_module("gear_hf.kernels.decode")
    seen: set = set()
    for module_name, name in LAUNCHERS:
        original = getattr(importlib.import_module(module_name), name)
        wrapped = _recording(original, seen, path)
        for module in list(sys.modules.values()):
            if getattr(module, "__dict__", {}).get(name) is original:
                setattr(module, name, wrapped)


# -- 2. the GPU-only configurations -----------------------------------------------------------------------------
def gpu_only_cases():
    """(label, plan) of tests/test_kernels_gpu.py's and the GPU benchmarks' configurations (Llama-3-8B heads: 32 query
    heads, 8 KV heads, head_dim 128; 16-bit models), on small CPU caches: the fused decode (register and tensor-core
    kernels), the reconstruction of every store (keys rotated) and the quantizer at their sizes."""
    import torch

    from gear_hf.cache.fused import build_cache, cache_decode_attention
    from gear_hf.config import GearConfig
    from gear_hf.kernels.quant import quantize_pack
    from gear_hf.kernels.triton.reconstruct import reconstruct_run
    from gear_hf.kernels.views import ChunkRunView

    configs = {
        "gear-2": GearConfig.preset("gear", bits=2), "gear-4": GearConfig.preset("gear", bits=4),
        "kivi-2": GearConfig.preset("kivi", bits=2), "gear-l-2": GearConfig.preset("gear-l", bits=2),
        "GearConfig()": GearConfig(), "compact": GearConfig.recommended(name="compact"),
        "gear-3 int8 rotated values": GearConfig.preset("gear", bits=3, factor_bits=8, rotation="values"),
        "gear-l-2 k32/v64 rotated": GearConfig.preset("gear-l", bits=2, key_group_size=32, value_group_size=64,
                                                      rotation="both", factor_bits=8),
    }
    hkv, d = 2, 128
    for name, cfg in configs.items():
        for dtype in (torch.bfloat16, torch.float16):
            nb = cfg.buffer_size
            cache, _, _ = build_cache(cfg, batch=2, kv_heads=hkv, head_dim=d, steps=[max(150, nb + 30), 2 * nb + 10, 1],
                                      pad=[0, 9], dtype=dtype)
            for q_len in (1, 4):
                q = torch.zeros(2, 4 * hkv, q_len, d, dtype=dtype)
                for tc in (False, True):
                    plan = []
                    cache_decode_attention(cache, 0, q, scaling=d ** -0.5, inv_freq=torch.ones(d // 2),
                                           tensor_core=tc, _plan=plan)
                    yield f"{name} {dtype} q{q_len} {'tc' if tc else 'reg'}", plan
            layer = cache.layers[0]
            for stream in layer.streams:
                runs = [(stream.prefill, 1), (stream.decode, max(cache.decode_chunks))]
                for store, chunks in runs:
                    if store is None or not store.fields or not chunks:
                        continue
                    t = chunks * store.chunk_len
                    rotary = None
                    if stream.kind == "key":
                        rotary = tuple(torch.zeros(2, 1, t, d, dtype=dtype) for _ in range(2))
                    plan = []
                    reconstruct_run(ChunkRunView.of(store), chunks, torch.empty(2, hkv, t, d, dtype=dtype), rotary,
                                    _plan=plan)
                    yield f"{name} {dtype} reconstruct {stream.kind}", plan
    for dtype in (torch.bfloat16, torch.float16):
        for bits in (2, 4):
            for axis in ("channel", "token"):
                x = torch.zeros(1, 2, 256, d, dtype=dtype)
                plan = []
                quantize_pack(x, bits, axis, 64, exclude=torch.zeros_like(x, dtype=torch.bool), _plan=plan)
                yield f"quantize_pack {dtype} {bits}-bit {axis}", plan


# -- 3. compile -------------------------------------------------------------------------------------------------
def compile_all(lines: list[str], arches: list[int]) -> int:
    from compile_check import _OPTIONS, _compile, _resource_usage
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    seen, failures, per_kernel = set(), 0, {}
    for line in lines:
        launch = json.loads(line)
        module, name = launch["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name)
        args = [_decode(a) for a in launch["args"]]
        kwargs = {k: _decode(v) for k, v in launch["kwargs"].items()}
        for arch in arches:
            # the variant a GPU would compile: Triton's binder on the arguments (types, specialisation, constexprs)
            backend = make_backend(GPUTarget("cuda", arch, 32))
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            _, specialization, _ = binder(*args, **kwargs)
            key = (launch["kernel"], arch, repr(specialization),
                   repr(sorted((k, repr(v)) for k, v in kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            constexprs = {k: v for k, v in launch["kwargs"].items() if k not in _OPTIONS}
            try:
                usage = _resource_usage(_compile(kernel, args, kwargs, arch).asm["cubin"])
                per_kernel[(name, arch)] = per_kernel.get((name, arch), 0) + 1
                print(f"ok    sm_{arch} {name} {usage}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report every failure, with the variant that failed
                failures += 1
                print(f"FAIL  sm_{arch} {name} constexprs {json.dumps(constexprs, sort_keys=True)}\n      "
                      + "\n      ".join(f"{type(exc).__name__}: {exc}".splitlines()[-12:]), flush=True)
    for (name, arch), n in sorted(per_kernel.items()):
        print(f"sm_{arch} {name}: {n} variants compiled")
    print(f"{len(seen) - failures} variants compiled, {failures} failed")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities (90 = sm_90)")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="test files (or node ids) to record from")
    parser.add_argument("--no-tests", action="store_true", help="only the GPU-only configurations")
    parser.add_argument("--record", help="keep the recorded launches in this file (JSON lines; default: temporary)")
    parser.add_argument("--compile", dest="compile_file", help="compile the launches recorded in this file")
    parser.add_argument("--record-only", action="store_true",
                        help="record, do not compile (then --compile FILE with another Python: the tests run under "
                             "one Triton's interpreter, the launches compile with another)")
    parser.add_argument("-k", help="pytest -k expression for the recorded tests")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    if args.compile_file:  # (the compile process: no interpreter)
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            parser.error("unset TRITON_INTERPRET to compile")
        lines = Path(args.compile_file).read_text().splitlines()
        for label, plan in gpu_only_cases():
            lines += encode_plan(plan)
        print(f"{len(lines)} launches ({len(set(lines))} distinct) to compile", flush=True)
        return compile_all(list(dict.fromkeys(lines)), args.arch)
    record = args.record or tempfile.mkstemp(suffix=".jsonl", prefix="gear_launches_")[1]
    Path(record).write_text("")
    if not args.no_tests:
        command = [sys.executable, "-m", "pytest", *args.tests, "-q", "-p", "no:cacheprovider",
                   "-p", Path(__file__).stem, "-m", "not gpu"] + (["-k", args.k] if args.k else [])
        proc = subprocess.run(command, cwd=ROOT, env={**env, "TRITON_INTERPRET": "1", RECORD_ENV: record})
        if proc.returncode not in (0, 5):
            print(f"recording: pytest exited {proc.returncode} (the launches it made are compiled all the same)")
    if args.record_only:
        print(f"{len(Path(record).read_text().splitlines())} launches recorded in {record}")
        return 0
    compile_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    arch = [str(a) for a in args.arch]
    return subprocess.run([sys.executable, __file__, "--compile", record, "--arch", *arch], cwd=ROOT,
                          env=compile_env).returncode


if __name__ == "__main__":
    sys.exit(main())
