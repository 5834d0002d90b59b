"""The memory-bound fallback: the Triton reconstruction kernel against the torch oracle, and the reference path it
serves (keys rotated as they are read, into the step's workspace) against the torch backend's.

Store level: each compressed run (prompt chunk, decode chunks; keys and values) reconstructed by
`kernels.reconstruct_run` vs `compress.decompress` in float32 (+ `rope.apply_rotary` in float32 for keys at
positions ~30k). The kernel computes in float32 and rounds once to the output dtype:

    tolerance on max|kernel - oracle| / max|oracle|:  fp32 1e-5,  fp16 2e-3,  bf16 1e-2  (about one output rounding)

Cache level: `GearCache.attention_inputs` of one decode step with the Triton plan vs the same stored tensors read
by the torch plan in float32 (the oracle; sinks, left-padded rows, GQA 1/4/7), and SDPA over both. Without CUDA
the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 before gear_hf.kernels modules are imported);
shapes stay small.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from gear_hf import backends  # noqa: E402
from gear_hf.backends.torch_backend import TorchBackend  # noqa: E402
from gear_hf.cache.fused import build_cache  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402
from gear_hf.kernels import reconstruct_run  # noqa: E402
from gear_hf.kernels.views import ChunkRunView  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# attention over them: tests/test_kernels_decode.py's tolerances against the float32 oracle (scores amplify the
# rounding of keys with large outlier channels)
ATTENTION_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _tables(positions: torch.Tensor, d: int, dtype, theta=10000.0):
    """HF-style (cos, sin) [B, T, d] at positions [B, T] (the two halves repeat the angles)."""
    angles = positions[..., None].float() * _inv_freq(d, theta).to(positions.device)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


CONFIGS = {
    "gear2": dict(method="gear", bits=2, outlier_ratio=0.1),  # int8 factors (the presets)
    "gear3-f16": dict(method="gear", bits=3, outlier_ratio=0.1, factor_bits=16),
    "gear4-rotated": dict(method="gear", bits=4, outlier_ratio=0.1, rotation="both"),  # key outliers rotated too
    "kivi2": dict(method="kivi", bits=2),
    "kcvt4": dict(method="kcvt", bits=4),
    "kivi8": dict(method="kivi", bits=8),  # 8-bit codes: one byte per code, the top byte's mask above int32's sign
    "gear8": dict(method="gear", bits=8, outlier_ratio=0.1),  # 8-bit words as 4 row sets per thread (rank 4)
    "axes-flipped": dict(method="gear", bits=4, outlier_ratio=0.1, key_axis="token", value_axis="channel"),
    "default": dict(recommended="accurate"),  # allocated key widths (bit planes), 3-bit rotated values, sinks
    "compact": dict(recommended="compact"),  # values per channel, ranges searched
    "default-stats8": dict(recommended="accurate", value_statistics="8"),  # 3-bit values, 8-bit statistics
    "kivi4-stats8": dict(method="kivi", bits=4, value_statistics="8"),  # 4-bit values, 8-bit statistics
}


def _config(name: str, **extra) -> GearConfig:
    """The named configuration at test sizes (groups of 16-32 tokens, a buffer of 32)."""
    c = dict(CONFIGS[name])
    if "recommended" in c:
        return GearConfig.recommended(name=c.pop("recommended"), group_size=32, key_group_size=32,
                                      value_group_size=None, prompt_group_size=None, buffer_size=32, **c, **extra)
    method, bits = c.pop("method"), c.pop("bits")
    return GearConfig.preset(method, bits=bits, group_size=16, buffer_size=32, **c, **extra)


def _stores(cache):
    """(name, store, chunks in use, stream kind) of layer 0."""
    layer = cache.layers[0]
    for stream in layer.streams:
        if stream.prefill is not None and stream.prefill.fields:
            yield f"{stream.kind} prompt", stream.prefill, 1, stream.kind
        chunks = max(cache.decode_chunks)
        if chunks and stream.decode.fields:
            yield f"{stream.kind} decode", stream.decode, chunks, stream.kind


# (name, head_dim, dtype, prompt length): prompts of 77 tokens fit one program; 300 take two programs per prompt
# chunk (`reconstruct.TILES_PER_PROGRAM` tiles of `BLOCK_TOKENS` each), the second ending in a partial tile
STORE_CASES = [("gear2", 64, torch.float32, 77), ("gear3-f16", 64, torch.float32, 77),
               ("gear4-rotated", 64, torch.bfloat16, 77), ("kivi2", 128, torch.float16, 77),
               ("kcvt4", 64, torch.float32, 77), ("axes-flipped", 64, torch.float32, 77),
               ("default", 128, torch.bfloat16, 77), ("compact", 64, torch.float32, 77),
               ("gear2", 128, torch.bfloat16, 300), ("default", 64, torch.float32, 300),
               ("kivi8", 64, torch.float32, 77), ("gear3-f16", 128, torch.bfloat16, 300),
               ("gear8", 128, torch.float16, 300), ("default-stats8", 64, torch.bfloat16, 300),
               ("kivi4-stats8", 128, torch.float32, 77)]


@pytest.mark.parametrize("name,d,dtype,prompt", STORE_CASES,
                         ids=[f"{n}-d{d}-{str(t)[6:]}-T{p}" for n, d, t, p in STORE_CASES])
def test_reconstruct_matches_oracle(name, d, dtype, prompt):
    """Every run of a cache (odd prompt, padded row), keys rotated at positions ~30k, in the model dtype."""
    cfg = _config(name)
    cache, _, _ = build_cache(cfg, batch=2, kv_heads=2, head_dim=d, steps=[prompt, 40, 1], pad=[0, 9], dtype=dtype,
                              device=DEVICE, position_offset=30000)
    seen = 0
    for label, store, chunks, kind in _stores(cache):
        T = chunks * store.chunk_len
        rotary = None
        if kind == "key":
            positions = 30000 + torch.arange(T, device=DEVICE)[None].expand(2, T) * 3  # per-row spacing irrelevant
            cos, sin = _tables(positions, d, dtype)
            rotary = (cos[:, None], sin[:, None])
        oracle = TorchBackend().reconstruct(store, chunks, torch.float32, None,
                                            None if rotary is None else tuple(t.float() for t in rotary))
        out = torch.full(oracle.shape, float("nan"), dtype=dtype, device=DEVICE)
        reconstruct_run(ChunkRunView.of(store), chunks, out, rotary)
        assert torch.isfinite(out).all(), f"{label}: rows left unwritten"
        err = ((out.float() - oracle).abs().max() / oracle.abs().max()).item()
        assert err < TOL[dtype], f"{label}: relative error {err:.3g} >= {TOL[dtype]}"
        seen += 1
    assert seen >= 2


def test_reconstruct_into_a_strided_slice():
    """The workspace case: out is a column slice of a wider tensor, cos/sin a slice broadcast over the batch."""
    cfg = _config("gear2")
    cache, _, _ = build_cache(cfg, batch=3, kv_heads=1, head_dim=64, steps=[50, 70, 1], pad=[0, 5, 17], device=DEVICE)
    store = cache.layers[0].key_stream.decode
    chunks = max(cache.decode_chunks)
    T = chunks * store.chunk_len
    wide = torch.zeros(3, 1, T + 20, 64, device=DEVICE)
    cos, sin = _tables(torch.arange(T + 20, device=DEVICE)[None], 64, torch.float32)
    rotary = (cos[:, None, 7 : 7 + T], sin[:, None, 7 : 7 + T])
    reconstruct_run(ChunkRunView.of(store), chunks, wide[:, :, 7 : 7 + T], rotary)
    oracle = TorchBackend().reconstruct(store, chunks, torch.float32, None, rotary)
    assert torch.allclose(wide[:, :, 7 : 7 + T], oracle, atol=1e-5 * oracle.abs().max().item())
    assert not wide[:, :, :7].any() and not wide[:, :, 7 + T :].any()  # nothing written outside the slice


class _Rotary:
    """A rotary module as the cache calls it: (like, positions [B,T]) -> (cos, sin) [B,T,d]."""

    def __init__(self, d):
        self.d = d

    def __call__(self, like, positions):
        return _tables(positions, self.d, like.dtype)


def _step_inputs(cache, plan, k, v, rotary):
    """The reference path's (keys rotated, values) of layer 0 for this step, read with `plan`'s backends."""
    for layer in cache.layers:
        layer.bind(plan)
    keys, values, _ = cache.attention_inputs(0, k, v, rotary, None)
    return keys.float().clone(), values.float().clone()  # (the step's workspace is reused by the next read)


CACHE_CASES = [("gear2", 1, 64, torch.float32, 0), ("default", 4, 128, torch.float32, 4),
               ("gear3-f16", 7, 64, torch.bfloat16, 2)]


@pytest.mark.parametrize("name,group,d,dtype,sink", CACHE_CASES,
                         ids=[f"{n}-gqa{g}-d{d}-{str(t)[6:]}-sink{s}" for n, g, d, t, s in CACHE_CASES])
def test_fallback_step_matches_torch_reference_path(name, group, d, dtype, sink):
    """One decode step of left-padded rows at positions ~30k: what the fallback hands SDPA (keys reconstructed and
    rotated by the kernel, sink and buffer rotated by torch) and SDPA's output, against the torch plan's read of the
    same stored tensors."""
    cfg = _config(name, sink_tokens=sink, backend="triton")
    batch, kv_heads, pad = 3, 2, [0, 7, 30]
    cache, _, _ = build_cache(cfg, batch=batch, kv_heads=kv_heads, head_dim=d, steps=[81, 38], pad=pad,
                              dtype=dtype, device=DEVICE, position_offset=30000)
    assert cache.plan.reconstruct.name == "triton"
    triton_plan, torch_plan = cache.plan, backends.plan_of("torch")
    T = cache.rect_length
    mask = torch.ones(batch, T + 1, dtype=torch.long)
    for b, p in enumerate(pad):
        mask[b, :p] = 0
    cache.observe_attention_mask(mask.to(DEVICE))
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(batch, kv_heads, 1, d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    positions = torch.tensor([[T - p + 30000] for p in pad], device=DEVICE)
    cache.store(0, k, v, positions)
    rotary = _Rotary(d)
    fallback = _step_inputs(cache, triton_plan, k, v, rotary)
    reference = _step_inputs(cache, torch_plan, k.float(), v.float(), rotary)  # float32: the oracle's read
    for got, want, what in zip(fallback, reference, ("keys", "values")):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < TOL[dtype], f"{what}: relative error {err:.3g}"
    visible = (cache.rect_to_local[:, : T + 1] >= 0).to(DEVICE)[:, None, None, :]
    q = torch.randn(batch, kv_heads * group, 1, d, generator=g).to(DEVICE)
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), attn_mask=visible)
        for keys, values in (fallback, reference)]
    err = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
    assert err < ATTENTION_TOL[dtype], f"attention output: relative error {err:.3g}"
    for layer in cache.layers:
        layer.bind(triton_plan)
    cache.compress_pending(0)


def test_generate_fallback_reports_its_path_and_matches_torch():
    """Greedy generation of a tiny Llama (GQA 2, head_dim 32) with the Triton backend forced and decode_path
    'fallback': every decode layer-step is counted as 'fallback', and the tokens are the torch backend's."""
    import gear_hf
    from gear_hf.cache import GearCache
    from tiny_models import CACHE_ARG, tiny_model

    model = tiny_model("llama3", head_dim=32).to(DEVICE)
    ids = torch.randint(3, 100, (2, 45), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    new = 5
    runs = {}
    for backend in ("torch", "triton"):
        cfg = GearConfig.preset("gear", bits=4, group_size=16, buffer_size=16, backend=backend)
        gear_hf.enable(model, cfg)
        cache = GearCache(model, cfg)
        cache.decode_path = "fallback"
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             **{CACHE_ARG: cache})
        runs[backend] = (out, dict(cache.step_paths))
        gear_hf.disable(model)
    assert runs["triton"][1] == {"fallback": 2 * (new - 1)}
    assert runs["torch"][1] == {"reference": 2 * (new - 1)}
    assert torch.equal(runs["triton"][0], runs["torch"][0])
