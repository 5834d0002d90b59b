"""Real weights, the numba CPU kernels against the torch path: a left-padded batch of GSM8K 8-shot prompts, greedy.

    OMP_NUM_THREADS=1 python scripts/dev/compare_backends.py --model smollm2 --dtype float32 --methods kivi-2,gear-2,default

Per method: whether both backends give the same tokens, the largest finite logit difference, how many tokens of
each row match the uncompressed model (DynamicCache) for each backend, and the cache's summary line (bits/element
held, from the tensors the stores hold) for each backend. "default" is GearConfig().
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
import benchlib  # noqa: E402


def main(argv=None) -> int:
    import gear_hf
    from gear_hf import GearConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--methods", default="kivi-2,gear-2,default")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = benchlib.load_model(args.model, args.dtype)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok([p.prompt for p in benchlib.gsm8k_prompts(args.prompts)], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=tok.pad_token_id)

    def new_tokens(out):
        return out.sequences[:, enc.input_ids.shape[1]:]

    if gear_hf.is_enabled(model):

        gear_hf.disable(model)
    reference = new_tokens(model.generate(**enc, **kwargs))
    print(f"{args.model} {args.dtype}, prompt lengths {enc.attention_mask.sum(1).tolist()}, {args.new} new tokens")
    for name in args.methods.split(","):
        runs = []
        for backend in ("torch", "numba"):
            config = GearConfig(backend=backend) if name == "default" else GearConfig.preset(name, backend=backend)
            with gear_hf.enabled(model, config):
                out = model.generate(**enc, **kwargs)
                summary = gear_hf.last_cache(model).summary()
            tokens = new_tokens(out)
            matched = [int((a != b).nonzero()[0]) if (a != b).any() else len(a) for a, b in zip(tokens, reference)]
            runs.append((tokens, torch.stack(out.scores, 1).float(), matched, summary))
        (t0, s0, m0, sum0), (t1, s1, m1, sum1) = runs
        finite = s0.isfinite() & s1.isfinite()
        print(f"{name}: same tokens {torch.equal(t0, t1)}, max finite logit diff "
              f"{(s0 - s1)[finite].abs().max().item():.2e}; tokens matching DynamicCache per row: torch {m0}, "
              f"numba {m1}\n  torch: {sum0}\n  numba: {sum1}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
