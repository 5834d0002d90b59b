"""8-bit value statistics (GearConfig.value_statistics="8"): a scale on a 2^(1/8) grid and an 8-bit zero
point per value group instead of a 16-bit scale and minimum. The oracle (`compress.quant.stats8`) covers every group's
range as the 16-bit statistics do; the cache stores two uint8 codes per group, counts them, reads them back through
the torch backend, the numba kernels and the Triton kernels (each decoding the codes in place: no float32 copy is kept),
bit for bit as the oracle decodes them. On CPU the numba kernel also writes them (`test_cpu_compress`: bit for bit the
oracle's)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gear_hf
from gear_hf import GearConfig
from gear_hf.backends import resolve
from gear_hf.compress import ChunkSpec, compress, decompress, quant
from gear_hf.compress.gear import add_lowrank
from gear_hf.format import layer_formats
from memory_walk import walk
from tiny_models import tiny_model


def _groups(d: int = 64, n: int = 40, edges: bool = True) -> torch.Tensor:
    """Value-like vectors [2,3,n,d] with per-token magnitudes over 4 decades and (edges) the edge cases: a zero
    vector, a constant one, all-positive, all-negative, one huge entry."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, n, d) * torch.logspace(-3, 1, n).view(1, 1, n, 1)
    if not edges:
        return x
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 0.37
    x[0, 1, 2] = x[0, 1, 2].abs() + 5.0
    x[0, 1, 3] = -x[0, 1, 3].abs() - 0.01
    x[1, 2, 4, 7] = 300.0
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_entry_is_within_half_a_step_of_its_code(bits, dtype):
    x = _groups().to(dtype)
    codes, scale_code, zero_code = quant.quantize(x, bits, "token", 64, stats="8")
    assert scale_code.dtype == zero_code.dtype == torch.uint8 and scale_code.shape == (2, 3, 40, 1)
    minimum, scale = quant.decode_stats8(scale_code, zero_code, quant.top_code(bits))
    y = quant.dequantize(codes, scale, minimum, "token", 64, 64, torch.float32)
    err = (y - x.float()).abs()
    assert bool((err <= scale * 0.5 * (1 + 1e-5) + 1e-30).all())
    assert float(scale[0, 0, 0, 0]) == 0.0 and float(err[0, 0, 0].max()) == 0.0  # the zero vector is exact
    # the grid costs precision (the scale is rounded up by < 9%), not much: on ordinary vectors (ranges around 0)
    # the mean squared error relative to each vector's energy within 1.25x 16-bit statistics'
    x = _groups(edges=False).to(dtype)
    energy = x.float().square().mean(-1, keepdim=True)
    c8, *stored = quant.quantize(x, bits, "token", 64, stats="8")
    m8, s8 = quant.decode_stats8(*stored, quant.top_code(bits))
    c16, s16, m16 = quant.quantize(x, bits, "token", 64)
    err8 = quant.dequantize(c8, s8, m8, "token", 64, 64, torch.float32) - x.float()
    err16 = quant.dequantize(c16, s16, m16, "token", 64, 64, torch.float32) - x.float()
    assert (err8.square() / energy).mean() <= 1.25 * (err16.square() / energy).mean()


def test_a_range_beyond_the_grid_is_refused_with_the_way_out():
    x = torch.zeros(1, 1, 2, 64)
    x[0, 0, 1, 0] = 1e6
    with pytest.raises(ValueError, match=r"8-bit statistics \(value_statistics='8'\) cover ranges up to .*"
                                         r"use value_statistics='16'"):
        quant.quantize(x, 3, "token", 64, stats="8")


def test_chunk_spec_takes_8bit_statistics_for_values_per_token_only():
    spec = ChunkSpec(3, "token", 64, 0.0, 0, rotate=True, stats="8")
    ref = _groups(edges=False)
    chunk = compress(ref, spec)
    assert chunk.scale.dtype == chunk.minimum.dtype == torch.uint8
    y = decompress(chunk, spec, 40, 64, torch.float32)
    spec16 = ChunkSpec(3, "token", 64, 0.0, 0, rotate=True)
    y16 = decompress(compress(ref, spec16), spec16, 40, 64, torch.float32)
    energy = ref.square().mean(-1, keepdim=True)
    assert ((y - ref).square() / energy).mean() <= 1.25 * ((y16 - ref).square() / energy).mean()
    for bad in (dict(axis="channel"), dict(range_search=True)):
        with pytest.raises(ValueError, match=r"ChunkSpec.stats='8' \(8-bit statistics\) needs axis='token'"):
            ChunkSpec(**{**dict(bits=3, axis="token", group=64, outlier_ratio=0.0, rank=0, stats="8"), **bad})
    with pytest.raises(ValueError, match=r"ChunkSpec.stats='4'; allowed: 16 \| 8"):
        ChunkSpec(3, "token", 64, 0.0, 0, stats="4")


def test_config_validates_and_only_values_take_it():
    assert GearConfig(value_statistics=8).value_statistics == "8"  # (lm-eval may pass an int)
    keys, values = layer_formats(GearConfig(value_statistics="8"))
    assert {s.stats for s in values.specs} == {"8"} and {s.stats for s in keys.specs} == {"16"}
    assert values.tail.stats == "16"  # the 4-bit buffer keeps its 16-bit statistics
    for bad, match in ((dict(value_statistics="4"), r"value_statistics='4' is invalid; allowed: '16' \| '8'"),
                       (dict(value_statistics=True), r"value_statistics=True is invalid")):
        with pytest.raises(ValueError, match=match):
            GearConfig(**bad)
    # 8-bit statistics apply to values grouped per token with min/max ranges and a buffer other than "final"
    for elsewhere in (dict(value_axis="channel"), dict(range_search="both"), dict(value_buffer="final")):
        assert GearConfig(value_statistics="8", hold="none", **elsewhere).value_statistics == "16", elsewhere
    saved = GearConfig(value_statistics="8").to_dict()
    assert GearConfig.from_dict(saved) == GearConfig(value_statistics="8")


def test_the_kernels_compress_read_and_attend_it():
    config = GearConfig(value_statistics="8")
    from gear_hf.backends.triton_backend import fused_supported
    from gear_hf.kernels import reconstruct_supported

    assert fused_supported(config, 64, 1) is None
    assert reconstruct_supported(layer_formats(config)[1].decode, 64) is None
    pytest.importorskip("numba")
    for dtype in (torch.bfloat16, torch.float32):
        plan = resolve(config, 64, dtype, torch.device("cpu"))
        assert plan.names() == {"compress": "numba", "reconstruct": "numba", "attend": "numba"}
        assert "numba" not in dict(plan.skipped.get("compress", ()))


def _lowrank_term(store) -> torch.Tensor:
    """Each chunk's A Bᵀ of a store's stored factors (dequantized) [B,H,capacity*n,d] (zero-filled unused slots: 0)."""
    B, H = store.fields["codes"].shape[:2]
    x = torch.zeros(B, H, store.capacity * store.chunk_len, store.head_dim)
    return add_lowrank(x, store.run(store.capacity), store.chunk_len, store.head_dim, store.capacity)


# GearConfig()'s values with 8-bit statistics (3 bits, rotated), and 2-bit values with outliers and low-rank factors
E2E_CONFIGS = {"default": lambda **kw: GearConfig(value_statistics="8", group_size=16, buffer_size=32,
                                                   prompt_group_size=64, **kw),
               "gear-2": lambda **kw: GearConfig.preset("gear", bits=2, value_statistics="8", group_size=16,
                                                        buffer_size=32, **kw)}


@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(E2E_CONFIGS))
def test_numba_compresses_the_chunks_the_torch_backend_stores(name, dtype, d):
    """backend="auto" on CPU compresses value chunks with 8-bit statistics by the numba kernel: after the same steps
    (batch 2, a left-padded row, prompt and decode chunks) both caches store the same codes, statistics and outliers
    bit for bit, and the same low-rank term to float32 rounding (numba fits it: `test_cpu_compress`' tolerance)."""
    pytest.importorskip("numba")
    from gear_hf.cache.fused import build_cache

    stores = {}
    for backend in ("torch", "auto"):
        config = E2E_CONFIGS[name](backend=backend)
        with torch.inference_mode():
            cache, _, _ = build_cache(config, batch=2, kv_heads=2, head_dim=d, steps=[150, 40, 1, 33], pad=[0, 9],
                                      dtype=dtype)
        assert cache.backend_names["compress"] == ("torch" if backend == "torch" else "numba")
        stores[backend] = [store for layer in cache.layers for store in (layer.value_stream.prefill,
                                                                         layer.value_stream.decode)
                           if store is not None and store.fields]
    assert len(stores["torch"]) == len(stores["auto"]) == 2  # a prompt and a decode store
    for expected, got in zip(stores["torch"], stores["auto"]):
        assert expected.spec.stats == "8" and expected.fields.keys() == got.fields.keys()
        for field, t in expected.fields.items():
            if not field.startswith("lowrank"):
                assert torch.equal(got.fields[field], t), field
        if expected.spec.rank:
            p_expected, p_got = _lowrank_term(expected), _lowrank_term(got)
            assert p_expected.norm() > 0 and (p_got - p_expected).norm() <= 1e-2 * p_expected.norm()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_numba_reads_chunks_bit_for_bit_as_the_oracle(out_dtype):
    cpu = pytest.importorskip("gear_hf.kernels.cpu")
    for spec in (ChunkSpec(3, "token", 64, 0.0, 0, rotate=True, stats="8"),
                 ChunkSpec(4, "token", 16, 0.0, 0, stats="8")):
        chunk = compress(_groups().to(torch.bfloat16), spec)
        out = torch.empty(2, 3, 40, 64, dtype=out_dtype)
        assert cpu.decompress_supported(spec, 64, out)
        assert torch.equal(cpu.decompress_into(chunk, spec, 40, 64, 1, out), decompress(chunk, spec, 40, 64, out_dtype))


@pytest.mark.parametrize("top", [7, 15, 255])
def test_the_cpu_loops_decode_every_code_pair_as_the_oracle(top):
    """The numba loops read the uint8 codes in place (`bf16.stored_stats`, one byte an entry): all 256 x 256 (scale,
    zero point) pairs decode to decode_stats8's float32 bits, the minimum's rounding down to bf16 included."""
    pytest.importorskip("numba")
    codes = torch.arange(256, dtype=torch.uint8)
    pairs = torch.meshgrid(codes, codes, indexing="ij")
    scale_code, zero_code = (c.reshape(1, 1, 256, 256).contiguous() for c in pairs)
    out_scale, out_minimum = _stored_stats_of(scale_code, zero_code, top)
    minimum, scale = quant.decode_stats8(scale_code, zero_code, top)
    assert torch.equal(out_scale.view(torch.int32), scale.view(torch.int32))
    assert torch.equal(out_minimum.view(torch.int32), minimum.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_16_and_32_bit_statistics_are_read_from_their_bytes(dtype):
    """Statistics of every other format reach the loops as their bytes too (`read._stats_bytes`: one array type,
    so one kernel signature for all formats), and read back as the values they hold (fp16 ones through float32)."""
    pytest.importorskip("numba")
    from gear_hf.kernels.cpu.read import _stats_bytes

    scale = (torch.randn(1, 2, 5, 3, generator=torch.Generator().manual_seed(0)) * 1e3).to(dtype)
    minimum = -scale.flip(2)
    scale_bytes, minimum_bytes = _stats_bytes(scale), _stats_bytes(minimum)
    assert scale_bytes.dtype == np.uint8 and scale_bytes.shape == (1, 2, 5, 3 * (2 if dtype == torch.bfloat16 else 4))
    out_scale, out_minimum = _stored_stats_of(torch.from_numpy(scale_bytes), torch.from_numpy(minimum_bytes), 0,
                                              entries=3)
    assert torch.equal(out_scale, scale.float()) and torch.equal(out_minimum, minimum.float())
    with pytest.raises(ValueError, match="int16"):
        _stats_bytes(torch.zeros(1, 1, 1, 1, dtype=torch.int16))


def _stored_stats_of(scale, minimum, top, entries=None):
    """(scale, minimum) float32 [B,H,m,entries] of statistics held as bytes [B,H,m,entries*w], read by
    `bf16.stored_stats` a (row, head) at a time in a numba loop."""
    import numba

    from gear_hf.kernels.cpu.bf16 import stored_stats

    @numba.njit
    def decode_all(scale, minimum, top, entries, out_scale, out_minimum):
        rows = out_scale.shape[2]
        out = np.empty((2, rows * entries), dtype=np.float32)
        for b in range(out_scale.shape[0]):
            for h in range(out_scale.shape[1]):
                stored_stats(scale, minimum, top, b, h, 0, rows, entries, out)
                for t in range(rows):
                    for k in range(entries):
                        out_scale[b, h, t, k] = out[0, t * entries + k]
                        out_minimum[b, h, t, k] = out[1, t * entries + k]

    entries = entries or scale.shape[3]
    out_scale, out_minimum = torch.empty(2, *scale.shape[:3], entries).unbind(0)
    decode_all(scale.contiguous().numpy(), minimum.contiguous().numpy(), top, entries, out_scale.numpy(),
               out_minimum.numpy())
    return out_scale, out_minimum


def test_floor_bf16_is_the_largest_bf16_at_or_below():
    pytest.importorskip("numba")
    from gear_hf.kernels.cpu.bf16 import floor_bf16

    torch.manual_seed(0)
    values = torch.cat([torch.randn(2000) * torch.exp2(torch.randint(-140, 100, (2000,)).float()),
                        torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-133, -(2.0**-133), 3.0e38, -3.0e38])])
    values = torch.cat([values, values.to(torch.bfloat16).float()])  # values already on the grid stay
    for v in values.tolist():
        v32 = torch.tensor(v, dtype=torch.float32)
        rounded = v32.to(torch.bfloat16)
        expected = torch.where(rounded.float() > v32, torch.nextafter(rounded, torch.tensor(float("-inf"),
                                                                       dtype=torch.bfloat16)), rounded).float()
        got = torch.tensor(int(floor_bf16(v32.item())), dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        assert got.view(torch.int32) == expected.view(torch.int32), (v, got.item(), expected.item())


def _generate(model, config, ids, context=torch.inference_mode):
    model = copy.deepcopy(model)
    gear_hf.enable(model, config)
    with context():
        out = model.generate(ids, max_new_tokens=100, do_sample=False, return_dict_in_generate=True)
    return out.sequences, out.past_key_values


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_generate_stores_and_counts_two_bytes_less_per_value_group(context):
    """GearConfig() (8-bit value statistics) against itself with 16-bit statistics (both on the torch backend): the
    report differs by exactly 2 bytes per value group allocated (a uint8 scale and zero point instead of two 16-bit
    numbers), the walk of the stores equals the report, and the first tokens (before anything is compressed) are the
    16-bit statistics' own."""
    model = tiny_model("llama3", dtype=torch.bfloat16)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 300))  # a 256-token prompt group, then a decode chunk
    seq16, cache16 = _generate(model, GearConfig(value_statistics="16", backend="torch"), ids, context)
    seq8, cache8 = _generate(model, GearConfig(backend="torch"), ids, context)
    assert cache8.gear_config.value_statistics == "8"  # (GearConfig()'s "auto" since config version 5)
    assert torch.equal(seq8[:, :301], seq16[:, :301])  # the prompt step reads the model's own values
    assert all(layer.value_stream.decode.fields for layer in cache8.layers)  # a decode chunk was compressed too
    groups = sum(store.fields["scale"].numel() for layer in cache8.layers
                 for store in (layer.value_stream.prefill, layer.value_stream.decode)
                 if store is not None and store.fields)
    r16, r8 = cache16.memory_report(), cache8.memory_report()
    assert r16["elements"] == r8["elements"]
    assert r16["owned_bytes"] - r8["owned_bytes"] == 2 * groups
    assert _store_walk(cache8) == r8["owned_bytes"]


def _store_walk(cache) -> int:
    return walk({"layers": cache.layers, "tables": cache.layout.tables, "kernel_state": cache.kernel_state,
                 "rotary": cache._rotary}).total


def test_the_numba_path_generates_the_torch_paths_tokens_and_keeps_no_decoded_copy():
    """The numba backend compresses, reads and attends: the torch backend's tokens and logits (float32 model: in bf16
    the two paths' attention rounds differently, 16-bit statistics' tokens part too)."""
    pytest.importorskip("numba")
    model = tiny_model("qwen2", dtype=torch.float32)
    torch.manual_seed(2)
    ids = torch.randint(1, model.config.vocab_size, (3, 290))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left-padded rows
    mask[2, :200] = 0
    outs = {}
    for backend in ("torch", "auto"):
        config = GearConfig(value_statistics="8", backend=backend)
        enabled = copy.deepcopy(model)
        gear_hf.enable(enabled, config)
        with torch.inference_mode():
            out = enabled.generate(ids, attention_mask=mask, max_new_tokens=150, do_sample=False,
                                   return_dict_in_generate=True, output_scores=True)
        outs[backend] = out
    cache = outs["auto"].past_key_values
    assert cache.backend_names == {"compress": "numba", "reconstruct": "numba", "attend": "numba"}
    assert cache.step_paths.get("fused", 0) > 0 and not cache.step_paths.get("reference", 0)
    assert torch.equal(outs["auto"].sequences, outs["torch"].sequences)
    # the fused attention's logits to float32 rounding, as with 16-bit statistics (test_cpu_kernels: < 1e-4)
    scores = {backend: torch.stack(out.scores, 1) for backend, out in outs.items()}
    assert (scores["auto"] - scores["torch"]).abs().max().item() < 1e-4
    report = cache.memory_report()
    assert _store_walk(cache) == report["owned_bytes"]
    # the prepared runs (kept while their fields are unwritten) view the uint8 codes: no decoded float32 copy
    runs = [entry for layer in cache.layers for store in (layer.value_stream.prefill, layer.value_stream.decode)
            if store is not None for key, entry in store.derived.items() if key[0] == "numba"]
    assert runs and all(owned == 0 for _, _, owned in runs)
