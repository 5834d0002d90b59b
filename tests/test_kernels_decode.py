"""Fused GEAR decode attention vs the float32 torch oracle: the Triton kernel and the numba CPU kernel
(`gear_hf.kernels.cpu.attend`), which take the same views and compute the same thing.

The oracle (gear_hf.cache.fused) reconstructs each row's tokens with the torch engine
(ChunkStore.reconstruct -> compress.decompress, float32), rotates keys at their stored positions and runs a
causal (+ sliding window) softmax in float32. The kernel reads the same stored tensors, so the only
differences are float32 summation order, the dtype of tl.dot operands (fp16: rotated keys and probabilities
are rounded to fp16 for the dots; bf16 is upcast to fp32 in the interpreter) and the rounding of the output:

    tolerance on max|fused - oracle| / max|oracle|:  fp32 1e-5,  fp16 5e-3,  bf16 2e-2
    (observed: fp32 ~1e-6; fp16 4e-4..1e-3; bf16 3e-3..6e-3, i.e. about one output rounding, 2^-11 / 2^-8,
    with margin for the fp16 score rounding on keys that have large outlier channels)

(The CPU kernel computes in float32 whatever the dtype: its error is the output rounding.)
Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before gear_hf.kernels.decode
is imported); with CUDA the same tests run compiled on the GPU. Shapes are small (tens to ~150 tokens per row,
never multiples of the group or buffer) to keep the interpreted suite fast; `slow` marks the bigger sweeps.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gear_hf.cache.fused import build_cache, reference_decode_attention  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture(params=["triton", "numba"])
def impl(request):
    """Which kernel a test runs: the Triton one (compiled on CUDA, else interpreted) or the numba CPU one."""
    if request.param == "numba" and DEVICE != "cpu":
        pytest.skip("the numba kernel reads CPU tensors")
    pytest.importorskip(request.param)
    return request.param


def _attend(cache, q, inv_freq, impl="triton", **kw):
    """The kernel's attention over layer 0 of the cache (the cache's views, as `GearCache.fused_attention` passes
    them)."""
    if impl == "numba":
        from gear_hf.kernels.cpu import decode_attention
    else:
        pytest.importorskip("triton")
        from gear_hf.kernels.decode import decode_attention
    keys, values, layout = cache.kernel_views(0, q.shape[2], q.device)
    return decode_attention(q, keys, values, layout, scaling=q.shape[-1] ** -0.5, inv_freq=inv_freq, **kw)


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _case(method="gear", bits=4, *, d=64, kv_heads=2, group=4, batch=3, q_len=1, dtype=torch.float32, steps=None,
          pad=None, sink=0, window=None, offset=0, attention_scaling=1.0, theta=10000.0, num_splits=None,
          seed=0, impl="triton", **cfg_overrides):
    """Build a cache (group size 16, buffer 32, 10% outliers so the sparse term matters), attend with `impl`,
    compare."""
    overrides = dict(group_size=16, buffer_size=32, sink_tokens=sink)
    if method in ("gear", "outlier"):
        overrides["outlier_ratio"] = 0.1
    overrides.update(cfg_overrides)
    cfg = GearConfig.preset(method, bits=bits, **overrides)
    steps = steps or [77, 40, q_len]
    pad = pad if pad is not None else [0, 20, 41][:batch]
    cache, _, _ = build_cache(cfg, batch=batch, kv_heads=kv_heads, head_dim=d, steps=steps, pad=pad, dtype=dtype,
                              device=DEVICE, seed=seed, position_offset=offset)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, kv_heads * group, steps[-1], d, generator=g).to(dtype).to(DEVICE)
    inv_freq = _inv_freq(d, theta)
    kw = dict(attention_scaling=attention_scaling, sliding_window=window)
    tuning = {"num_splits": num_splits} if impl == "triton" else {}
    out = _attend(cache, q, inv_freq, impl, **tuning, **kw)
    ref = reference_decode_attention(cache, 0, q, scaling=d ** -0.5, inv_freq=inv_freq, **kw)
    return cache, q, out, ref


def _rel(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


# (method, bits, head_dim, kv heads, GQA group, batch, q_len, dtype) — odd token counts everywhere
FAST = [
    ("gear", 4, 64, 2, 4, 3, 1, torch.float32),
    ("gear", 2, 128, 1, 1, 1, 4, torch.float16),  # MHA, 4 new tokens (causal inside them)
    ("gear", 4, 64, 1, 7, 3, 4, torch.float32),  # GQA 7
    ("gear", 8, 128, 2, 4, 3, 1, torch.float16),
    ("gear", 2, 64, 2, 4, 3, 1, torch.bfloat16),  # interpreter: bf16 upcast to fp32 for tl.dot
    ("kivi", 2, 64, 2, 4, 1, 1, torch.float16),
    ("kcvt", 4, 64, 2, 1, 3, 1, torch.float32),
    ("outlier", 4, 64, 2, 4, 3, 1, torch.float32),
    ("gear-l", 2, 64, 2, 4, 3, 4, torch.float32),
    ("fp16", 4, 64, 2, 4, 3, 4, torch.float16),  # no compression: everything in the buffer
    ("gear", 3, 64, 2, 4, 3, 1, torch.float32),  # 3-bit codes: 8 codes in 3 bytes (keys along tokens)
    ("kivi", 3, 128, 1, 4, 2, 4, torch.float16),
]


@pytest.mark.parametrize("method,bits,d,kv_heads,group,batch,q_len,dtype", FAST,
                         ids=[f"{m}{b}-d{d}-kv{h}-g{g}-b{B}-q{q}-{str(t)[6:]}" for m, b, d, h, g, B, q, t in FAST])
def test_fused_matches_oracle(method, bits, d, kv_heads, group, batch, q_len, dtype, impl):
    _, _, out, ref = _case(method, bits, d=d, kv_heads=kv_heads, group=group, batch=batch, q_len=q_len, dtype=dtype,
                          impl=impl)
    _check(out, ref, dtype)


def test_sink_sliding_window_and_far_positions(impl):
    """Attention sinks, a sliding window shorter than the history, positions ~30k (large RoPE angles),
    llama3-like theta and a yarn-like attention_scaling."""
    _, _, out, ref = _case(sink=4, window=37, offset=30000, theta=500000.0, attention_scaling=1.15, q_len=4,
                          impl=impl)
    _check(out, ref, torch.float32)


def test_query_tokens_inside_a_fresh_chunk_and_empty_buffer(impl):
    """The step's own tokens were just compressed (buffer left empty), a prompt that is exactly chunked."""
    cache, _, out, ref = _case(steps=[64, 28, 4], pad=[0, 0, 16], q_len=4, impl=impl)
    assert 0 in cache.buffer_len and min(cache.decode_chunks) >= 1
    _check(out, ref, torch.float32)


def test_prompt_only_and_buffer_only_rows(impl):
    """A first decode step right after the prompt (no decode chunk yet), and a prompt shorter than a group
    for one row (that row has no prompt chunk: everything in its buffer)."""
    _, _, out, ref = _case(steps=[45, 1], pad=[0, 30, 10], impl=impl)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_count_does_not_change_the_result(num_splits):
    _, _, out, ref = _case(q_len=4, group=2, num_splits=num_splits, steps=[93, 70, 4])
    _check(out, ref, torch.float32)


def test_every_term_is_exercised(impl):
    """Zeroing any GEAR term in storage changes the oracle far beyond the tolerance, and the kernel follows:
    the comparison above is not blind to the sparse, low-rank or quantized parts."""
    cache, q, out, ref = _case(q_len=1, impl=impl)
    _check(out, ref, torch.float32)
    layer = cache.layers[0]
    inv_freq = _inv_freq(q.shape[-1])
    for stream, name in ((layer.key_stream, "sparse_values"), (layer.value_stream, "sparse_values"),
                         (layer.key_stream, "lowrank_a"), (layer.value_stream, "lowrank_a"),
                         (layer.key_stream, "minimum"), (layer.value_stream, "scale")):
        saved = [(store, store.fields[name].clone()) for store in (stream.prefill, stream.decode)]
        for store, _ in saved:
            store.fields[name].zero_()
        new_ref = reference_decode_attention(cache, 0, q, scaling=q.shape[-1] ** -0.5, inv_freq=inv_freq)
        new_out = _attend(cache, q, inv_freq, impl)
        assert _rel(new_ref, ref) > 100 * TOL[torch.float32], name
        _check(new_out, new_ref, torch.float32)
        for store, t in saved:
            store.fields[name].copy_(t)


def test_writes_every_output_element(impl):
    """Poison the output first: every element must be overwritten (padded query rows included)."""
    cache, q, out, ref = _case(q_len=4, impl=impl)
    poisoned = torch.full_like(out, float("nan"))
    got = _attend(cache, q, _inv_freq(q.shape[-1]), impl, out=poisoned)
    assert got.data_ptr() == poisoned.data_ptr()
    assert torch.isfinite(poisoned).all()
    _check(poisoned, ref, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d,kv_heads,group", [(64, 2, 1), (64, 1, 4), (128, 2, 7)])
@pytest.mark.parametrize("batch,q_len,bits", [(1, 1, 2), (3, 4, 4)])
def test_fused_sweep(dtype, d, kv_heads, group, batch, q_len, bits, impl):
    """The matrix of the issue: head_dim 64/128 x GQA 1/4/7 x (batch 1, q_len 1 | batch 3, q_len 4) x
    fp32/fp16/bf16, 2-bit with sinks and 4-bit without."""
    _, _, out, ref = _case("gear", bits, d=d, kv_heads=kv_heads, group=group, batch=batch, q_len=q_len,
                           dtype=dtype, steps=[101, 77, q_len], pad=[0, 13, 60][:batch], sink=2 if bits == 2 else 0,
                           impl=impl)
    _check(out, ref, dtype)


def test_prepare_derived_sorts_each_chunk_by_token():
    """Key outliers sorted by token inside each chunk, empty slots last, per-16-token offsets; chunk by chunk
    equals all at once (the cache may derive only a new chunk)."""
    from dataclasses import replace

    from gear_hf.kernels.views import prepare_derived

    cache, q, _, _ = _case(steps=[77, 70, 1])
    keys, _, layout = cache.kernel_views(0, q.shape[2], q.device)
    chunks = layout.max_decode_chunks
    run = keys.decode
    derived = prepare_derived(run, chunks)
    d = run.sparse_values.shape[-1]
    k2 = run.extent("sparse_values")
    where = derived["key_outlier_where"].view(*run.sparse_values.shape[:2], chunks, k2 * d)
    assert (where[..., 1:] >= where[..., :-1]).all()
    tiles = derived["key_outlier_tile"]
    for u in range(tiles.shape[-1]):
        want = (where < min(16 * u, run.chunk_len) * d).sum(-1)
        assert torch.equal(tiles[..., u].long(), want)
    values = derived["key_outlier_value"].view_as(where)
    total = run.sparse_values[:, :, : chunks * k2].float().reshape(*where.shape).sum(-1)
    assert torch.allclose(values.float().sum(-1), total)
    one = prepare_derived(replace(run), 1)
    assert torch.equal(one["key_outlier_where"], derived["key_outlier_where"][..., : k2 * d])


def test_views_with_derived_data_match_the_adapter():
    """decode_attention on views built by hand (derived outliers passed in, as the cache will) equals the
    adapter's result."""
    from dataclasses import replace

    from gear_hf.kernels.decode import decode_attention
    from gear_hf.kernels.views import prepare_derived

    cache, q, out, ref = _case(sink=2, steps=[77, 40, 2], q_len=2)
    keys, values, layout = cache.kernel_views(0, q.shape[2], q.device)
    keys = replace(keys, prompt=replace(keys.prompt, derived=prepare_derived(keys.prompt, 1)),
                   decode=replace(keys.decode, derived=prepare_derived(keys.decode, layout.max_decode_chunks)))
    got = decode_attention(q, keys, values, layout, scaling=q.shape[-1] ** -0.5, inv_freq=_inv_freq(q.shape[-1]))
    assert torch.equal(got, out)
    _check(got, ref, torch.float32)


# Storage options beyond the paper read by the fused kernel: int8 low-rank factors, Walsh–Hadamard
# rotation (keys un-rotated per block before RoPE, values' rotation undone once on the output), separate key and
# value group sizes, 3-bit codes — alone and together.
STORAGE = [
    ("gear", 2, dict(factor_bits=8)),  # fp32: int8 factors exact up to float32 rounding
    ("gear-l", 4, dict(factor_bits=8, dtype=torch.float16)),
    ("kivi", 3, dict(rotation="both", sink=4, q_len=4)),
    ("kivi", 2, dict(rotation="keys", d=128, dtype=torch.bfloat16)),
    ("gear", 4, dict(rotation="values", factor_bits=8, group=7)),
    ("gear-l", 3, dict(rotation="both", factor_bits=8, key_group_size=32, value_group_size=16, dtype=torch.float16)),
    ("kivi", 4, dict(key_group_size=32, value_group_size=8, window=37)),
    ("gear-l", 4, dict(rank_prefill=16, rank_decode=16)),  # the largest rank one 16-wide dot operand holds
    # values per channel over token groups (value_axis="channel"), read like keys: a group spanning whole blocks
    # (one row of statistics per block) or shorter than a block, 2/3/4/8 bits, rotated, with low-rank factors
    ("kivi", 2, dict(value_axis="channel", rotation="both", sink=4, range_search="values", key_group_size=32,
                     value_group_size=32)),
    ("kivi", 3, dict(value_axis="channel", value_group_size=16, q_len=4, dtype=torch.float16)),
    ("gear-l", 4, dict(value_axis="channel", factor_bits=8, rotation="values", dtype=torch.bfloat16)),
    ("kivi", 8, dict(value_axis="channel", value_group_size=32, window=37, d=128)),
    # the prompt chunk in longer token groups than the decode chunks (prompt_group_size)
    ("kivi", 3, dict(value_axis="channel", rotation="both", prompt_group_size=32, sink=4)),
    ("gear", 4, dict(prompt_group_size=64, factor_bits=8, dtype=torch.float16)),
    # key widths allocated per channel (bit planes): halves with different bit totals, both runs, low rank, windows
    ("kivi", 2, dict(key_bits=3.5, key_bit_allocation="query", rotation="values", sink=4, q_len=4)),
    ("kivi", 3, dict(key_bits=2.5, key_bit_allocation="query", value_axis="channel", prompt_group_size=32,
                     dtype=torch.bfloat16)),
    ("gear-l", 4, dict(key_bits=3.125, key_bit_allocation="query", factor_bits=8, d=128, window=37,
                       dtype=torch.float16)),
    # widths of 6 to 8 bits: planes 4-7 (the kernel transposes the planes as two 32-bit halves)
    ("kivi", 4, dict(key_bits=6.5, key_bit_allocation="query", sink=4)),
    # 8-bit value statistics (uint8 scale and zero-point codes, decoded in the kernel): 3-bit rotated values, and
    # 4-bit values with value outliers beside them
    ("kivi", 3, dict(value_statistics="8", rotation="values", sink=4, dtype=torch.bfloat16)),
    ("gear", 4, dict(value_statistics="8", value_group_size=32, d=128, dtype=torch.float16)),
]


@pytest.mark.parametrize("method,bits,kw", STORAGE, ids=[f"{m}{b}-" + "-".join(f"{k}={v}" for k, v in kw.items())
                                                         for m, b, kw in STORAGE])
def test_fused_reads_issue9_storage(method, bits, kw, impl):
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    _, _, out, ref = _case(method, bits, dtype=dtype, impl=impl, **kw)
    _check(out, ref, dtype)


RECOMMENDED_CASES = [("default", 64, torch.float32, [300, 170, 1]), ("default", 128, torch.bfloat16, [300, 170, 1]),
                     ("compact", 64, torch.bfloat16, [300, 170, 1])]


@pytest.mark.parametrize("name,d,dtype,steps", RECOMMENDED_CASES,
                         ids=[f"{n}-d{d}-{str(t)[6:]}" for n, d, t, _ in RECOMMENDED_CASES])
def test_recommended_configs_run_fused(name, d, dtype, steps, impl):
    """GearConfig() itself (kivi, key widths allocated by the queries, mean 3.125 bits; 3-bit values per token,
    rotated, 8-bit statistics; 64-token groups and buffer, the prompt in 256-token groups, 4 sinks, coded buffers,
    values held a chunk longer) and the "compact" recommendation (values per channel, ranges searched): the fused
    kernel covers them and equals the oracle (prompt chunk, decode chunks, buffer, sinks, a padded row)."""
    from gear_hf.backends.triton_backend import fused_supported

    cfg = GearConfig() if name == "default" else GearConfig.recommended(name=name)
    if impl == "triton":
        assert fused_supported(cfg, d, 1) is None
    else:
        from gear_hf.backends.numba_backend import attend_supported

        assert attend_supported(cfg, d, dtype) is None
    cache, _, _ = build_cache(cfg, batch=2, kv_heads=2, head_dim=d, steps=steps, pad=[0, 37], dtype=dtype,
                              device=DEVICE)
    assert min(cache.decode_chunks) >= 1 and min(cache.prefill_len) > 0
    q = torch.randn(2, 8, 1, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    out = _attend(cache, q, _inv_freq(d), impl)
    ref = reference_decode_attention(cache, 0, q, scaling=d ** -0.5, inv_freq=_inv_freq(d))
    _check(out, ref, dtype)
    # the rotation is really undone by the kernel: the same codes read as unrotated are far off
    for stream in cache.layers[0].streams:
        for store in (stream.prefill, stream.decode):
            store.spec = dataclasses.replace(store.spec, rotate=False)
    wrong = _attend(cache, q, _inv_freq(d), impl)
    assert _rel(wrong, ref) > 0.2
