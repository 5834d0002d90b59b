"""The decode-path cost model (`gear_hf.backends.cost`) and the choice a cache makes with it (`FusedPath.use_fused`):
pure arithmetic on CPU, no kernel runs."""

from __future__ import annotations

import pytest
import torch

from gear_hf.backends import BackendPlan, cost
from gear_hf.backends.torch_backend import TorchBackend
from gear_hf.backends.triton_backend import TritonBackend
from gear_hf.cache.fused import build_cache
from gear_hf.config import GearConfig

LLAMA3_8B = dict(kv_heads=8, query_heads=32, head_dim=128, buffered=64)


def test_fused_instructions_reproduce_the_compile_report():
    """The per-term figures add up to the report's measured totals (results/decode-kernel-sass)."""
    assert cost.fused_instructions(GearConfig.preset("gear", bits=2)) == pytest.approx(227, abs=1)
    assert cost.fused_instructions(GearConfig.preset("gear", bits=4)) == pytest.approx(230, abs=3)
    assert cost.fused_instructions(GearConfig()) == pytest.approx(172)
    assert cost.fused_instructions(GearConfig.preset("kivi", bits=2)) == pytest.approx(108.5)
    # the tensor-core kernel (16-bit models): its measured figures for the two formats the report compiles for it
    assert cost.fused_instructions(GearConfig.preset("gear", bits=2), tensor_core=True) == pytest.approx(190.5, abs=1)
    assert cost.fused_instructions(GearConfig(), tensor_core=True) == pytest.approx(128.5, abs=1)


def test_bytes_per_token_follow_the_format():
    """keys + values of one token and KV head, side information included: below fp16's 512 bytes, more bits more
    bytes."""
    kivi2, kivi4 = (cost.compressed_bytes_per_token(GearConfig.preset("kivi", bits=b), 128) for b in (2, 4))
    assert 64 < kivi2 < kivi4 < 512
    assert cost.compressed_bytes_per_token(GearConfig.preset("gear", bits=2), 128) > kivi2  # + outliers, factors


@pytest.mark.parametrize("config", [GearConfig(), GearConfig.preset("gear", bits=2), GearConfig.preset("kivi", bits=2)],
                         ids=["default", "gear2", "kivi2"])
def test_short_histories_take_the_fused_kernel(config):
    """One row of 1k tokens: launches dominate, and the fused kernel has 2 against the fallback's 8."""
    assert cost.choose_decode_path(config, tokens=1024, batch=1, **LLAMA3_8B) == "fused"


def test_histories_split_by_format():
    """H200 calibration, the register kernel, the reconstruction at its compiled count: at T=8k, one row,
    gear-2's fused main loop (227 instructions/token) issues more than the fallback's reconstruction + SDPA take,
    kivi-2's (108.5) and GearConfig()'s (172) less; at T=32k, batch 8, the fallback wins for every format."""
    one_row = dict(tokens=8192, batch=1, tensor_core=False, **LLAMA3_8B)
    assert cost.choose_decode_path(GearConfig.preset("gear", bits=2), **one_row) == "fallback"
    assert cost.choose_decode_path(GearConfig.preset("kivi", bits=2), **one_row) == "fused"
    assert cost.choose_decode_path(GearConfig(), **one_row) == "fused"
    batched = dict(tokens=32768, batch=8, tensor_core=False, **LLAMA3_8B)
    for config in (GearConfig(), GearConfig.preset("gear", bits=2), GearConfig.preset("kivi", bits=2)):
        assert cost.choose_decode_path(config, **batched) == "fallback"


def test_reconstruct_instructions_follow_the_compile_report():
    """Per format, the mean of the report's keys and values figures of its nearest compiled case."""
    assert cost.reconstruct_instructions(GearConfig.preset("gear", bits=2)) == pytest.approx((11.9 + 10.7) / 2)
    assert cost.reconstruct_instructions(GearConfig()) == pytest.approx((12.6 + 11.7) / 2)


def test_choice_switches_once_as_the_history_grows():
    """Fused time grows faster with T than the fallback's: once the fallback wins it keeps winning."""
    config = GearConfig.preset("gear", bits=2)
    choices = [cost.choose_decode_path(config, tokens=t, batch=8, tensor_core=False, **LLAMA3_8B)
               for t in range(256, 40000, 512)]
    switch = choices.index("fallback")
    assert choices[:switch] == ["fused"] * switch and set(choices[switch:]) == {"fallback"}


def test_calibration_moves_the_choice():
    """A fused kernel issuing 10x faster (the tensor-core kernel's aim) wins at T=8k, batch 8, where the register
    kernel loses at the default calibration."""
    config = GearConfig.preset("gear", bits=2)
    shape = dict(tokens=8192, batch=8, tensor_core=False, **LLAMA3_8B)
    assert cost.choose_decode_path(config, **shape) == "fallback"
    fast = cost.calibrate(fused_issue_rate=10 * cost.DEFAULT.fused_issue_rate)
    assert cost.choose_decode_path(config, cal=fast, **shape) == "fused"
    with pytest.raises(ValueError, match="unknown calibration"):
        cost.calibrate(bandwith=1.0)


def test_tensor_core_kernel_lowers_the_fused_estimate():
    """16-bit models run the tensor-core kernel (fewer instructions per token): its estimate is below the register
    kernel's, and at T=4k, batch 8 it takes kivi-2's decode steps the register kernel would leave to the fallback
    (from T=8k at batch 8 the fallback wins with either kernel since the reconstruction kernel reached its compiled
    10-12/element)."""
    config = GearConfig.preset("kivi", bits=2)
    shape = dict(tokens=4096, batch=8, **LLAMA3_8B)
    tc, register = (cost.decode_path_costs(config, tensor_core=t, **shape) for t in (True, False))
    assert tc.fused_s < register.fused_s and tc.fallback_s == register.fallback_s
    assert cost.decode_path_costs(config, **shape) == tc  # model_bytes=2: the tensor-core kernel
    assert (tc.choice, register.choice) == ("fused", "fallback")


def test_calibration_from_the_environment(monkeypatch):
    monkeypatch.setenv("GEAR_HF_COST", '{"launch_s": 0}')
    assert cost.calibration().launch_s == 0 and cost.calibration().bandwidth == cost.DEFAULT.bandwidth
    monkeypatch.delenv("GEAR_HF_COST")
    assert cost.calibration() == cost.DEFAULT


def _cache_in_step(tokens_per_row: int, batch: int = 2):
    """A CPU cache mid-step (stored, not attended) whose plan claims the Triton backend for reconstruct and attend,
    under auto: what a CUDA cache would hold (the cost model only looks at the plan and the counts)."""
    cfg = GearConfig.preset("gear", bits=2)
    cache, k, v = build_cache(cfg, batch=batch, kv_heads=1, head_dim=128, steps=[tokens_per_row, 1])
    triton = TritonBackend()
    cache.plan = BackendPlan(TorchBackend(), triton, triton)
    cache.store(0, k, v)
    return cache, torch.zeros(batch, 4, 1, 128)


def test_cache_takes_the_cost_models_choice():
    short, q = _cache_in_step(200)
    assert short.use_fused(q) is True and short.path_costs.choice == "fused"
    long, q = _cache_in_step(3000, batch=8)
    costs = cost.decode_path_costs(long.gear_config, tokens=2944, batch=8, kv_heads=1, query_heads=4, head_dim=128,
                                   buffered=long.layout.plan.attend.buffer[0], model_bytes=4)
    assert long.use_fused(q) is (costs.choice == "fused")
    assert long.path_costs == costs  # the counts the cache passed: compressed tokens and buffered ones per row


def test_decode_path_overrides_the_cost_model():
    cache, q = _cache_in_step(200)
    cache.decode_path = "fallback"
    assert cache.use_fused(q) is False
    cache.decode_path = "fused"
    assert cache.use_fused(q) is True and cache.path_costs is None  # (the model did not run)
    cache.decode_path = "fastest"
    with pytest.raises(ValueError, match="decode_path"):
        cache.use_fused(q)
    assert cache.reference_path_name == "fallback"


def test_forced_backend_keeps_the_fused_kernel():
    """backend='triton' (forced): its fused kernel serves every decode step it can, whatever the estimate."""
    cache, q = _cache_in_step(3000, batch=8)
    triton = TritonBackend()
    cache.plan = BackendPlan(TorchBackend(), triton, triton, forced="triton")
    assert cache.use_fused(q) is True and cache.path_costs is None
