"""The reconstruction kernel's part of `python scripts/dev/compile_check.py --sass-report`: SASS instructions
per element it writes, per store kind (keys / values, prompt chunk / decode chunks), and spills.

Each store of a cache built at Llama-3-8B head shapes (head_dim 128, bf16) of every configuration the library ships
(`cases`: GearConfig(), the recommended names, every paper preset; a launch compiled once however many
configurations share it) is planned through `reconstruct_run` (keys with the model's cos/sin), compiled for
sm_<arch> and disassembled with the machinery of `compile_check`. The figure is the kernel's main loop (its largest
loop: one BN-token tile of all head_dim channels per iteration) per element and thread,

    instructions/element = loop-body SASS x threads per program / (BN x head_dim)

a static count like the decode kernel's (every instruction of the body once; both sides of a branch; an inner
loop once). Key outliers stored per channel are scattered after the tiles (a loop over the program's outliers, not
in the main loop: the whole-kernel figure counts its body once). Also printed: the whole kernel's SASS and the same
per element at the tokens one program covers (the loop run for each of its tiles, the setup once), and LDL/STL
spill instructions.
"""

from __future__ import annotations

import torch


# What the report compiles: every configuration the library ships (GearConfig(), the other RECOMMENDED names, and
# every paper preset METHOD-BITS but fp16, which stores nothing compressed), each once; the last line of the section
# is the worst figure over all of them
def cases() -> list[tuple[str, object]]:
    """[(label, GearConfig)]: "default" (GearConfig(), = recommended "centered"), "gear2" (preset gear-2; the cost
    model's two keys), then the other recommended names ("rec:NAME") and paper presets ("METHOD-BITS"), a config
    listed once under its first label."""
    from gear_hf.compress.quant import BITS
    from gear_hf.config import RECOMMENDED, GearConfig
    from gear_hf.config.names import METHODS

    named = [("default", GearConfig()), ("gear2", GearConfig.preset("gear", bits=2))]
    named += [(f"rec:{name}", GearConfig.recommended(name=name)) for name, _, _, _ in RECOMMENDED]
    named += [(f"{m}-{b}", GearConfig.preset(m, bits=b)) for m in METHODS if m != "fp16" for b in BITS]
    out = []
    for label, cfg in named:
        if all(cfg != c for _, c in out):
            out.append((label, cfg))
    return out


def planned_reconstructions(cfg):
    """[(store kind, tokens per chunk, kernel, grid, args, kwargs)] of the reconstruction launches of one layer's
    stores (prompt chunk and decode chunks, keys and values) of a CPU cache of GearConfig `cfg` at Llama-3-8B head
    shapes (bf16, head_dim 128)."""
    from gear_hf.cache.fused import build_cache
    from gear_hf.kernels import reconstruct_run
    from gear_hf.kernels.views import ChunkRunView

    nb = cfg.buffer_size
    # (two decode chunks of keys: a stream that holds its newest chunk in the buffer still compresses one)
    cache, _, _ = build_cache(cfg, batch=1, kv_heads=2, head_dim=128, steps=[max(300, 2 * nb + 30), 2 * nb + 10, 1],
                              dtype=torch.bfloat16)
    layer = cache.layers[0]
    launches = []
    for stream in layer.streams:
        chunks = max(stream.own(cache.layout.counts).chunks)  # (a stream with a held chunk stores one fewer)
        stores = [("prompt", stream.prefill, 1), ("decode", stream.decode, chunks)]
        for where, store, chunks in stores:
            if store is None or not store.fields or not chunks:
                continue
            T = chunks * store.chunk_len
            out = torch.empty(1, 2, T, 128, dtype=torch.bfloat16)
            rotary = None
            if stream.kind == "key":
                rotary = tuple(torch.zeros(1, 1, T, 128, dtype=torch.bfloat16) for _ in range(2))
            plan = []
            reconstruct_run(ChunkRunView.of(store), chunks, out, rotary, _plan=plan)
            launches += [(f"{stream.kind}s {where}", store.chunk_len, *launch) for launch in plan]
    return launches


def reconstruct_figures(kernel, args, kwargs, arch: int, chunk_len: int) -> dict:
    """Compile one planned reconstruction launch (chunks of chunk_len tokens); its per-element figures, spills and
    registers."""
    from compile_check import _compile, _disassemble, _kernel_counts, _resource_usage, sass_loops

    compiled = _compile(kernel, args, kwargs, arch)
    sass = _disassemble(compiled.asm["cubin"])
    threads = 32 * kwargs.get("num_warps", 4)
    tile = kwargs["BN"] * kwargs["D"]  # elements one iteration of the main loop writes
    # TILES: tiles per program, the main loop's trips (its largest loop); without it one tile, the whole kernel
    loops = sorted(sass_loops(sass), key=lambda x: -x[2]) if "TILES" in kwargs else []
    body = loops[0][2] if loops else len(sass)
    trips = min(kwargs.get("TILES", 1), -(-chunk_len // kwargs["BN"]))  # tiles a full program of a chunk decodes
    return {"per_element": body * threads / tile, "body": body, "total": len(sass),
            # each of its tiles through the loop, the rest once: a program's instructions over what it writes
            "per_element_program": (len(sass) + (trips - 1) * body) * threads / (trips * tile),
            "program_tokens": trips * kwargs["BN"], "spills": _kernel_counts(sass)["spill_ops"],
            "usage": _resource_usage(compiled.asm["cubin"]), "threads": threads}


def _launch_key(kernel, args, kwargs, chunk_len: int):
    """What a compile and its figures depend on: the constexprs, and each argument's type and 16-divisibility (the
    specialization) -- launches equal here compile to the same code."""
    import torch as _torch

    spec = tuple((str(a.dtype), a.data_ptr() % 16 == 0) if isinstance(a, _torch.Tensor) else
                 (type(a).__name__, isinstance(a, int) and a % 16 == 0, a == 1) for a in args)
    return kernel.fn.__name__, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])), spec, chunk_len


def reconstruct_sass_report(arch: int = 90) -> float:
    """Print the reconstruction kernel's figures for every shipped configuration (`cases`); returns the largest
    per-element figure of a main loop (over every configuration and store kind)."""
    worst, seen = 0.0, {}
    for label, cfg in cases():
        for kind, chunk_len, kernel, _grid, args, kwargs in planned_reconstructions(cfg):
            key = _launch_key(kernel, args, kwargs, chunk_len)
            if key not in seen:
                seen[key] = reconstruct_figures(kernel, args, kwargs, arch, chunk_len)
            f = seen[key]
            worst = max(worst, f["per_element"])
            print(f"reconstruct {label} {kind} sm_{arch}: {f['per_element']:.1f} instructions/element "
                  f"(main loop {f['body']} SASS x {f['threads']} threads / {kwargs['BN']}x{kwargs['D']} elements; "
                  f"whole kernel {f['total']} SASS: {f['per_element_program']:.1f}/element over the "
                  f"{f['program_tokens']} tokens of a program), spill ops {f['spills']}, {f['usage']}", flush=True)
    print(f"reconstruct instructions/element (worst store): {worst:.1f}")
    return worst
