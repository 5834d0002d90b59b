"""`python -m gear_hf.diagnostics`: per layer x head compression errors of one text, written as a report.

    python -m gear_hf.diagnostics --model smollm2 --method gear-2                  # -> out/diagnostics/smollm2-gear-2
    python -m gear_hf.diagnostics --model smollm2 --method kivi --bits 2 --set key_axis=token \\
        --set value_axis=channel --kl head
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .. import gsm8k
from ..config import GearConfig, parse_preset_name
from ..weights import load_model
from .report import diagnose, write_report

DEFAULT_OUT = Path("out") / "diagnostics"  # untracked (.gitignore); relative to the working directory


def _parse_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _model_tag(spec: str) -> str:
    return Path(spec).stem if ("/" in spec or spec.endswith(".gguf")) else spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gear_hf.diagnostics",
                                     description="Per layer x head compression errors where they are consumed.")
    parser.add_argument("--model", default="smollm2", help="smollm2 | qwen25 | a .gguf file | a HF model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--method", default="gear", help="a preset name: gear, kivi, ... or with bits: gear-2, kivi-4")
    parser.add_argument("--bits", type=int, default=None, help="bits of keys and values (default 2 unless --method "
                                                               "names them)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any GearConfig field, e.g. --set key_axis=token --set pre_rope=false")
    parser.add_argument("--text-file", help="the text to measure on (default: an 8-shot GSM8K CoT prompt + answer)")
    parser.add_argument("--data-dir", default=None,
                        help=f"data directory with gsm8k/{{train,test}}.jsonl (default: ${gsm8k.DATA_DIR_ENV}, else "
                             "../shared/data of a source checkout)")
    parser.add_argument("--index", type=int, default=0, help="GSM8K test problem (default 0)")
    parser.add_argument("--tokens", type=int, default=640,
                        help="the text's last N tokens are used (default 640; for GSM8K the continuation is then "
                             "the test problem's worked answer)")
    parser.add_argument("--continuation", type=int, default=128,
                        help="last tokens teacher-forced after the prefill (default 128)")
    parser.add_argument("--chunk", type=int, default=None, help="continuation step size (default: buffer size; 1 = "
                                                                 "per token, as generation)")
    parser.add_argument("--kl", default="layer", choices=["none", "layer", "head"])
    parser.add_argument("--include-prompt", action="store_true", help="also measure the prompt's queries")
    parser.add_argument("--out", default=None, help=f"output directory (default: {DEFAULT_OUT}/<model>-<config>, "
                                                    "not tracked by git)")
    args = parser.parse_args(argv)

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected FIELD=VALUE")
        overrides[key.strip()] = _parse_value(value.strip())
    try:
        named_bits = parse_preset_name(args.method)[1]
        bits = args.bits if args.bits is not None or named_bits is not None else 2
        config = GearConfig.preset(args.method, bits=bits, **overrides)
    except ValueError as err:
        parser.error(str(err))
    if args.text_file:
        text = Path(args.text_file).read_text()
    else:
        data_dir = args.data_dir or gsm8k.default_data_dir()
        if data_dir is None:
            parser.error(f"no GSM8K data: give --data-dir, set ${gsm8k.DATA_DIR_ENV}, or --text-file")
        text = gsm8k.solved_text(data_dir, args.index)
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, -args.tokens:]  # ends with the text's end
    T = ids.shape[1]
    if not 0 < args.continuation < T:
        parser.error(f"--continuation {args.continuation} must be in [1, {T}) for a text of {T} tokens")
    prompt_len = T - args.continuation
    torch.set_grad_enabled(False)
    started = time.time()
    diagnosis = diagnose(model, ids, config, prompt_len, args.chunk, args.kl, args.include_prompt)
    diagnosis.conditions.update(model=args.model, seconds=round(time.time() - started, 1),
                                command="python -m gear_hf.diagnostics " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:]))
    tag = f"{_model_tag(args.model)}-{config.describe()}" + "".join(f"-{k}={v}" for k, v in overrides.items())
    paths = write_report(diagnosis, args.out or DEFAULT_OUT / tag)
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
