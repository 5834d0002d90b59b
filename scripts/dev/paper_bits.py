"""What the paper's presets cost and how well their caches serve attention, from captured keys/values.

    python scripts/dev/paper_bits.py --model smollm2 --dtype bfloat16 --save /tmp/caps.pt   # capture, then measure
    PYTHONPATH=<another checkout> python scripts/dev/paper_bits.py --load /tmp/caps.pt        # same captures, other code

Captures one GSM8K text's per-layer queries/keys/values (the last --tokens tokens) with the model's stock forward,
then streams them through a GearCache per preset (prompt at prefill, the last 64 tokens one per step) and prints
the bits per element held (`memory_report()`, tokens' bytes; an older checkout may count capacity) and the mean over
layers of the attention-output relative error of the last 32 queries (`diagnostics.layer_errors`). `--load` needs
no model, so the same captures can be measured by an older checkout of gear_hf (the side-information comparison).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--presets", default="gear-2,kivi-2,gear-4",
                        help="METHOD-BITS[-f8|-f16][-oRATIO][-clipv]: -f8/-f16 int8/16-bit low-rank factors (the "
                             "presets: int8), -oRATIO outlier_ratio (e.g. -o0.03125: 2 per 64-long vector), -clipv "
                             "values' ranges searched (range_search='values'); needs a checkout that has the option")
    parser.add_argument("--save", default=None, help="capture with the model, save here, then measure")
    parser.add_argument("--load", default=None, help="measure saved captures (no model needed)")
    args = parser.parse_args(argv)
    import gear_hf
    from gear_hf import diagnostics as D
    from gear_hf.cache import GearCache

    _NumLayers = D._NumLayers if hasattr(D, "_NumLayers") else __import__(
        "gear_hf.diagnostics.capture", fromlist=["_NumLayers"])._NumLayers  # an older checkout: a module

    torch.set_grad_enabled(False)
    if args.load:
        captures = [D.LayerCapture(**c) for c in torch.load(args.load)]
    else:
        import benchlib  # the model loader of this checkout (an older gear_hf may lack what it imports)

        model, tokenizer = benchlib.load_model(args.model, args.dtype)

        from gear_hf.gsm8k import solved_text

        ids = tokenizer(solved_text(benchlib.data_dir(), 0), return_tensors="pt").input_ids[:, -args.tokens:]
        captures = D.capture_qkv(model, ids)
        if args.save:
            torch.save([vars(c) for c in captures], args.save)
    T = captures[0].key.shape[2]
    H, d = captures[0].key.shape[1], captures[0].key.shape[3]
    print(f"captures: {len(captures)} layers, T={T}, {H} KV heads, head_dim {d}, {captures[0].key.dtype}")
    for name in args.presets.split(","):
        base, options = name, {}
        for suffix, option in (("-clipv", dict(range_search="values")), ("-o", None), ("-f8", dict(factor_bits=8)),
                               ("-f16", dict(factor_bits=16))):
            if suffix == "-o":  # -oRATIO
                head, sep, ratio = base.rpartition("-o")
                if sep and ratio.replace(".", "", 1).isdigit():
                    base, options = head, {"outlier_ratio": float(ratio), **options}
            elif base.endswith(suffix):
                base, options = base[:-len(suffix)], {**option, **options}
        method, _, bits = base.rpartition("-")
        config = gear_hf.GearConfig.preset(method, bits=int(bits), backend="torch", **options)
        cache = GearCache(_NumLayers(len(captures)), config)
        for start, length in [(0, T - 64)] + [(t, 1) for t in range(T - 64, T)]:
            for i, cap in enumerate(captures):
                cache.store_and_read(i, cap.key[:, :, start:start + length], cap.value[:, :, start:start + length],
                                     query=cap.query[:, :, start:start + length])
        errors = D.layer_errors(captures, config, decode_tokens=64, last_queries=32)
        attn = sum(r["attention_output_error"] for r in errors) / len(errors)
        print(f"{name}: {cache.memory_report()['bits_per_element']:.3f} bits/elem, attention-output error {attn:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
