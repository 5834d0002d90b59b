"""The reconstruction kernel's part of `python -m gear_hf.kernels.compile_check --sass-report`: SASS instructions
per element it writes, per store kind (keys / values, prompt chunk / decode chunks), and spills.

Each store of a cache built at Llama-3-8B head shapes (head_dim 128, bf16; GearConfig() and gear-2) is planned
through `reconstruct_run` (keys with the model's cos/sin), compiled for sm_<arch> and disassembled with the
machinery of `compile_check`. The figure is the kernel's main loop (its largest loop: one BN-token tile of all
head_dim channels per iteration) per element and thread,

    instructions/element = loop-body SASS x threads per program / (BN x head_dim)

a static count like the decode kernel's (every instruction of the body once; both sides of a branch; an inner
loop once). Also printed: the whole kernel's SASS and the same per element at the tokens one program covers
(the loop run for each of its tiles, the setup once), and LDL/STL spill instructions.
"""

from __future__ import annotations

import torch

# What the report compiles: (label, GearConfig factory); the last line of the section is the worst figure
CASES = ("default", "gear2")


def _config(label: str):
    from ..config import GearConfig

    return GearConfig() if label == "default" else GearConfig.preset("gear", bits=2)


def planned_reconstructions(label: str):
    """[(store kind, tokens per chunk, kernel, grid, args, kwargs)] of the reconstruction launches of one layer's
    stores (prompt chunk and decode chunks, keys and values) of a CPU cache at Llama-3-8B head shapes (bf16,
    head_dim 128)."""
    from ..cache.fused import build_cache
    from . import reconstruct_run
    from .views import ChunkRunView

    cfg = _config(label)
    nb = cfg.buffer_size
    cache, _, _ = build_cache(cfg, batch=1, kv_heads=2, head_dim=128, steps=[max(300, 2 * nb + 30), nb + 10, 1],
                              dtype=torch.bfloat16)
    layer = cache.layers[0]
    launches = []
    for stream in layer.streams:
        stores = [("prompt", stream.prefill, 1), ("decode", stream.decode, max(cache.decode_chunks))]
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
    from .compile_check import _compile, _disassemble, _kernel_counts, _resource_usage, sass_loops

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


def reconstruct_sass_report(arch: int = 90) -> float:
    """Print the reconstruction kernel's figures for GearConfig() and gear-2; returns the largest per-element
    figure (over both configurations and every store kind)."""
    worst = 0.0
    for label in CASES:
        for kind, chunk_len, kernel, _grid, args, kwargs in planned_reconstructions(label):
            f = reconstruct_figures(kernel, args, kwargs, arch, chunk_len)
            worst = max(worst, f["per_element"])
            print(f"reconstruct {label} {kind} sm_{arch}: {f['per_element']:.1f} instructions/element "
                  f"(main loop {f['body']} SASS x {f['threads']} threads / {kwargs['BN']}x{kwargs['D']} elements; "
                  f"whole kernel {f['total']} SASS: {f['per_element_program']:.1f}/element over the "
                  f"{f['program_tokens']} tokens of a program), spill ops {f['spills']}, {f['usage']}")
    print(f"reconstruct instructions/element (worst store): {worst:.1f}")
    return worst
