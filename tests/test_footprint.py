"""The cache owns what it says, little beyond what it holds, and the recommendations keep their promise."""

from __future__ import annotations

import pytest
import torch

import gear_hf
from gear_hf.config import RECOMMENDED
from gear_hf.hf_compat import model_cache_kwarg
from gear_hf.measure import owned_bits_budget, owned_bits_over_decode
from tiny_models import tiny_model


@pytest.mark.parametrize("name,table_bits", [(n, b) for n, b, _, _ in RECOMMENDED])
def test_recommended_bits_are_what_the_cache_owns_at_every_length(name, table_bits):
    """RECOMMENDED's bits are the most a recommendation owns (mean over 128 decode steps after a prompt of 512, 1024
    or 4096 tokens; bf16; head_dim 64 and 128): the table is not stale, and recommended(b) owns <= b at each."""
    run = owned_bits_budget(gear_hf.GearConfig.recommended(name=name))
    assert abs(run["budget"] - table_bits) <= 0.006, (name, run)
    assert owned_bits_budget(gear_hf.GearConfig.recommended(table_bits))["budget"] <= table_bits + 0.005


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_coded_buffer_keeps_the_owned_bits_near_the_compressed_ones_after_a_1024_token_prompt(head_dim):
    """bf16, 1024-token prompt, over the first buffer cycle (the buffer weighs most at T~1.1k): GearConfig() owns
    <= 3.6 bits at every step; with the 16-bit buffer of config version 1 the same configuration owns up to 5 bits."""
    # (keys held too, both released 32 tokens after the flush, 3-bit keys in the chunks; observed 3.597 / 3.518)
    default = owned_bits_over_decode(gear_hf.GearConfig(), head_dim, 1024, 1160)
    assert default["max_owned"] <= 3.6, default
    old = gear_hf.GearConfig.from_dict({"gear_config_version": 1})  # the 16-bit buffer
    assert owned_bits_over_decode(old, head_dim, 1024, 1040)["max_owned"] > 4.5


@pytest.mark.parametrize("head_dim", [64, 128])
def test_spare_capacity_stays_small_over_a_long_generation(head_dim):
    """From T=512 on, what the cache owns beyond what its tokens hold (spare capacity, workspaces) <= 10%."""
    run = owned_bits_over_decode(gear_hf.GearConfig(), head_dim, 512, 2048)
    assert run["max_slack"] <= 0.10, run


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_generate_owns_no_spare_capacity_without_a_known_length(context):
    """generate reserves room only for a length it is known to reach (min_new_tokens): with max_new_tokens alone
    the stores hold their tokens and nothing more than a few columns of bookkeeping."""
    model = tiny_model("llama3", dtype=torch.bfloat16, head_dim=32)
    gear_hf.enable(model, gear_hf.GearConfig())
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    with context():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=150, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    report = gear_hf.last_cache(model).memory_report()
    # (what is not held: the position tables' granule and a released prompt's buffer column at most)
    assert report["spare_bytes"] <= 0.01 * report["held_bytes"], report
    assert report["bits_per_element"] * report["elements"] == pytest.approx(8 * report["owned_bytes"])
    assert report["owned_bytes"] == (report["held_bytes"] + report["spare_bytes"] + report["kernel_state_bytes"]
                                     + report["workspace_bytes"])
    assert "owns" in gear_hf.last_cache(model).summary()


@pytest.mark.parametrize("arch,prompt,new,buffers", [("llama3", 1, 5, "full"), ("llama3", 1, 5, "coded"),
                                                     ("mistral", 100, 60, "coded")])
def test_where_compression_cannot_pay_the_cache_owns_what_dense_would(arch, prompt, new, buffers):
    """A 1-token prompt (every token in the buffer) owns exactly the dense cache with a 16-bit buffer (no positions,
    no allocation statistics beside it) and less with GearConfig()'s coded one; Mistral's 16-token window (<= 2 x the
    buffer) is stored dense and summary() says why (every step and more configs:
    tests/test_never_above_dense.py)."""
    model = tiny_model(arch, dtype=torch.bfloat16, head_dim=32)
    config = gear_hf.GearConfig()
    gear_hf.enable(model, config.replace(key_buffer="full", value_buffer="full") if buffers == "full" else config)
    ids = torch.randint(3, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    cache = gear_hf.last_cache(model)
    report = cache.memory_report()
    assert report["owned_bytes"] <= report["dense_bytes"] and not report["above_dense"], report
    if arch == "mistral":
        assert report["dense_layers"] and "store dense (why: sliding window 16 <= 2 x buffer_size" in cache.summary()
    else:
        assert not report["dense_layers"]
        if buffers == "full":
            assert report["owned_bytes"] == report["dense_bytes"]
        else:  # 4 of the 6 tokens are exact sinks; the other 2 held at 8-bit keys / 4-bit values + scale/min
            assert report["owned_bytes"] < report["dense_bytes"]
    gear_hf.disable(model)


def test_the_summary_of_an_empty_cache_says_it_is_empty():
    model = tiny_model("llama3", dtype=torch.float32)
    gear_hf.enable(model)
    cache = gear_hf.GearCache(model, gear_hf.GearConfig())
    assert cache.summary() == "balanced: empty (nothing stored yet), owns 0.00 MiB"
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]), **{model_cache_kwarg(model): cache})
    line = cache.summary()
    assert line.startswith("balanced: 3 tokens/layer, owns ") and "None" not in line
    assert "MiB instead of " in line and "MiB float32" in line and "MiB at 16 bits" in line  # (fp32: both)


def test_the_summary_names_the_configuration_and_counts_rows_apart():
    """summary() leads with the name the user asked for and says rows and tokens per row (not their sum); a 16-bit
    model is compared with its own dtype only."""
    model = tiny_model("llama3", dtype=torch.bfloat16)
    config = gear_hf.GearConfig.recommended("smallest", group_size=16, buffer_size=16, prompt_group_size=32)
    gear_hf.enable(model, config)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    line = gear_hf.last_cache(model).summary()  # (generate stores every token but the last it returns: 40 + 5 - 1)
    assert line.startswith("kivi-2-query-allocated (custom): 2 rows of up to 44 tokens/layer, owns "), line
    assert "MiB instead of " in line and "MiB bfloat16 (" in line and "at 16 bits" not in line, line
    gear_hf.enable(model, gear_hf.GearConfig.recommended("smallest"))
    with torch.no_grad():
        model.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=2,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    assert gear_hf.last_cache(model).summary().startswith("smallest: 41 tokens/layer, owns "), \
        gear_hf.last_cache(model).summary()
