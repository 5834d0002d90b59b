"""The tensor-core decode kernel's part of `python scripts/dev/compile_check.py --sass-report`: its main loop
next to the register kernel's for GearConfig() and gear-2 (issue 26's targets: <= 90 and <= 140 instructions per token
and KV head, 0 spills), compiled with the machinery of `compile_check`."""

from __future__ import annotations

import torch
from compile_check import _compile, _disassemble, _kernel_counts, _resource_usage, sass_loops


def _tc_cases():
    """(label, config) of the tensor-core kernel's report: GearConfig() and gear-2 (the issue's targets)."""
    from gear_hf.config import GearConfig

    return [("default", GearConfig()), ("gear2", GearConfig.preset("gear", bits=2))]


def tc_main_loop(cfg, arch: int = 90, **tuning) -> dict:
    """The main decode loop of one configuration at Llama-3-8B shapes (bf16, GQA 4, q_len 1), as `sass_report`
    counts it: {kernel name, instructions (the largest loop's body), per_token (x warps / block tokens), spill_ops
    (every kernel of the step), registers}. tuning: `decode_attention`'s (tensor_core, block_n, num_warps, ...)."""
    from gear_hf.cache.fused import build_cache, cache_decode_attention

    nb = cfg.buffer_size
    cache, _, _ = build_cache(cfg, batch=1, kv_heads=2, head_dim=128, steps=[max(150, nb + 30), max(70, nb + 10), 1],
                              dtype=torch.bfloat16)
    q = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    plan = []
    cache_decode_attention(cache, 0, q, scaling=128 ** -0.5, inv_freq=torch.ones(64), _plan=plan, **tuning)
    result = {"spill_ops": 0}
    for kernel, _grid, kargs, kwargs in plan:
        compiled = _compile(kernel, kargs, kwargs, arch)
        sass = _disassemble(compiled.asm["cubin"])
        result["spill_ops"] += _kernel_counts(sass)["spill_ops"]
        if kernel.fn.__name__ == "_combine_kernel":
            continue
        n = max((n for _, _, n in sass_loops(sass)), default=0)
        result.update(kernel=kernel.fn.__name__, instructions=n, usage=_resource_usage(compiled.asm["cubin"]),
                      per_token=n * kwargs.get("num_warps", 4) / kwargs["BN"], block=kwargs["BN"],
                      warps=kwargs.get("num_warps", 4))
    return result


def tc_sass_report(arch: int = 90) -> None:
    """The tensor-core kernel's main loop next to the register kernel's, for `_tc_cases` (targets: <= 90
    instructions/token/kv-head for GearConfig(), <= 140 for gear-2, 0 spills)."""
    variants = (("register", {}), ("tensor-core", {"tensor_core": True}),
                # what the tensor-core kernel does not do, compiled to count: the value statistics dequantized per
                # element instead of folded into the probabilities (GearConfig()), the query rotated back per token
                # ([16, BN, d/2] sin/cos and products) instead of the key tile
                ("tensor-core, values not folded", {"tensor_core": True, "fold_values": False}),
                ("tensor-core, query rotated per token", {"tensor_core": True, "rope_on_query": True}))
    for label, cfg in _tc_cases():
        for name, tuning in variants:
            if "fold_values" in tuning and label != "default":
                continue  # (gear-2's values have outliers and two groups per token: never folded)
            r = tc_main_loop(cfg, arch, **tuning)
            print(f"{label} {name} ({r['kernel']}, {r['warps']} warps, {r['block']}-token blocks): main loop "
                  f"{r['instructions']} SASS = {r['per_token']:.0f} instructions/token/kv-head, {r['usage']}, spill "
                  f"ops {r['spill_ops']}", flush=True)
