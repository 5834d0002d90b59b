"""Where the reconstruction kernel's bf16 error comes from, on a GPU: tests/test_kernels_reconstruct.py's bf16 cases
reconstructed with the kernel's GPU dot dtype (bf16 operands) and again with float32 dots ("ieee"), each compared
with the float32 oracle, beside the error of the oracle itself rounded to bf16 (the floor of a bf16 output).

    python scripts/dev/reconstruct_precision_probe.py        (needs CUDA)

One line per store: `case store: bf16 dots E1, float32 dots E2, oracle in bf16 E0` (max error / max |oracle|). E1
near E2: the dots' operands are not the cause; E2 well above E0: the error is in the kernel's float32 arithmetic.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    if not torch.cuda.is_available():
        print("reconstruct_precision_probe: needs a CUDA device", file=sys.stderr)
        return 2
    import test_kernels_reconstruct as cases

    from gear_hf.backends.torch_backend import TorchBackend
    from gear_hf.cache.fused import build_cache
    from gear_hf.kernels.triton import reconstruct as launcher
    from gear_hf.kernels.views import ChunkRunView

    for name, d, dtype, prompt in cases.STORE_CASES:
        if dtype != torch.bfloat16:
            continue
        cache, _, _ = build_cache(cases._config(name), batch=2, kv_heads=2, head_dim=d, steps=[prompt, 40, 1],
                                  pad=[0, 9], dtype=dtype, device="cuda", position_offset=30000)
        for label, store, chunks, kind in cases._stores(cache):
            if kind == "key":  # (the float32-dot run would also switch RoPE to its interpreter emulation)
                continue
            oracle = TorchBackend().reconstruct(store, chunks, torch.float32, None, None)
            scale = oracle.abs().max()
            errs = []
            for float32_dots in (False, True):
                saved = launcher.interpreting
                # interpreting() True: the launcher's float32 dot dtype (values: nothing else changes)
                launcher.interpreting = (lambda: True) if float32_dots else saved
                try:
                    out = torch.full(oracle.shape, float("nan"), dtype=dtype, device="cuda")
                    launcher.reconstruct_run(ChunkRunView.of(store), chunks, out, None)
                finally:
                    launcher.interpreting = saved
                errs.append(((out.float() - oracle).abs().max() / scale).item())
            floor = ((oracle.to(dtype).float() - oracle).abs().max() / scale).item()
            print(f"{name}-d{d}-T{prompt} {label}: bf16 dots {errs[0]:.4g}, float32 dots {errs[1]:.4g}, "
                  f"oracle in bf16 {floor:.4g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
