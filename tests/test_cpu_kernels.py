"""The numba CPU read kernels (`gear_hf.kernels.cpu`) against the torch oracle, bit for bit.

The kernels decompress a run of chunks and rotate keys; `gear_hf.compress.decompress` and
`gear_hf.compress.rope.apply_rotary` are what they must equal, exactly (same float32 operations in the same order).
Shapes
are odd on purpose: 2 rows, 3 heads, runs written into the middle of a wider workspace, short value groups.
End to end, generation with backend="numba" must give the same tokens and logits as backend="torch".
"""

from __future__ import annotations

import dataclasses  # noqa: F401
import itertools

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")

import gear_hf  # noqa: E402
from gear_hf.backends import resolve  # noqa: E402
from gear_hf.compress import ChunkSpec, CompressedChunk, compress, decompress  # noqa: E402
from gear_hf.compress.rope import RotaryMemo, apply_rotary  # noqa: E402
from gear_hf.compress.terms import BUILTIN_FIELDS  # noqa: E402
from gear_hf.config import GearConfig  # noqa: E402
from gear_hf.kernels import cpu  # noqa: E402
from reference_match import assert_matches_oracle  # noqa: E402
from tiny_models import prompts  # noqa: E402


def _run(x: torch.Tensor, spec: ChunkSpec, n: int) -> CompressedChunk:
    """Chunks of n tokens of x compressed one by one and laid one after the other, as `ChunkStore` keeps them."""
    chunks = [compress(x[:, :, i : i + n], spec) for i in range(0, x.shape[2], n)]
    return CompressedChunk(**{f: torch.cat([getattr(c, f) for c in chunks], dim=2)
                              for f in BUILTIN_FIELDS})


SPECS = [
    ChunkSpec(bits, axis, group, ratio, rank, factor_bits=factor_bits)
    for bits, axis in itertools.product((2, 3, 4, 8), ("channel", "token"))
    for group, ratio, rank, factor_bits in ((16, 0.0, 0, 8), (8, 0.05, 2, 8), (32, 0.02, 3, 16))
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits}b-{s.axis}-g{s.group}-o{s.outlier_ratio}-r{s.rank}")
def test_decompress_into_equals_decompress(spec):
    torch.manual_seed(0)
    B, H, n, chunks, d = 2, 3, 32, 3, 64
    x = torch.randn(B, H, n * chunks, d) * 2 + torch.linspace(-1, 3, d)  # channels of different ranges
    x[:, :, 5, 7] = 40.0  # an outlier
    run = _run(x, spec, n)
    expected = decompress(run, spec, n, d, torch.float32, chunks=chunks)
    workspace = torch.full((B, H, 5 + n * chunks + 4, d), float("nan"))
    out = workspace[:, :, 5 : 5 + n * chunks]
    assert cpu.decompress_supported(spec, d, out)
    cpu.decompress_into(run, spec, n, d, chunks, out)
    assert_matches_oracle(out, expected, bool(spec.rank))
    assert workspace[:, :, :5].isnan().all() and workspace[:, :, 5 + n * chunks:].isnan().all()  # nothing else written


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1], SPECS[3], SPECS[10]],
                         ids=lambda s: f"{s.bits}b-{s.axis}-o{s.outlier_ratio}-r{s.rank}")
def test_decompress_into_rotated_equals_rotated_decompress(spec):
    """With rotary= the run comes back rotated (keys read for the attention): fused into the dequantization when
    nothing is added after the codes, else rotated after; cos/sin are a column slice of a wider batch table."""
    torch.manual_seed(4)
    B, n, chunks, d = 2, 32, 2, 64
    run = _run(torch.randn(B, 3, n * chunks, d), spec, n)
    cos, sin = torch.randn(B, 1, 100, d), torch.randn(B, 1, 100, d)
    rotary = (cos[:, :, 7 : 7 + n * chunks], sin[:, :, 7 : 7 + n * chunks])
    expected = apply_rotary(decompress(run, spec, n, d, torch.float32, chunks=chunks), *rotary)
    out = torch.empty(B, 3, 80, d)[:, :, 3 : 3 + n * chunks]
    assert_matches_oracle(cpu.decompress_into(run, spec, n, d, chunks, out, rotary), expected, bool(spec.rank))


@pytest.mark.parametrize("spec, d", [
    (spec, d) for spec in (ChunkSpec(3, "token", 128, 0.0, 0, rotate=True),  # GearConfig()'s values
                           ChunkSpec(2, "token", 4, 0.05, 2, rotate=True, factor_bits=8),
                           ChunkSpec(4, "channel", 16, 0.02, 2, rotate=True))
    for d in (64, 96, 20) if spec.axis == "channel" or d % 8 == 0],  # (value codes of d % 8 != 0: torch path)
    ids=lambda v: f"{v.bits}b-{v.axis}-o{v.outlier_ratio}-r{v.rank}" if isinstance(v, ChunkSpec) else f"d{v}")
def test_decompress_into_undoes_the_rotation(spec, d):
    """Hadamard-rotated streams (blocks of 64, 32 and 4 for d = 64, 96, 20; a value group longer than d is one
    group): butterflies instead of the matmul, so to float32 rounding; keys rotated by RoPE after, as decompress
    then apply_rotary do."""
    torch.manual_seed(d)
    B, n, chunks = 2, 32, 2
    run = _run(torch.randn(B, 3, n * chunks, d) * torch.linspace(0.5, 4, d), spec, n)
    expected = decompress(run, spec, n, d, torch.float32, chunks=chunks)
    out = torch.empty(B, 3, n * chunks + 3, d)[:, :, 3:]
    assert cpu.decompress_supported(spec, d, out)
    assert_matches_oracle(cpu.decompress_into(run, spec, n, d, chunks, out), expected, low_rank=True)
    cos, sin = torch.randn(1, 1, n * chunks, d), torch.randn(1, 1, n * chunks, d)
    assert_matches_oracle(cpu.decompress_into(run, spec, n, d, chunks, out, (cos, sin)),
                          apply_rotary(expected, cos, sin), low_rank=True)


@pytest.mark.parametrize("rank", [0, 2])
def test_decompress_into_reads_widths_per_channel(rank):
    """Keys with a width per channel (bit planes, GearConfig()'s keys): each chunk its own widths (1 to 8 bits,
    the same total), bit for bit without a low-rank term; keys rotated by RoPE as they are written."""
    torch.manual_seed(5)
    B, H, n, chunks, d = 2, 3, 32, 3, 64
    spec = ChunkSpec(3.125, "channel", 16, 0.0, rank, allocated=True)
    x = torch.randn(B, H, n * chunks, d) * torch.linspace(0.5, 4, d)
    parts = []
    for i in range(chunks):
        widths = torch.tensor([1, 2, 3, 4, 5, 8, 2, 1] * (d // 8), dtype=torch.uint8)  # shuffled per (row, head)
        widths = torch.stack([widths[torch.randperm(d)] for _ in range(B * H)]).view(B, H, d)
        parts.append(compress(x[:, :, i * n : (i + 1) * n], spec, channel_bits=widths))
    run = CompressedChunk(**{f: torch.cat([getattr(c, f) for c in parts], dim=2)
                             for f in BUILTIN_FIELDS})
    expected = decompress(run, spec, n, d, torch.float32, chunks=chunks)
    out = torch.empty(B, H, n * chunks + 5, d)[:, :, 5:]
    assert cpu.decompress_supported(spec, d, out)
    assert_matches_oracle(cpu.decompress_into(run, spec, n, d, chunks, out), expected, bool(rank))
    cos, sin = torch.randn(1, 1, n * chunks, d), torch.randn(1, 1, n * chunks, d)
    assert_matches_oracle(cpu.decompress_into(run, spec, n, d, chunks, out, (cos, sin)),
                          apply_rotary(expected, cos, sin), bool(rank))


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[4], SPECS[9], SPECS[13],
                                  ChunkSpec(3, "token", 128, 0.0, 0, rotate=True)],
                         ids=lambda s: f"{s.bits}b-{s.axis}-o{s.outlier_ratio}-r{s.rank}-rot{int(s.rotate)}")
def test_decompress_into_bf16(spec):
    """A bf16 output (bf16 models): the run assembled in float32 and rounded once, as decompress into a bf16 tensor;
    keys then rotated by bf16 cos/sin with a rounding per operation, as apply_rotary on bf16 tensors."""
    torch.manual_seed(6)
    B, n, chunks, d = 2, 32, 2, 64
    run = _run(torch.randn(B, 3, n * chunks, d).bfloat16(), spec, n)
    expected = decompress(run, spec, n, d, torch.bfloat16, chunks=chunks)
    out = torch.empty(B, 3, n * chunks + 2, d, dtype=torch.bfloat16)[:, :, 2:]
    cos, sin = (torch.randn(1, 1, n * chunks, d).bfloat16() for _ in range(2))
    assert cpu.decompress_supported(spec, d, out, (cos, sin))
    assert not cpu.decompress_supported(spec, d, out, (cos.float(), sin.float()))  # wider cos: the torch path
    exact = not (spec.rank or spec.rotate)
    got = cpu.decompress_into(run, spec, n, d, chunks, out)
    close = (got.float() - expected.float()).abs().max() <= 0.01 * expected.abs().max()
    assert got.dtype == torch.bfloat16 and (torch.equal(got, expected) if exact else close)
    rotated = cpu.decompress_into(run, spec, n, d, chunks, out, (cos, sin))
    reference = apply_rotary(expected, cos, sin)
    assert torch.equal(rotated, reference) if exact else \
        (rotated.float() - reference.float()).abs().max() <= 0.02 * reference.abs().max().float()


def test_decompress_of_store_views_and_bf16_side():
    """A run read through views of wider store fields (capacity beyond the live chunks), bf16 statistics."""
    torch.manual_seed(1)
    spec = ChunkSpec(2, "channel", 16, 0.02, 2, factor_bits=8)
    x = torch.randn(2, 3, 64, 64)
    run = _run(x, spec, 16)
    fields = {f: getattr(run, f) for f in BUILTIN_FIELDS}
    wide = CompressedChunk(**{name: torch.cat([t, t], dim=2)[:, :, : t.shape[2]] for name, t in fields.items()})
    assert not wide.codes.is_contiguous() and run.scale.dtype == torch.bfloat16
    out = torch.empty(2, 3, 64, 64)
    assert_matches_oracle(cpu.decompress_into(wide, spec, 16, 64, 4, out),
                          decompress(run, spec, 16, 64, torch.float32, 4), low_rank=True)


@pytest.mark.parametrize("axis,factor_bits", [("channel", 8), ("token", 8), ("channel", 16)])
def test_prepared_runs_read_the_storage_in_place(axis, factor_bits):
    """A prepared run (what a decode step reads every step) holds no second copy of the storage: codes, bf16
    statistics (as their bits), outliers and int8 or bf16 factors are views of the store's fields (bf16 factors were
    copied to float32: 2 bits/element more than gear-4 owns, kept by the numba backend as derived state)."""
    torch.manual_seed(2)
    spec = ChunkSpec(2, axis, 16, 0.05, 2, factor_bits=factor_bits)
    run = _run(torch.randn(2, 3, 64, 64), spec, 16)
    fields = {f: getattr(run, f) for f in BUILTIN_FIELDS}
    stores = {name: torch.cat([t, t], dim=2) for name, t in fields.items()}  # capacity beyond the live chunks
    live = CompressedChunk(**{name: t[:, :, : fields[name].shape[2]] for name, t in stores.items()})
    prepared = cpu.prepare(live, spec, 16, 64, 4)
    held = {"codes": prepared.codes, "scale": prepared.scale, "minimum": prepared.minimum,
            "sparse_values": prepared.outliers[0], "sparse_index": prepared.outliers[1],
            "lowrank_a": prepared.factors[0], "lowrank_b": prepared.factors[2]}
    for name, array in held.items():
        store = stores[name]
        store = store.view(torch.int16) if store.dtype == torch.bfloat16 else store
        assert np.shares_memory(array, store.numpy()), name
    out = torch.empty(2, 3, 64, 64)
    assert_matches_oracle(cpu.decompress_run(prepared, out), decompress(run, spec, 16, 64, torch.float32, 4),
                          low_rank=True)


@pytest.mark.parametrize("B,H,n,d,index_dtype", [(2, 3, 320, 64, torch.int16), (1, 1, 32800, 8, torch.int32)])
def test_wide_outlier_indices_are_read_as_their_bytes(B, H, n, d, index_dtype):
    """A chunk past 256 tokens indexes its outliers in int16 (past 32,768 in int32): the kernels read every index
    as bytes, so such a run decompresses as the oracle does through the kernel signature a uint8 index takes."""
    from gear_hf.kernels.cpu import dequant

    torch.manual_seed(3)
    spec = ChunkSpec(4, "channel", 32, 0.02, 0)
    narrow, wide = _run(torch.randn(B, H, 32, d), spec, 32), _run(torch.randn(B, H, 2 * n, d) * 3, spec, n)
    assert narrow.sparse_index.dtype == torch.uint8 and wide.sparse_index.dtype == index_dtype
    signatures = []
    for run, chunk_len, chunks in ((narrow, 32, 1), (wide, n, 2)):
        out = torch.empty(B, H, chunks * chunk_len, d)
        cpu.decompress_into(run, spec, chunk_len, d, chunks, out)
        assert torch.equal(out, decompress(run, spec, chunk_len, d, torch.float32, chunks=chunks))
        signatures.append(set(dequant._decompress.signatures))
    assert signatures[1] == signatures[0]  # (the index is argument 11)
    assert {str(signature[11]) for signature in signatures[1]} == {"array(uint8, 4d, C)"}


def test_statistics_of_every_format_share_one_kernel_signature():
    """8-bit value statistics (the recommended configurations) and bf16 ones (the paper presets) reach the kernels
    as their bytes: both runs decompress as the oracle does, through one signature of the read kernel (scale and
    minimum are its arguments 4 and 5)."""
    from gear_hf.kernels.cpu import dequant

    torch.manual_seed(4)
    signatures = []
    for stats in ("8", "16"):
        spec = ChunkSpec(3, "token", 32, 0.0, 0, rotate=True, stats=stats)
        run = _run(torch.randn(2, 3, 64, 64), spec, 32)
        assert run.scale.dtype == (torch.uint8 if stats == "8" else torch.bfloat16)
        out = torch.empty(2, 3, 64, 64)
        cpu.decompress_into(run, spec, 32, 64, 2, out)
        assert_matches_oracle(out, decompress(run, spec, 32, 64, torch.float32, chunks=2), low_rank=True)
        signatures.append(set(dequant._decompress.signatures))
    assert signatures[1] == signatures[0]
    assert {str(signature[4]) for signature in signatures[1]} == {"array(uint8, 4d, C)"}


def test_side_information_of_every_dtype_shares_one_kernel_signature():
    """Outlier values and low-rank factors reach the kernels as their bytes (int8 factor codes, bf16, or float32 cast
    from an fp16 model's): runs of every side dtype and factor width decompress as the oracle does, through one
    signature of the read kernel (factor a is its argument 6, the outlier values its argument 10)."""
    from gear_hf.kernels.cpu import dequant

    torch.manual_seed(5)
    signatures = []
    for dtype, factor_bits in ((torch.float32, 8), (torch.float32, 16), (torch.float16, 16), (torch.float16, 8),
                               (torch.bfloat16, 16)):
        spec = ChunkSpec(4, "channel", 32, 0.02, 2, factor_bits=factor_bits)
        run = _run((torch.randn(2, 3, 64, 64) * 2 + torch.linspace(-1, 3, 64)).to(dtype), spec, 32)
        assert run.sparse_values.dtype == (torch.float16 if dtype == torch.float16 else torch.bfloat16)
        out = torch.empty(2, 3, 64, 64)
        cpu.decompress_into(run, spec, 32, 64, 2, out)
        assert_matches_oracle(out, decompress(run, spec, 32, 64, torch.float32, chunks=2), low_rank=True)
        signatures.append(set(dequant._decompress.signatures))
    assert all(found == signatures[0] for found in signatures)
    assert {(str(signature[6]), str(signature[10])) for signature in signatures[0]} == \
        {("array(uint8, 5d, C)", "array(uint8, 5d, C)")}


def test_an_fp16_model_attends_through_the_kernels_a_bf16_model_compiled(monkeypatch):
    """An fp16 model's side information (float32 for the kernels) is read as its bytes as a bf16 model's is: its
    decode steps take the fused attention through the signatures the bf16 model's steps compiled."""
    from gear_hf.kernels.cpu import attend, threads
    from gear_hf.warmup import tiny_model

    launched = []
    launch = threads.launch
    monkeypatch.setattr(threads, "launch", lambda *args: launched.append(args[2][0].shape) or launch(*args))
    ids = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    signatures = []
    for dtype in (torch.bfloat16, torch.float16):
        launched.clear()
        model = tiny_model(dtype)
        with gear_hf.enabled(model, GearConfig.preset("gear-2")), torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert launched, f"{dtype}: no decode step took the fused CPU attention"
        signatures.append(set(attend._attend.signatures) | set(attend._attend_parallel.signatures))
    assert signatures[1] == signatures[0]


def test_decompress_supported_declines():
    d = 64
    out = torch.empty(1, 2, 16, d)
    assert cpu.decompress_supported(ChunkSpec(2, "channel", 16, 0.0, 0), d, out)
    assert cpu.decompress_supported(ChunkSpec(2, "channel", 16, 0.0, 0, rotate=True), d, out)
    assert cpu.decompress_supported(ChunkSpec(2.5, "channel", 16, 0.0, 0, allocated=True), d, out)
    assert not cpu.decompress_supported(ChunkSpec(2, "channel", 16, 0.0, 0), d, out.half())
    assert not cpu.decompress_supported(ChunkSpec(2, "token", 48, 0.0, 0), d, out)  # 48 does not split 64
    assert not cpu.decompress_supported(ChunkSpec(2, "token", 20, 0.0, 0), 60, torch.empty(1, 2, 16, 60))  # d % 8
    assert not cpu.decompress_supported(ChunkSpec(2, "channel", 16, 0.0, 0), d, None)
    partial = (torch.ones(1, 1, 16, d // 2), torch.zeros(1, 1, 16, d // 2))  # Phi-3's partial rotary: torch path
    assert not cpu.decompress_supported(ChunkSpec(2, "channel", 16, 0.0, 0), d, out, partial)


def test_outputs_numba_cannot_view():
    """An output that is no row range of a contiguous tensor (here a transposed one) is written through a temporary."""
    torch.manual_seed(3)
    spec = ChunkSpec(3, "token", 16, 0.05, 2, factor_bits=8)
    run = _run(torch.randn(2, 3, 32, 64), spec, 32)
    out = torch.empty(2, 3, 64, 32).transpose(2, 3)
    assert cpu.arrays.rows(out) is None and cpu.decompress_supported(spec, 64, out)
    assert_matches_oracle(cpu.decompress_into(run, spec, 32, 64, 1, out), decompress(run, spec, 32, 64, torch.float32),
                          low_rank=True)
    x, cos, sin = torch.randn(2, 3, 32, 64), torch.randn(1, 1, 32, 64), torch.randn(1, 1, 32, 64)
    transposed = torch.empty(2, 3, 64, 32).transpose(2, 3)
    assert torch.equal(cpu.rotate_into(x, cos, sin, transposed), apply_rotary(x, cos, sin))


@pytest.mark.parametrize("batch_cos", [1, 2])
def test_rotate_into_equals_apply_rotary(batch_cos):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 40, 64)
    cos, sin = torch.randn(batch_cos, 1, 37, 64), torch.randn(batch_cos, 1, 37, 64)
    keys = x[:, :, 3:40]  # a slice of a wider buffer
    expected = apply_rotary(keys, cos, sin)
    workspace = torch.empty(2, 3, 50, 64)
    assert cpu.rotate_supported(keys, cos, workspace[:, :, 2:39])
    assert torch.equal(cpu.rotate_into(keys, cos, sin, workspace[:, :, 2:39]), expected)
    inplace = keys.clone()
    assert torch.equal(cpu.rotate_into(inplace, cos, sin, inplace), expected)
    assert not cpu.rotate_supported(keys, cos[..., :32], workspace[:, :, 2:39])  # partial rotary: torch
    assert not cpu.rotate_supported(keys.bfloat16(), cos, workspace[:, :, 2:39])


def test_rows_views():
    base = torch.arange(2 * 3 * 50 * 8, dtype=torch.float32).view(2, 3, 50, 8)
    for view in (base[:, :, 5:20], base[:1, :, 0:9], base[:, 1:2, 7:9], base[1:, :, 45:],
                 base.view(6, 1, 50, 8)[1:, :, 3:5]):
        whole, at = cpu.arrays.rows(view)
        assert torch.equal(torch.from_numpy(whole)[:, :, at : at + view.shape[2]], view)
    assert cpu.arrays.rows(base.transpose(2, 3)[:, :, :4]) is None
    assert cpu.arrays.rows(base[..., ::2]) is None
    assert cpu.arrays.rows(base[:, ::2, 5:9]) is None  # heads skipped


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    cpu_device = torch.device("cpu")
    numba_everywhere = {"compress": "numba", "reconstruct": "numba", "attend": "numba"}
    assert resolve(GearConfig(), 64, torch.bfloat16, cpu_device).names() == numba_everywhere  # numba installed
    # "lean" searches its value ranges: compressed by torch, read and attended by numba
    lean = GearConfig.recommended(name="lean")
    assert resolve(lean, 64, torch.bfloat16, cpu_device).names() == {**numba_everywhere, "compress": "torch"}
    torch_only = {"compress": "torch", "reconstruct": "torch", "attend": "reference"}
    assert resolve(GearConfig(backend="torch"), 64, torch.bfloat16, cpu_device).names() == torch_only
    # auto per operation: range search is compressed by torch, read and attended by numba (and says why)
    plan = resolve(GearConfig.recommended(name="compact"), 64, torch.bfloat16, cpu_device)
    assert plan.names() == {**numba_everywhere, "compress": "torch"}
    assert any("range_search" in reason for name, reason in plan.skipped["compress"] if name == "numba")
    with pytest.raises(ValueError, match="'numba' cannot run here: its compress .*range_search"):
        resolve(GearConfig.recommended(name="compact", backend="numba"), 64, torch.bfloat16, cpu_device)
    monkeypatch.setenv("GEAR_HF_BACKEND", "torch")
    assert resolve(GearConfig(), 64, torch.bfloat16, cpu_device).names() == torch_only
    monkeypatch.setenv("GEAR_HF_BACKEND", "numba")
    with pytest.raises(ValueError, match="'numba' cannot run here: it runs the CPU kernels and the tensors are on "
                                         "cuda"):
        resolve(GearConfig(), 64, torch.bfloat16, torch.device("cuda"))


def test_rotary_memo_extends_exactly():
    """Across steps the memo computes only new columns; the result equals computing every column."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=4096))
    like = torch.zeros(1)
    memo = RotaryMemo()
    positions = torch.arange(1000)[None].repeat(2, 1)
    memo.get(0, 0, rotary, like, lambda: positions)
    for step, length in ((1, 1001), (2, 1003)):
        now = torch.arange(length)[None].repeat(2, 1)
        cos, sin = memo.get(step, 0, rotary, like, lambda: now)
        full_cos, full_sin = rotary(like, now)
        assert torch.equal(cos[:, 0], full_cos) and torch.equal(sin[:, 0], full_sin)
    moved = torch.arange(5, 1008)[None].repeat(2, 1)  # not an extension: computed afresh
    assert torch.equal(memo.get(3, 0, rotary, like, lambda: moved)[0][:, 0], rotary(like, moved)[0])
    for step in range(4, 10):  # a sliding layer's start column moves every step: old entries are dropped
        memo.get(step, step, rotary, like, lambda: moved)
    assert len(memo._entries) <= 2


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=192, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _generate_both(model, ids: torch.Tensor, mask: torch.Tensor, preset: str, new_tokens: int,
                   **overrides) -> list[tuple]:
    """(tokens, float32 scores, decode steps per path) of greedy generation with the torch backend, then the numba
    one ("default": GearConfig()'s storage, shrunk to the tiny prompts; overrides: other GearConfig fields)."""
    outs = []
    for backend in ("torch", "numba"):
        config = GearConfig(group_size=16, buffer_size=16, prompt_group_size=32, backend=backend, **overrides) \
            if preset == "default" else GearConfig.preset(preset, group_size=16, buffer_size=16, backend=backend,
                                                          **overrides)
        with gear_hf.enabled(model, config):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            paths = dict(gear_hf.last_cache(model).step_paths)
        outs.append((out.sequences, torch.stack(out.scores, 1).float(), paths))
    return outs


PRESETS = ["kivi-2", "outlier-4", "gear-2", "gear-l-k4v2", "fp16", "default"]


@pytest.mark.parametrize("preset", PRESETS)
def test_generation_numba_reads_equal_torch(preset, reference_path):
    """A left-padded batch (rows flush on different steps: the slot layout), decode chunks flushed on the way: the
    reference path with the numba read kernels gives the torch backend's tokens, and its logits exactly (to float32
    rounding with a low-rank term, which numba fits and sums in another order, or a rotation: observed < 1e-5)."""
    ids, mask = prompts(3, 45, seed=1, pads=[0, 9, 20])
    (tokens, scores, _), (numba_tokens, numba_scores, paths) = _generate_both(_tiny_llama(), ids, mask, preset, 20)
    assert paths.get("fused", 0) == 0
    assert torch.equal(tokens, numba_tokens)
    if preset == "default" or GearConfig.preset(preset).uses_lowrank:  # (default: Hadamard-rotated values)
        assert (scores - numba_scores).abs().max().item() < 1e-4
    else:
        assert torch.equal(scores, numba_scores)


@pytest.mark.parametrize("preset", PRESETS)
def test_generation_fused_cpu_attention_matches_torch(preset):
    """The numba backend's decode steps take the fused CPU attention (every one of them; fp16, which compresses
    nothing, keeps the reference path: stock attention bit for bit): the torch backend's tokens, its logits to
    float32 rounding (observed < 1e-5)."""
    ids, mask = prompts(3, 45, seed=1, pads=[0, 9, 20])
    (tokens, scores, _), (numba_tokens, numba_scores, paths) = _generate_both(_tiny_llama(), ids, mask, preset, 20)
    layer_steps = 19 * 2  # decode steps x layers
    assert paths == ({"reference": layer_steps} if preset == "fp16" else {"fused": layer_steps})
    assert torch.equal(tokens, numba_tokens)
    assert (scores - numba_scores).abs().max().item() < 1e-4


@pytest.mark.parametrize("preset", ["kivi-2", "gear-2", "default"])
def test_generation_numba_reads_equal_torch_bf16(preset, reference_path):
    """A bf16 model through the read kernels: the torch backend's tokens, and its logits exactly without a low-rank
    term or rotation (the reads round as torch rounds bf16 tensors)."""
    ids, mask = prompts(2, 40, seed=2, pads=[0, 7])
    (tokens, scores, _), (numba_tokens, numba_scores, _) = _generate_both(_tiny_llama().to(torch.bfloat16), ids, mask,
                                                                          preset, 12)
    assert torch.equal(tokens, numba_tokens)
    if preset == "kivi-2":
        assert torch.equal(scores, numba_scores)


@pytest.mark.parametrize("preset,factor_bits", [("kivi-2", 8), ("gear-2", 8), ("gear-2", 16), ("default", 8)])
def test_generation_fused_cpu_attention_bf16(preset, factor_bits):
    """A bf16 model through the fused CPU attention (float32 inside, where the reference path attends in bf16):
    every step's logits within bf16 rounding of the torch backend's for as long as both generated the same tokens
    (observed: one bf16 step, 0.004 at logits ~1; this random model's near ties then let the tokens part after a
    few steps). factor_bits=16: bf16 factors read in place, as their bits."""
    ids, mask = prompts(2, 40, seed=2, pads=[0, 7])
    (tokens, scores, _), (fused_tokens, fused_scores, paths) = _generate_both(_tiny_llama().to(torch.bfloat16), ids,
                                                                              mask, preset, 12,
                                                                              factor_bits=factor_bits)
    assert paths == {"fused": 11 * 2}
    parted = (tokens != fused_tokens).any(0)[ids.shape[1]:].nonzero()
    same_prefix = int(parted[0]) + 1 if parted.numel() else 12  # (the step that parts still had the same inputs)
    assert same_prefix >= 2
    assert (scores - fused_scores)[:, :same_prefix].abs().max() <= 2e-2 * scores.abs().max()


@pytest.mark.parametrize("preset", ["default", "gear-2"])
def test_fused_cpu_attention_keeps_one_signature_as_the_cache_fills(preset, monkeypatch):
    """numba compiles the fused kernel once per set of argument types (seconds each, cold): from nothing compressed (a
    prompt shorter than a group) through decode chunks of keys, then of values, and with a compressed prompt, in a
    bf16 and a float32 model, it is called with one set (an absent run is handed as a run of no chunks of its spec,
    the outliers from their first row)."""
    from gear_hf.kernels.cpu import attend

    seen, stages = set(), set()
    original = attend._attend

    def recording(*args):
        seen.add(tuple(numba.typeof(a) for a in args))
        stages.add((bool(args[6][:, 1].max() > 0), int(args[6][:, 2].max())))  # rows: (prompt?, decode chunks)
        return original(*args)

    monkeypatch.setattr(attend, "_attend", recording)
    monkeypatch.setattr(attend.threads, "parts", lambda shares: 1)  # (the serial kernel whatever torch's threads)
    for dtype, length in ((torch.bfloat16, 5), (torch.bfloat16, 40), (torch.float32, 5)):
        model = _tiny_llama().to(dtype)
        ids, mask = prompts(1, length, seed=3)
        config = GearConfig(group_size=16, buffer_size=16, prompt_group_size=32, backend="numba") \
            if preset == "default" else GearConfig.preset(preset, group_size=16, buffer_size=16, backend="numba")
        with gear_hf.enabled(model, config), torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                           pad_token_id=0)
    # (GearConfig() holds keys and values a chunk longer: the kernel's rows count one chunk fewer, `kernel_views`)
    chunks = 1 if preset == "default" else 2
    assert {(False, 0), (False, chunks), (True, 0), (True, chunks)} <= stages
    assert len(seen) == 1


def test_forced_numba_without_numba_fails_at_enable(monkeypatch):
    monkeypatch.setattr("gear_hf.backends.numba_backend.import_problem", lambda *m: "numba is not installed")
    message = r"'numba' cannot run here: numba is not installed \(pip install 'gear-hf\[cpu\]'\)"
    with pytest.raises(ValueError, match=message):
        gear_hf.enable(_tiny_llama(), GearConfig(backend="numba"))
