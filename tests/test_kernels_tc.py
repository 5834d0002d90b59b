"""The tensor-core decode kernel (`gear_hf.kernels.triton.tc_kernel`, `decode_attention(tensor_core=True)`) vs the
float32 torch oracle (`gear_hf.cache.fused.reference_decode_attention`), at odd shapes: GQA 1/4/7, head_dim 64/128,
sliding windows, sinks, positions ~30k, left-padded rows, several query tokens; `GearConfig()` (key widths
allocated per channel in bit planes, 3-bit rotated values whose statistics are folded into the probabilities) and
gear-2 (outliers, int8 low-rank factors). Tolerances as tests/test_kernels_decode.py (fp16 5e-3, bf16 2e-2 of
max|oracle|). Without CUDA the kernel runs in Triton's interpreter (bf16 dots upcast to float32 there); shapes stay
small. What the kernel declines (float32 queries) the Triton backend gives the register kernel, and step_paths says
which ran.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gear_hf.cache.fused import build_cache, reference_decode_attention  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from gear_hf.kernels.triton.tc_codes import magic_of, value_codes_magic  # noqa: E402
from gear_hf.kernels.triton.tiles import _load_token_stats  # noqa: E402


@triton.jit
def _magic_codes_kernel(codes_ptr, s_codes, out_ptr, n_valid, D: tl.constexpr, MT: tl.constexpr):
    """16 value rows of `value_codes_magic`, magic subtracted: float32 [16, D] (rows >= n_valid masked)."""
    slot = tl.arange(0, 16)
    v = value_codes_magic(codes_ptr, s_codes, slot, slot < n_valid, D, 3, MT)
    tl.store(out_ptr + slot[:, None] * D + tl.arange(0, D)[None, :], v.to(tl.float32) - magic_of(MT, 3)[1])



@triton.jit
def _stats8_kernel(scale_ptr, zero_ptr, out_scale, out_minimum, TOP: tl.constexpr):
    """Every one of 256 x 256 (scale, zero point) code pairs through `tiles._load_token_stats` (uint8 pointers)."""
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    offsets = rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    scale, minimum = _load_token_stats(scale_ptr, zero_ptr, offsets, rows[:, None] < 256, TOP)
    tl.store(out_scale + offsets, scale)
    tl.store(out_minimum + offsets, minimum)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _run(cfg, *, d=64, kv_heads=2, group=4, batch=2, steps=(77, 40, 1), pad=(0, 13), dtype=torch.float16,
         window=None, offset=0, theta=10000.0, attention_scaling=1.0, **tuning):
    """(tensor-core output, oracle) of a random cache's layer 0."""
    from gear_hf.kernels.decode import decode_attention

    cache, _, _ = build_cache(cfg, batch=batch, kv_heads=kv_heads, head_dim=d, steps=list(steps),
                              pad=list(pad)[:batch], dtype=dtype, device=DEVICE, position_offset=offset)
    q = torch.randn(batch, kv_heads * group, steps[-1], d, generator=torch.Generator().manual_seed(5))
    q = q.to(dtype).to(DEVICE)
    keys, values, layout = cache.kernel_views(0, q.shape[2], q.device)
    kw = dict(scaling=d ** -0.5, inv_freq=_inv_freq(d, theta), attention_scaling=attention_scaling,
              sliding_window=window)
    out = decode_attention(q, keys, values, layout, tensor_core=True, **kw, **tuning)
    return out, reference_decode_attention(cache, 0, q, **kw)


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"
    return err


def _gear2(**kw):
    """gear-2 (outliers, int8 factors) at test sizes: groups of 16, a 32-token buffer, 10% outliers."""
    return GearConfig.preset("gear", bits=2, **{"group_size": 16, "buffer_size": 32, "outlier_ratio": 0.1, **kw})


def _default(**kw):
    """GearConfig() at test sizes (its formats: allocated key widths, 3-bit rotated values, sinks)."""
    return GearConfig(**{"group_size": 32, "buffer_size": 32, "prompt_group_size": 64, **kw})


# (config, head_dim, KV heads, GQA group, batch, query tokens, dtype)
CASES = [
    ("gear2", 64, 2, 4, 2, 1, torch.float16),
    ("gear2", 128, 1, 7, 1, 1, torch.bfloat16),
    ("gear2", 64, 3, 1, 2, 3, torch.float16),  # MHA, 3 new tokens (causal inside them)
    ("default", 64, 2, 4, 2, 1, torch.bfloat16),
    ("default", 128, 1, 7, 2, 1, torch.float16),
    ("default", 64, 2, 1, 1, 4, torch.bfloat16),
]


@pytest.mark.parametrize("name,d,kv_heads,group,batch,q_len,dtype", CASES,
                         ids=[f"{n}-d{d}-kv{h}-g{g}-b{b}-q{q}-{str(t)[6:]}" for n, d, h, g, b, q, t in CASES])
def test_tensor_core_kernel_matches_oracle(name, d, kv_heads, group, batch, q_len, dtype):
    cfg = _gear2() if name == "gear2" else _default()
    out, ref = _run(cfg, d=d, kv_heads=kv_heads, group=group, batch=batch, steps=(77, 40, q_len), dtype=dtype)
    _check(out, ref, dtype)


@pytest.mark.parametrize("name", ["gear2", "default"])
def test_windows_sinks_far_positions_and_padded_rows(name):
    """A sliding window shorter than the history, 4 sinks, positions ~30k (large RoPE angles), llama3-like theta, a
    yarn-like attention_scaling, a left-padded row and 4 query tokens."""
    cfg = _gear2(sink_tokens=4) if name == "gear2" else _default()
    out, ref = _run(cfg, steps=(90, 45, 4), pad=(0, 29), window=37, offset=30000, theta=500000.0,
                    attention_scaling=1.15, dtype=torch.float16)
    _check(out, ref, torch.float16)


def test_64_token_blocks_for_formats_without_outliers_or_factors():
    """GearConfig()'s formats take 64-token blocks by default (gear-2's 32: it would spill), and they equal the oracle
    with a window, two query tokens and a padded row; a chunk of 64 tokens so that a block spans a whole chunk."""
    from gear_hf.kernels.decode import decode_attention

    cfg = _default(buffer_size=64, group_size=64, prompt_group_size=128)
    out, ref = _run(cfg, steps=(150, 100, 2), pad=(0, 41), window=77, dtype=torch.bfloat16)
    _check(out, ref, torch.bfloat16)
    for config, block in ((cfg, 64), (_gear2(buffer_size=64), 32)):
        cache, _, _ = build_cache(config, batch=1, kv_heads=1, head_dim=64, steps=[150, 70, 1], dtype=torch.bfloat16)
        q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
        plan = []
        decode_attention(q, *cache.kernel_views(0, 1, q.device), scaling=0.125, inv_freq=_inv_freq(64),
                         tensor_core=True, _plan=plan)
        assert plan[0][3]["BN"] == block


def test_folded_value_statistics_match_the_unfolded_kernel():
    """GearConfig()'s values (one group per token, no outliers) take the folded path (P·diag(s))·codes + (P·m)·1ᵀ;
    the same kernel with the fold switched off dequantizes per element: both equal the oracle, and a split count
    does not change the result. So does the query-rotated variant compile_check compiles for comparison."""
    cfg = _default()
    folded, ref = _run(cfg, d=64, num_splits=3)
    plain, _ = _run(cfg, d=64, num_splits=1, fold_values=False)
    _check(folded, ref, torch.float16)
    _check(plain, ref, torch.float16)
    # the variant compile_check counts for comparison (query rotated back per token) computes the same
    query_rotated, _ = _run(cfg, d=64, rope_on_query=True)
    _check(query_rotated, ref, torch.float16)


@pytest.mark.parametrize("top", [3, 7, 15, 255])
def test_eight_bit_statistics_decode_bit_for_bit(top):
    """The kernels' decode of 8-bit statistics (`tiles._stats8`: the scale table built from eight constants, the
    zero point's minimum rounded down to bf16) equals `quant.decode_stats8` for every code pair, bit for bit."""
    from gear_hf.compress.quant import decode_stats8

    codes = torch.arange(256, dtype=torch.uint8)
    scale_code, zero_code = (c.contiguous().to(DEVICE) for c in torch.meshgrid(codes, codes, indexing="ij"))
    out_scale, out_minimum = (torch.empty(256, 256, device=DEVICE) for _ in range(2))
    _stats8_kernel[(16,)](scale_code, zero_code, out_scale, out_minimum, top)
    minimum, scale = decode_stats8(scale_code, zero_code, top)
    assert torch.equal(out_scale.view(torch.int32), scale.view(torch.int32))
    assert torch.equal(out_minimum.view(torch.int32), minimum.view(torch.int32))


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16)])
def test_eight_bit_value_statistics_folded_and_per_element(d, dtype):
    """value_statistics="8": the uint8 scale and zero-point codes decoded in the kernel, folded into P (GearConfig()'s
    values) and dequantized per element (the fold off), against the oracle."""
    cfg = _default(value_statistics="8")
    folded, ref = _run(cfg, d=d, dtype=dtype)
    plain, _ = _run(cfg, d=d, dtype=dtype, fold_values=False)
    _check(folded, ref, dtype)
    _check(plain, ref, dtype)


def test_float32_queries_are_declined_with_a_reason():
    from gear_hf.kernels import tensor_core_reason

    assert tensor_core_reason(torch.float16) is None and tensor_core_reason(torch.bfloat16) is None
    reason = tensor_core_reason(torch.float32)
    assert "float32" in reason and "register kernel" in reason
    with pytest.raises(NotImplementedError, match="float32 queries"):
        _run(_gear2(), dtype=torch.float32)


def test_triton_backend_runs_the_tensor_core_kernel_and_names_it():
    """GearCache.fused_attention through the Triton backend: bf16 queries run the tensor-core kernel ("fused-tc"),
    float32 ones the register kernel ("fused", with the reason); both equal the oracle."""
    from gear_hf.backends.triton_backend import TritonBackend
    from gear_hf.cache.kernel_state import KernelState

    backend = TritonBackend()
    for dtype, path in ((torch.bfloat16, "fused-tc"), (torch.float32, "fused")):
        cache, _, _ = build_cache(_gear2(), batch=2, kv_heads=2, head_dim=64, steps=[77, 40, 1], pad=[0, 13],
                                  dtype=dtype, device=DEVICE)
        q = torch.randn(2, 8, 1, 64, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
        keys, values, layout = cache.kernel_views(0, 1, q.device)
        shared = KernelState()
        out = backend.attend(q, keys, values, layout, scaling=0.125, inv_freq=_inv_freq(64), attention_scaling=1.0,
                             sliding_window=None, shared=shared)
        assert shared.attend_path == path and (shared.attend_reason is None) == (path == "fused-tc")
        ref = reference_decode_attention(cache, 0, q, scaling=0.125, inv_freq=_inv_freq(64))
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), (dtype, err)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gear2", "default"])
def test_tensor_core_kernel_compiled_at_llama_shapes(name):
    """On a GPU: the compiled kernel (real tensor cores, bf16) at Llama-3-8B head shapes and a longer history."""
    cfg = GearConfig.preset("gear", bits=2) if name == "gear2" else GearConfig()
    out, ref = _run(cfg, d=128, kv_heads=2, group=4, batch=2, steps=(700, 300, 1), pad=(0, 77), dtype=torch.bfloat16)
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_magic_value_codes_equal_the_packed_codes(dtype):
    """`tc_codes.value_codes_magic` (3-bit value rows read as 32-bit words, two codes built per word in the mantissas
    of 16-bit magic floats) gives magic + code for every code of `quant.pack_codes`' 3-bit layout: all 8 codes in
    every position, head_dim 64 and 128, a masked row reading code 0."""
    from gear_hf.compress.quant import pack_codes

    gen = torch.Generator().manual_seed(3)
    for d in (64, 128):
        codes = torch.randint(0, 8, (16, d), generator=gen, dtype=torch.uint8)
        codes[0] = torch.arange(d) % 8  # every code at every position of a unit
        codes[1] = 7 - torch.arange(d) % 8
        packed = pack_codes(codes, 3, dim=-1).to(DEVICE)  # [16, 3d/8]
        out = torch.empty(16, d, device=DEVICE)
        _magic_codes_kernel[(1,)](packed, packed.stride(0), out, 15, D=d,
                                  MT=tl.float16 if dtype == torch.float16 else tl.bfloat16)
        expected = codes.float().to(DEVICE)
        expected[15] = 0  # the masked row
        assert torch.equal(out, expected)



@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16), (128, torch.float16)])
def test_folded_magic_values_match_oracle(d, dtype):
    """One value group per token (value_group_size = head_dim): the fold with the values' 3-bit codes read as magic
    floats (P·(magic + code) - magic·rowsum(P)) equals the oracle, with a padded row, sinks and far positions."""
    from gear_hf.kernels.decode import decode_attention

    cfg = _default(value_group_size=d)
    out, ref = _run(cfg, d=d, kv_heads=1, group=4, steps=(77, 40, 2), dtype=dtype, offset=30000)
    _check(out, ref, dtype)
    cache, _, _ = build_cache(cfg, batch=1, kv_heads=1, head_dim=d, steps=[77, 40, 1], dtype=dtype)
    q = torch.zeros(1, 4, 1, d, dtype=dtype)
    plan = []
    decode_attention(q, *cache.kernel_views(0, 1, q.device), scaling=0.125, inv_freq=_inv_freq(d), tensor_core=True,
                     _plan=plan)
    kwargs = plan[0][3]
    assert kwargs["P_V_BITS"] == 3 and kwargs["P_V_STATS_W"] == 1 and kwargs["D_V_STATS_W"] == 1  # the fold runs
