"""Generation under torch.inference_mode() equals torch.no_grad() token for token, on every backend here, for
GearConfig(), the paper presets and the recommended names; after copy.deepcopy too; and caches made and dropped in
a row leave nothing behind (derived state belongs to the cache, not to module memos)."""

from __future__ import annotations

import copy

import pytest
import torch

import gear_hf
from gear_hf import GearConfig
from gear_hf.backends import import_problem
from gear_hf.config import RECOMMENDED
from memory_count import live_tensors
from tiny_models import tiny_model

SMALL = dict(group_size=16, buffer_size=16)  # chunks flush within a short generation
CONFIGS = {"default": GearConfig(**SMALL, prompt_group_size=32)}
CONFIGS.update({name: GearConfig.preset(name, **SMALL) for name in
                ("fp16", "kivi-2", "kcvt-4", "outlier-2", "gear-l-2", "gear-2", "gear-4")})
CONFIGS.update({f"recommended-{name}": GearConfig.recommended(name=name, **SMALL, prompt_group_size=32)
                for name, _, _, _ in RECOMMENDED})
# values per channel with searched ranges and a 16-bit buffer (the advanced options' other formats)
CONFIGS["values-per-channel"] = GearConfig(**SMALL, prompt_group_size=32, key_bits=2.5, value_bits=2,
                                           value_axis="channel", range_search="values", key_buffer="full",
                                           value_buffer="full")
# "auto" is numba here when it is installed (for the operations it serves: a range-searched format compresses in torch)
BACKENDS = ["torch"] + (["auto"] if import_problem("numba") is None else [])


def _prompt(batch=2, length=37):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :5] = 0  # a left-padded row
    return ids, mask


def _generate(model, config, grad_mode, new_tokens=24):
    ids, mask = _prompt()
    with gear_hf.enabled(model, config), grad_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        cache = gear_hf.last_cache(model)
    return out, cache


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama3", head_dim=32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_inference_mode_equals_no_grad(model, name, backend):
    config = CONFIGS[name].replace(backend=backend)
    tokens, cache = _generate(model, config, torch.no_grad)
    inference_tokens, inference_cache = _generate(model, config, torch.inference_mode)
    assert torch.equal(tokens, inference_tokens)
    if config.compresses:
        assert sum(inference_cache.decode_chunks) > 0  # compressed chunks were written and read
    if backend == "auto" and config.compresses:
        assert inference_cache.backend_names["attend"] == "numba"
        assert inference_cache.step_paths.get("fused", 0) > 0


def test_inference_mode_with_the_triton_kernel_interpreted(model):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        from gear_hf.kernels import interpreting

        if not interpreting():
            pytest.skip("TRITON_INTERPRET is not set")
    config = GearConfig.preset("gear-2", **SMALL, backend="triton")
    tokens, _ = _generate(model, config, torch.no_grad, new_tokens=12)
    inference_tokens, cache = _generate(model, config, torch.inference_mode, new_tokens=12)
    assert torch.equal(tokens, inference_tokens) and cache.step_paths["fused"] > 0


def test_deepcopied_model_generates_the_same_under_inference_mode(model):
    config = CONFIGS["default"]
    tokens, _ = _generate(model, config, torch.no_grad)
    with gear_hf.enabled(model, config):
        twin = copy.deepcopy(model)
    ids, mask = _prompt()
    with torch.inference_mode():
        copied = twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, copied)
    assert gear_hf.last_cache(twin) is not None


def test_caches_made_and_dropped_leave_nothing(model):
    ids, mask = _prompt(1, 20)
    config = CONFIGS["default"]

    def once():
        with torch.inference_mode():
            model.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=18,
                           do_sample=False, pad_token_id=0)

    with gear_hf.enabled(model, config):
        for _ in range(5):
            once()
        before = live_tensors()[0]  # (the last cache stays reachable through last_cache: one, before and after)
        for _ in range(100):
            once()
        after = live_tensors()[0]
    assert after <= before, (before, after)
