"""GPU-only checks of the Triton kernels at real sizes (marker `gpu`; skipped without CUDA).

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16, contexts up to 32k tokens:
* quantize/pack: bit-exact against the torch reference on the GPU;
* fused decode attention vs the float32 oracle, for q_len 1 and 4. Tolerance, relative to max|oracle|: at
  most 2x the error the torch reference path itself makes in bf16 (reconstruct + RoPE + attention in bf16,
  emulated by the oracle with dtype=bf16) + 5e-3, and never above 5e-2. Both errors are printed (-rA);
* every output element is written (the output is poisoned with NaN first);
* end to end, a tiny fp32 model generates the same tokens through the fused path as through torch.
Run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")

from gear_hf.cache.fused import build_cache, reference_decode_attention  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _check_vs_oracle(cache, q, out, label=""):
    """fused error vs the oracle, bounded by the bf16 (or fp16) reference path's own error."""
    kw = dict(scaling=D ** -0.5, inv_freq=_inv_freq_llama3())
    ref = reference_decode_attention(cache, 0, q, **kw)
    path = reference_decode_attention(cache, 0, q, dtype=q.dtype, **kw)
    scale = ref.abs().max()
    err = ((out.float() - ref).abs().max() / scale).item()
    err_path = ((path - ref).abs().max() / scale).item()
    print(f"{label}: fused rel err {err:.3g}, torch reference path in {q.dtype} {err_path:.3g}")
    assert torch.isfinite(out).all()
    assert err <= min(2 * err_path + 5e-3, 5e-2), (err, err_path)
    return err, err_path


def _inv_freq_llama3(d=D):
    """Llama-3.1 rope: theta 500000 with the llama3 frequency scaling (factor 8, 8192 original context)."""
    import math

    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis,group", [("channel", 64), ("token", 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_quantize_pack_bit_exact_gpu(bits, axis, group, dtype):
    from gear_hf.compress import quant
    from gear_hf.kernels.quant import quantize_pack

    g = torch.Generator(device="cuda").manual_seed(bits)
    x = (torch.randn(8, HKV, 4096, D, device="cuda", generator=g) * 3).to(dtype)
    exclude = torch.rand(x.shape, device="cuda", generator=g) < 0.02
    codes, scale, minimum = quant.quantize(x, bits, axis, group, exclude=exclude)
    want = (quant.pack_codes(codes, bits, -2 if axis == "channel" else -1), scale, minimum)
    got = quantize_pack(x, bits, axis, group, exclude=exclude)
    for name, a, b in zip(("codes", "scale", "minimum"), got, want):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} entries differ"


def _case(T, batch, q_len, bits, dtype=torch.bfloat16, method="gear", **cfg):
    """A cache holding T tokens per row (some rows shorter: left padding), prompt + decode chunks + buffer."""
    config = GearConfig.preset(method, bits=bits, **cfg)
    prompt = T - 200 - q_len
    pad = [0] + [97 * (i + 1) for i in range(batch - 1)]
    cache, _, _ = build_cache(config, batch=batch, kv_heads=HKV, head_dim=D, steps=[prompt, 200, q_len], pad=pad,
                              dtype=dtype, device="cuda", seed=T + batch, position_offset=0)
    q = torch.randn(batch, HQ, q_len, D, generator=torch.Generator().manual_seed(5)).to(dtype).cuda()
    return cache, q


def _run(cache, q, out=None):
    from gear_hf.cache.fused import cache_decode_attention

    return cache_decode_attention(cache, 0, q, scaling=D ** -0.5, inv_freq=_inv_freq_llama3(), out=out)


@pytest.mark.parametrize("T,batch,q_len,bits", [(32768, 1, 1, 2), (8192, 4, 1, 4), (8192, 2, 4, 2), (1024, 8, 1, 2)])
def test_fused_real_sizes(T, batch, q_len, bits):
    cache, q = _case(T, batch, q_len, bits)
    out = _run(cache, q)
    torch.cuda.synchronize()
    _check_vs_oracle(cache, q, out, f"T={T} B={batch} q={q_len} {bits}-bit")


@pytest.mark.parametrize("label,config", [
    ("GearConfig()", GearConfig()),  # the recommended default: kivi, keys allocated by the queries, 3-bit values
    ("gear-3 int8 factors, rotated values", GearConfig.preset("gear", bits=3, factor_bits=8, rotation="values")),
    ("gear-l-2 k32/v64 groups, rotated", GearConfig.preset("gear-l", bits=2, key_group_size=32, value_group_size=64,
                                                            rotation="both", factor_bits=8)),
])
def test_fused_issue9_storage_real_sizes(label, config):
    """The storage options beyond the paper (3-bit, rotation, int8 factors, separate groups) at real sizes."""
    batch, q_len, T = 4, 1, 8192
    pad = [0] + [97 * (i + 1) for i in range(batch - 1)]
    cache, _, _ = build_cache(config, batch=batch, kv_heads=HKV, head_dim=D, steps=[T - 300, 299, q_len], pad=pad,
                              dtype=torch.bfloat16, device="cuda", seed=11)
    q = torch.randn(batch, HQ, q_len, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    out = _run(cache, q)
    torch.cuda.synchronize()
    _check_vs_oracle(cache, q, out, label)


def test_fused_writes_every_element_gpu():
    cache, q = _case(8192, 3, 4, 2, sink_tokens=4)
    out = torch.full((3, 4, HQ, D), float("nan"), dtype=q.dtype, device="cuda")
    _run(cache, q, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    _check_vs_oracle(cache, q, out, "poisoned output")


def test_fused_fp16_and_split_invariance_gpu():
    cache, q = _case(4096, 2, 1, 4, dtype=torch.float16)
    outs = [_run(cache, q) for _ in range(1)]
    from gear_hf.cache.fused import cache_decode_attention

    for splits in (1, 7, 64):
        outs.append(cache_decode_attention(cache, 0, q, scaling=D ** -0.5, inv_freq=_inv_freq_llama3(),
                                           num_splits=splits))
    for splits, out in zip(("auto", 1, 7, 64), outs):
        _check_vs_oracle(cache, q, out, f"fp16, {splits} splits")
    assert ((outs[1].float() - outs[2].float()).abs().max() / outs[1].float().abs().max()).item() < 2e-3


def test_generate_fused_equals_torch_gpu(monkeypatch):
    pytest.importorskip("gear_hf.patches")
    import test_kernels_dispatch as dispatch

    monkeypatch.setattr(dispatch, "DEVICE", "cuda")
    dispatch._compare("llama3", 9)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fused_on_the_second_gpu():
    """A layer whose cache lives on cuda:1 while cuda:0 is the current device (device_map="auto"): the kernel
    must launch on cuda:1 and its current stream, and match the oracle."""
    config = GearConfig.preset("gear", bits=2)
    cache, _, _ = build_cache(config, batch=2, kv_heads=HKV, head_dim=D, steps=[3000, 200, 1], pad=[0, 300],
                              dtype=torch.bfloat16, device="cuda:1", seed=3)
    q = torch.randn(2, HQ, 1, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to("cuda:1")
    with torch.cuda.device(0):
        out = _run(cache, q)
    torch.cuda.synchronize(1)
    assert out.device == torch.device("cuda:1")
    _check_vs_oracle(cache, q, out, "second GPU")


def test_no_recompiles_as_the_cache_grows():
    """Lengths, split counts and storage strides change from step to step: after the configuration's first
    steps (the first decode chunk appears) the kernel must not compile again (do_not_specialize)."""
    from gear_hf.kernels import decode

    def compiled_count():
        device = torch.cuda.current_device()
        kernels = (decode._decode_attention_kernel, decode._combine_kernel)
        return sum(len(k.device_caches[device][0]) for k in kernels)

    config = GearConfig.preset("gear", bits=2)
    counts = []
    for new_tokens in (70, 71, 150, 333):
        steps = [1000 + 7 * new_tokens, new_tokens, 1]  # other prompt and decode lengths, other capacities
        cache, _, _ = build_cache(config, batch=2, kv_heads=HKV, head_dim=D, steps=steps, pad=[0, 37],
                                  dtype=torch.bfloat16, device="cuda", seed=new_tokens)
        q = torch.randn(2, HQ, 1, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
        _run(cache, q)
        torch.cuda.synchronize()
        counts.append(compiled_count())
    assert counts[1:] == counts[:1] * (len(counts) - 1), counts
