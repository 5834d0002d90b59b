"""Compile the Triton kernels for NVIDIA GPUs on a machine without one (ptxas ships with the triton wheel).

The CPU interpreter checks numerics but not what only a compiler sees (tl.dot shape/dtype rules, layouts,
types, register pressure). This module plans the real launches of `quantize_pack` and `decode_attention` on
small CPU caches (the same host code that runs on a GPU, with `_plan=` recording instead of launching),
then compiles each recorded launch with `triton.compile` for the requested architectures and reports
registers and stack (local memory) per thread from the cubin.

    python scripts/dev/compile_check.py                # sm_90 (H100/H200) and sm_80 (A100)
    python scripts/dev/compile_check.py --arch 90 --quick
    python scripts/dev/compile_check.py --sass-report  # main decode loop, SASS per token per KV head
    python scripts/dev/compile_check.py --sass-report --breakdown  # ... and where the loop's SASS goes
    python scripts/dev/compile_check.py --sass-report --register-only  # the register kernel's section alone
    python scripts/dev/compile_check.py --reconstruct-report  # the reconstruction kernel's section alone

--sass-report compiles the main decode kernel for sm_90 at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim
128, bf16, q_len 1: GEAR 4, 3 and 2 bits with the paper's groups, buffer and ranks, and GearConfig() — the recommended
default: kivi, 4-bit keys, 2-bit values, rotated, key groups of 128, 4 sinks, its buffer handed decoded — and the
"compact" recommendation, values read like keys), disassembles it with the cuobjdump of the installed Triton
and counts, for each loop over compressed blocks (found by its backward branch), the SASS instructions of the loop
body; per token and KV head that is body x num_warps / block tokens (a static count: every instruction of the body
once, both sides of a branch included, an inner loop once). It also counts local-memory spills (LDL/STL), fenced
atomics (MEMBAR / ATOM / RED) in every kernel of the step, and registers; then the reconstruction kernel's section
(`sass_reconstruct`: instructions per element of its main loop per store kind, GearConfig() and gear-2, and spills).
The last line printed is `instructions/token/kv-head: N` for 2-bit GEAR.
--breakdown adds, per case, the main loop's instructions attributed to the kernel's functions (`_value_tile`,
`_rope`, ...) through the line table triton embeds (nvdisasm -g), and for every case with them what each GEAR term
costs: the main loop compiled again without the value outliers, the key outliers, the keys' or the values'
low-rank term, and without all four (the quantized backbone alone). What a change to the kernel should aim at.

Must run without TRITON_INTERPRET=1 (it sets nothing itself; `tests/test_kernels_compile.py` runs it in a
subprocess). Exit status 1 when a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int8: "i8",
          torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def _signature(kernel, args, kwargs):
    """(signature, constexprs) of a launch, types only (no alignment attributes): the key of `seen` in main."""
    names = kernel.arg_names
    signature, constexprs = {}, {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(value).__name__}")
    for name, value in kwargs.items():
        if name in _OPTIONS:
            continue
        signature[name] = "constexpr"
        constexprs[name] = value
    missing = [n for n in names if n not in signature]
    if missing:
        raise TypeError(f"{kernel.fn.__name__}: no value for {missing}")
    return signature, constexprs


def _compile(kernel, args, kwargs, arch: int):
    """triton.compile of one planned launch for sm_<arch>, specialized on its arguments as a GPU launch would
    be (Triton's own binder: 16-byte-aligned pointers and integers divisible by 16 marked so, except those the
    kernel says not to specialize on), so the code counted is the code a GPU would run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)


def _resource_usage(cubin: bytes) -> str:
    try:
        out = _run_on_cubin(cubin, _nvidia_tool("cuobjdump"), "-res-usage")
    except (RuntimeError, subprocess.CalledProcessError):
        return "?"
    for line in out.splitlines():
        if "REG:" in line:
            fields = dict(x.split(":", 1) for x in line.split() if ":" in x)
            return f"regs {fields.get('REG')} stack {fields.get('STACK')}B"
    return "?"


def compile_launch(kernel, args, kwargs, arch: int) -> str:
    return _resource_usage(_compile(kernel, args, kwargs, arch).asm["cubin"])


def _nvidia_tool(name: str) -> str:
    """Path of a CUDA binary utility: the one in triton's nvidia backend, else on PATH."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = str(tool) if tool.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found (neither in triton's nvidia backend nor on PATH)")
    return found


def _run_on_cubin(cubin: bytes, *command: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([*command, f.name], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);"


def _disassemble(cubin: bytes) -> list[tuple[int, str]]:
    """[(address, instruction text)] of a cubin's SASS (cuobjdump of the triton wheel, else on PATH)."""
    import re

    out = _run_on_cubin(cubin, _nvidia_tool("cuobjdump"), "-sass")
    pattern = re.compile(_INSTRUCTION)
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(pattern.match, out.splitlines()) if m]


def sass_sources(cubin: bytes) -> dict[int, tuple[str, int]]:
    """{address: (source file, line)} of every instruction that triton's line table (nvdisasm -g) places; for an
    inlined function, the line inside it."""
    import re

    out = _run_on_cubin(cubin, _nvidia_tool("nvdisasm"), "-g", "-c")
    marker, pattern = re.compile(r'//## File "([^"]+)", line (\d+)'), re.compile(_INSTRUCTION)
    where, sources = None, {}
    for text in out.splitlines():
        m = marker.search(text)
        if m:
            where = (m.group(1), int(m.group(2)))
        elif (m := pattern.match(text)) and where is not None:
            sources[int(m.group(1), 16)] = where
    return sources


def _function_spans(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of the top-level functions of a Python source file."""
    import ast

    tree = ast.parse(Path(path).read_text())
    return [(node.lineno, node.end_lineno, node.name) for node in tree.body if isinstance(node, ast.FunctionDef)]


def loop_by_function(cubin: bytes, sass: list[tuple[int, str]], start: int, end: int) -> dict[str, int]:
    """The instructions of the loop [start, end], counted per function of the kernel's modules
    (gear_hf.kernels.triton) they come from (other files: by file name; no line info: '?'), most first."""
    from gear_hf.kernels import triton as kernel_package

    package = Path(kernel_package.__file__).parent
    sources = sass_sources(cubin)
    # by the package-relative path: a cubin from triton's cache names the checkout that first compiled the same source
    ours = package.parts[-3:]  # ("gear_hf", "kernels", "triton")
    spans: dict[str, list] = {}  # per file of the package: its functions' line spans
    counts: dict[str, int] = {}
    for addr, _ in sass:
        if not start <= addr <= end:
            continue
        path, line = sources.get(addr, ("?", 0))
        file = Path(path).name
        if Path(path).parts[-4:-1] == ours and (package / file).is_file():
            if file not in spans:
                spans[file] = _function_spans(str(package / file))
            name = next((n for first, last, n in spans[file] if first <= line <= last), f"{file}:{line}")
        else:
            name = file
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def sass_loops(sass: list[tuple[int, str]]) -> list[tuple[int, int, int]]:
    """(start, end, instructions) of every loop: a branch back to an earlier address closes [target, branch]."""
    import re

    loops = []
    for addr, text in sass:
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            loops.append((start, addr, sum(1 for a, _ in sass if start <= a <= addr)))
    return loops


def _kernel_counts(sass: list[tuple[int, str]]) -> dict:
    ops = [text.split()[1] if text.startswith("@") else text.split()[0] for _, text in sass]
    return {"spill_ops": sum(op.startswith(("LDL", "STL")) for op in ops),
            "fences": sum(op.startswith("MEMBAR") for op in ops),
            "atomics": sum(op.split(".")[0] in ("ATOM", "ATOMG", "ATOMS", "RED", "REDG") for op in ops)}


# GEAR's terms as the decode kernel's compile-time switches (prompt and decode chunks): removed one at a time
_TERMS = {"value outliers": {"P_V_K2": 0, "D_V_K2": 0}, "key outliers": {"P_K_SPARSE": False, "D_K_SPARSE": False},
          "key low-rank": {"P_K_R": 0, "D_K_R": 0}, "value low-rank": {"P_V_R": 0, "D_V_R": 0}}


def _main_loop(kernel, args, kwargs, arch: int) -> int:
    """SASS instructions of the largest loop of a compiled launch."""
    sass = _disassemble(_compile(kernel, args, kwargs, arch).asm["cubin"])
    return max((n for _, _, n in sass_loops(sass)), default=0)


def _term_costs(kernel, args, kwargs, arch: int, main: int) -> str:
    """'term N, ...': the main-loop instructions saved by compiling without each GEAR term the launch has."""
    present = {name: off for name, off in _TERMS.items() if any(kwargs.get(k) for k in off)}
    if not present:
        return ""
    present["all four"] = {k: v for off in present.values() for k, v in off.items()}
    return ", ".join(f"{name} {main - _main_loop(kernel, args, {**kwargs, **off}, arch)}"
                     for name, off in present.items())


def sass_report(arch: int = 90, breakdown: bool = False, reconstruct: bool = True) -> int:
    """Print the main-loop SASS figures of the decode kernel at Llama-3-8B shapes; the last line is
    `instructions/token/kv-head: N` for 2-bit GEAR. breakdown: also the main loop's instructions per source
    function and per GEAR term; reconstruct: also the reconstruction kernel's section. Returns the exit status."""
    from gear_hf.cache.fused import build_cache, cache_decode_attention
    from gear_hf.config import GearConfig

    figure = None
    # the presets store int8 low-rank factors; gear2-f16 keeps the paper's 16-bit ones (the figure before int8)
    cases = [("gear4", GearConfig.preset("gear", bits=4)), ("gear3", GearConfig.preset("gear", bits=3)),
             ("default", GearConfig()), ("gear2-f16", GearConfig.preset("gear", bits=2, factor_bits=16)),
             ("compact", GearConfig.recommended(name="compact")),
             ("gear2", GearConfig.preset("gear", bits=2))]
    for label, cfg in cases:
        nb = cfg.buffer_size  # a prompt chunk and a decode chunk for every buffer size
        steps = [max(150, nb + 30), max(70, nb + 10), 1]
        cache, _, _ = build_cache(cfg, batch=1, kv_heads=2, head_dim=128, steps=steps, dtype=torch.bfloat16)
        q = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)  # GQA 4, q_len 1
        plan = []
        cache_decode_attention(cache, 0, q, scaling=128 ** -0.5, inv_freq=torch.ones(64), _plan=plan)
        totals = {"spill_ops": 0, "fences": 0, "atomics": 0}
        for kernel, _grid, kargs, kwargs in plan:
            compiled = _compile(kernel, kargs, kwargs, arch)
            sass = _disassemble(compiled.asm["cubin"])
            counts = _kernel_counts(sass)
            for k in totals:
                totals[k] += counts[k]
            usage = _resource_usage(compiled.asm["cubin"])
            print(f"{label} sm_{arch} {kernel.fn.__name__}: {len(sass)} SASS, {usage}, "
                  f"launches with num_warps={kwargs.get('num_warps')}, spills {counts['spill_ops']} LDL/STL, "
                  f"{counts['fences']} MEMBAR, {counts['atomics']} atomics")
            if kernel.fn.__name__ != "_decode_attention_kernel":
                continue
            block = kwargs["BN"]
            warps = kwargs.get("num_warps", 4)
            loops = sorted(sass_loops(sass), key=lambda x: -x[2])
            for start, end, n in loops:
                print(f"    loop 0x{start:x}-0x{end:x}: {n} instructions = {n * warps / block:.0f} per token per "
                      f"KV head ({warps} warps, {block}-token blocks)")
            main = loops[0][2] * warps / block if loops else float("nan")
            main_usage = usage
            if breakdown and loops:
                start, end, n = loops[0]
                parts = ", ".join(f"{name} {count}" for name, count in
                                  loop_by_function(compiled.asm["cubin"], sass, start, end).items())
                print(f"    main loop by source ({n} instructions): {parts}")
                terms = _term_costs(kernel, kargs, kwargs, arch, n)
                if terms:
                    print(f"    main loop instructions each term costs (compiled without it): {terms}")
        print(f"{label}: main loop {main:.0f} instructions/token/kv-head, {main_usage}, spill ops "
              f"{totals['spill_ops']}, fenced atomics {totals['fences']} (atomics {totals['atomics']}) in the step's "
              f"{len(plan)} launches")
        figure = main
    if reconstruct:
        reconstruct_report(arch)
    print(f"instructions/token/kv-head: {figure:.0f}")
    return 0


def reconstruct_report(arch: int = 90) -> int:
    """The reconstruction kernel's section of the report (`sass_reconstruct`): instructions per element of its main
    loop per store kind, and spills, for every shipped configuration (`sass_reconstruct.cases`). Returns the exit
    status."""
    from sass_reconstruct import reconstruct_sass_report

    reconstruct_sass_report(arch)
    return 0


def planned_launches(quick: bool = False):
    """(label, kernel, args, kwargs) for representative configurations (a buffer read as stored too), on CPU tensors."""
    from gear_hf.backends.triton_backend import TritonBackend
    from gear_hf.cache.fused import build_cache, cache_decode_attention
    from gear_hf.config import GearConfig
    from gear_hf.kernels.quant import quantize_pack

    launches = []

    def add(label, plan):
        for kernel, _grid, args, kwargs in plan:
            launches.append((f"{label} {kernel.fn.__name__}", kernel, args, kwargs))

    decode_cases = [
        ("gear2 bf16 d128 G4 q1 sink", dict(method="gear", bits=2, dtype=torch.bfloat16, d=128, group=4, q=1, sink=4)),
        ("gear4 fp16 d64 G7 q4", dict(method="gear", bits=4, dtype=torch.float16, d=64, group=7, q=4, sink=0)),
        ("kivi2 fp32 d128 G1 q1", dict(method="kivi", bits=2, dtype=torch.float32, d=128, group=1, q=1, sink=0)),
        ("fp16 bf16 d128 G4 q1", dict(method="fp16", bits=4, dtype=torch.bfloat16, d=128, group=4, q=1, sink=0)),
        ("kivi k3.5v3 allocated bf16 d128 G4 q1", dict(method="kivi", bits=3, dtype=torch.bfloat16, d=128, group=4, q=1,
                                                      sink=4, key_bits=3.5, key_bit_allocation="query")),
        ("GearConfig() coded buffer bf16 d128 G4 q1", dict(config=GearConfig(), dtype=torch.bfloat16, d=128, group=4,
                                                          q=1, kw=dict(reader=TritonBackend()))),
        ("GearConfig() coded buffer tc fp16 d128 G4 q2", dict(config=GearConfig(), dtype=torch.float16, d=128, group=4,
                                                              q=2, kw=dict(tensor_core=True, reader=TritonBackend()))),
        # values held a chunk longer (value_buffer_size): the held chunk's own loop beside the decode chunks'
        ("steady held values tc bf16 d128 G4 q1", dict(config=GearConfig.recommended(name="steady"),
                                                       dtype=torch.bfloat16, d=128, group=4, q=1,
                                                       kw=dict(tensor_core=True, reader=TritonBackend()))),
    ]
    if quick:
        decode_cases = decode_cases[:1]
    for label, c in decode_cases:
        extra = {k: c[k] for k in ("key_bits", "key_bit_allocation") if k in c}
        cfg = c.get("config") or GearConfig.preset(c["method"], bits=c["bits"], sink_tokens=c["sink"], **extra)
        cache, _, _ = build_cache(cfg, batch=2, kv_heads=2, head_dim=c["d"], steps=[150, 70, c["q"]], dtype=c["dtype"])
        q = torch.zeros(2, 2 * c["group"], c["q"], c["d"], dtype=c["dtype"])
        plan = []
        cache_decode_attention(cache, 0, q, scaling=1, inv_freq=torch.ones(c["d"] // 2), _plan=plan, **c.get("kw", {}))
        add(label, plan)
    quant_cases = [("bf16 channel 2b", torch.bfloat16, "channel", 2, 128),
                   ("fp16 token 4b", torch.float16, "token", 4, 128),
                   ("fp32 token 8b d40", torch.float32, "token", 8, 40),
                   ("bf16 channel 8b d40", torch.bfloat16, "channel", 8, 40)]
    if quick:
        quant_cases = quant_cases[:2]
    for label, dtype, axis, bits, d in quant_cases:
        x = torch.zeros(1, 2, 128, d, dtype=dtype)
        plan = []
        quantize_pack(x, bits, axis, 64 if d == 128 else 16, exclude=torch.zeros_like(x, dtype=torch.bool), _plan=plan)
        add(label, plan)
    return launches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90 = sm_90)")
    parser.add_argument("--quick", action="store_true", help="one decode and two quantize configurations")
    parser.add_argument("--sass-report", action="store_true",
                        help="main decode loop SASS count at Llama-3-8B shapes (sm_90 unless --arch says otherwise)")
    parser.add_argument("--reconstruct-report", action="store_true",
                        help="only the reconstruction kernel's section of --sass-report (instructions per element)")
    parser.add_argument("--breakdown", action="store_true",
                        help="with --sass-report: the main loop's instructions per kernel function (nvdisasm -g) "
                             "and per GEAR term")
    parser.add_argument("--register-only", action="store_true",
                        help="with --sass-report: only the register kernel's section (no tensor-core kernel and no "
                             "reconstruction kernel lines)")
    parser.add_argument("--tensor-core-only", action="store_true",
                        help="with --sass-report: only the tensor-core kernel's lines (and the register kernel's for "
                             "the same configurations)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter replaces the compiler)", file=sys.stderr)
        return 2
    if args.register_only and args.tensor_core_only:
        parser.error("--register-only and --tensor-core-only exclude each other")
    if args.breakdown and not args.sass_report:
        parser.error("--breakdown goes with --sass-report")
    if args.reconstruct_report:
        return reconstruct_report(args.arch[0] if args.arch != [90, 80] else 90)
    if args.sass_report:
        arch = args.arch[0] if args.arch != [90, 80] else 90
        if not args.register_only:
            from sass_tensor_core import tc_sass_report

            tc_sass_report(arch)
        if args.tensor_core_only:
            return 0
        return sass_report(arch, breakdown=args.breakdown, reconstruct=not args.register_only)
    failures = 0
    seen = set()
    for label, kernel, kargs, kwargs in planned_launches(args.quick):
        for arch in args.arch:
            key = (kernel.fn.__name__, arch, repr(_signature(kernel, kargs, kwargs)), repr(sorted(
                (k, kwargs[k]) for k in _OPTIONS if k in kwargs)))
            if key in seen:
                continue
            seen.add(key)
            try:
                usage = compile_launch(kernel, kargs, kwargs, arch)
                print(f"ok    sm_{arch}  {label:<48} {usage}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report every failure
                failures += 1
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"FAIL  sm_{arch}  {label:<48} {type(exc).__name__}: {first[:300]}", flush=True)
    print(f"{len(seen) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
