"""The Triton decode kernels (register and tensor-core) read a buffer held per token as stored (`StreamView.tail`:
`GearConfig()`'s 8-bit keys and 4-bit rotated values, 8-bit values, 4-bit rotated keys), this step's own tokens exact,
and attend as the float32 oracle (`reference_decode_attention`: the buffer decoded by `decompress`) and as the same
kernel handed the buffer decoded (`kernel_views(..., reader=None)`). Values are attended in the rotated basis when the
compressed values are rotated (ROT_V: a rotated tail as stored, an 8-bit one rotated in the kernel) and in the plain
one otherwise (a rotated tail rotated back). Without CUDA the kernels run in Triton's interpreter; shapes stay small.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # (set before gear_hf.kernels.decode imports triton's kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from gear_hf import GearConfig  # noqa: E402
from gear_hf.backends.triton_backend import TritonBackend  # noqa: E402
from gear_hf.cache.fused import build_cache, reference_decode_attention  # noqa: E402
from gear_hf.format import INT4_TOKENS, INT8_TOKENS, TAIL_SPECS, layer_formats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
PAD = [0, 11]  # row 1 left-padded


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _config(name: str) -> GearConfig:
    """Test-sized configurations: (compressed values rotated?, key tail, value tail)."""
    gear4 = dict(bits=4, group_size=16, buffer_size=32, outlier_ratio=0.1)
    return {
        # GearConfig(): rotated 3-bit values (ROT_V), 8-bit rotated keys and 4-bit rotated values in the buffer, keys
        # not held (version 5's "steady"; keys held too: test_kernels_read_held_keys_and_values)
        "default": GearConfig(group_size=32, buffer_size=32, prompt_group_size=64, key_buffer_size=None),
        "default-int8": GearConfig(group_size=32, buffer_size=32, prompt_group_size=64, value_buffer="int8",
                                   key_buffer_size=None),
        # unrotated compressed values: a rotated tail is rotated back in the kernel
        "gear4-int8-int4": GearConfig.preset("gear", **gear4, key_buffer="int8", value_buffer="int4"),
        "gear4-int8": GearConfig.preset("gear", **gear4, key_buffer="int8", value_buffer="int8"),
        "gear4-int8-rotated": GearConfig.preset("gear", **gear4, key_buffer="int8-rotated",
                                                value_buffer="int8-rotated"),
        "gear4-int4": GearConfig.preset("gear", **gear4, key_buffer="int4", value_buffer="int4"),
        # one stream coded, the other handed full precision (the "final" values are decoded by the oracle)
        "default-final": GearConfig(group_size=32, buffer_size=32, prompt_group_size=64, value_buffer="final",
                                    key_buffer_size=None),
        "gear4-full-int4": GearConfig.preset("gear", **gear4, key_buffer="full", value_buffer="int4"),
        # 64-token decode chunks: the tensor-core kernel's 64-token blocks (a held chunk in 32-token steps)
        "b64": GearConfig(group_size=32, buffer_size=64, prompt_group_size=64, key_buffer_size=None),
    }[name]


def _mask_of(steps, pad):
    mask = torch.ones(len(pad), sum(steps), dtype=torch.long)
    for b, p in enumerate(pad):
        mask[b, :p] = 0
    return mask


def _cache(cfg, *, d, kv_heads, steps, q_len, in_step, dtype, seed=0, value_bias=0.0):
    """A random cache (batch 2, row 1 left-padded) after `steps`; in_step: one more step of q_len tokens stored (its
    tokens staged, exact) and not yet flushed."""
    cache, _, _ = build_cache(cfg, batch=2, kv_heads=kv_heads, head_dim=d, steps=list(steps), pad=PAD, dtype=dtype,
                              device=DEVICE, seed=seed, value_bias=value_bias)
    if in_step:
        g = torch.Generator().manual_seed(seed + 7)
        mask = torch.cat([_mask_of(steps, PAD), torch.ones(2, q_len, dtype=torch.long)], dim=1)
        pos = (mask.cumsum(1) - 1)[:, -q_len:]
        cache.observe_attention_mask(mask.to(DEVICE))
        k, v = (torch.randn(2, kv_heads, q_len, d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
        cache.store(0, k, v, pos.to(DEVICE))
    return cache


def _attend(cache, q, *, tensor_core, reader):
    from gear_hf.kernels.decode import decode_attention

    d = q.shape[-1]
    keys, values, layout = cache.kernel_views(0, q.shape[2], q.device, reader=reader)
    out = decode_attention(q, keys, values, layout, scaling=d ** -0.5, inv_freq=_inv_freq(d),
                           tensor_core=tensor_core)
    return out, keys, values, layout


def _attended(cfg, *, d, kv_heads, group, steps, q_len, in_step, tensor_core, dtype, value_bias=0.0):
    """A random cache after `steps` (+ a staged step when in_step) and a query of kv_heads * group heads: (cache,
    (out, keys, values, layout) with the coded buffers read as stored, the same handed decoded, the float32 oracle)."""
    with torch.inference_mode():
        cache = _cache(cfg, d=d, kv_heads=kv_heads, steps=steps if in_step else (*steps, q_len), q_len=q_len,
                       in_step=in_step, dtype=dtype, value_bias=value_bias)
        q = torch.randn(2, kv_heads * group, q_len, d, generator=torch.Generator().manual_seed(d + q_len))
        q = q.to(dtype).to(DEVICE)
        stored = _attend(cache, q, tensor_core=tensor_core, reader=TritonBackend())
        decoded = _attend(cache, q, tensor_core=tensor_core, reader=None)
        ref = reference_decode_attention(cache, 0, q, scaling=d ** -0.5, inv_freq=_inv_freq(d))
    return cache, stored, decoded, ref


def _err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.abs().max()).item()


# (config, head_dim, KV heads, GQA group, history steps, query tokens, staged, tensor core, dtype)
CASES = [
    ("default", 64, 2, 4, (77, 40), 1, True, False, torch.float32),
    ("default", 128, 1, 4, (77, 40), 2, True, True, torch.float16),
    ("default", 64, 2, 1, (77, 40), 1, False, True, torch.bfloat16),
    ("default", 64, 2, 4, (20,), 1, True, True, torch.float16),  # no chunk yet: ROT_V off, a rotated tail
    ("default-int8", 128, 1, 4, (77, 40), 1, True, False, torch.bfloat16),
    ("default-int8", 64, 2, 1, (77, 40), 2, False, True, torch.float16),
    ("gear4-int8-int4", 64, 2, 4, (77, 40), 2, True, False, torch.float32),
    ("gear4-int8-int4", 128, 1, 1, (77, 40), 1, False, True, torch.float16),
    ("gear4-int8", 64, 2, 4, (77, 40), 1, True, True, torch.float16),
    ("gear4-int8", 128, 1, 1, (77, 40), 1, False, False, torch.float32),
    ("gear4-int4", 64, 2, 4, (77, 40), 1, True, False, torch.float32),
    ("gear4-int8-rotated", 64, 2, 4, (77, 40), 1, True, True, torch.float16),
    ("gear4-int8-rotated", 128, 1, 1, (77, 40), 2, False, False, torch.float32),
    ("default-final", 64, 2, 4, (77, 40), 1, True, True, torch.float16),
    ("gear4-full-int4", 64, 2, 4, (77, 40), 2, True, False, torch.float32),
]


@pytest.mark.parametrize("name,d,kv_heads,group,steps,q_len,in_step,tensor_core,dtype", CASES,
                         ids=[f"{c[0]}-d{c[1]}-kv{c[2]}-g{c[3]}-{'x'.join(map(str, c[4]))}-q{c[5]}"
                              f"{'-staged' if c[6] else ''}-{'tc' if c[7] else 'reg'}-{str(c[8])[6:]}" for c in CASES])
def test_kernels_read_the_coded_buffer_as_the_oracle(name, d, kv_heads, group, steps, q_len, in_step, tensor_core,
                                                     dtype):
    cfg = _config(name)
    fmt = layer_formats(cfg)
    cache, (out, keys, values, layout), (decoded, *_), ref = _attended(
        cfg, d=d, kv_heads=kv_heads, group=group, steps=steps, q_len=q_len, in_step=in_step, tensor_core=tensor_core,
        dtype=dtype)
    # the views carry the codes as stored (not a decoded copy) for each coded stream, and no tail for the others
    for view, choice in ((keys, cfg.key_buffer), (values, cfg.value_buffer)):
        coded = choice in TAIL_SPECS
        assert (view.tail is not None) == coded, (choice, view.tail)
        if coded:
            assert view.tail.bits == TAIL_SPECS[choice].bits and view.tail.rotated == TAIL_SPECS[choice].rotate
            assert view.tail.codes.dtype == torch.uint8 and view.tail.codes.shape[-1] == d * view.tail.bits // 8
            assert (view.tail.staged is not None) == in_step
            assert view.buffer.shape[2] == (view.tail.codes.shape[2] if in_step else 0)  # only the staged tokens
            if in_step:
                assert int(view.tail.staged.sum()) == 2 * q_len  # this step's tokens, both rows
    if keys.tail is not None and values.tail is not None and in_step:  # (the kernel reads one set of flags: the
        for b in range(2):  # values', whose row's buffer tokens follow its held chunk, buffer_size slots on)
            shift = cfg.buffer_size if values.held_chunk and cache.decode_chunks[b] > 0 else 0
            assert torch.equal(values.tail.staged[b].nonzero(), keys.tail.staged[b].nonzero() + shift)
    assert (layout.rows[:, 3] > q_len).all() and int(layout.rows[:, 3].max()) < cfg.buffer_size  # partly filled
    rot_v = any(run is not None and run.spec.rotate for run in (values.prompt, values.decode)) and \
        (layout.max_prompt > 0 or layout.max_decode_chunks > 0)
    assert rot_v == (name.startswith("default") and len(steps) > 1)  # (the case covers what its name says)
    assert bool(fmt[1].decode.rotate) == name.startswith("default")
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _err(out, ref) < TOL[dtype], _err(out, ref)
    assert _err(out, decoded) < TOL[dtype], _err(out, decoded)


# values held a chunk longer than keys (GearConfig.value_buffer_size): (config, head_dim, KV heads, GQA group, history
# steps, query tokens, staged, tensor core, dtype); PAD makes row 0 hold its prompt chunk + 1 decode chunk (the held
# one: no value chunk compressed) and row 1 three (two compressed)
HELD_CASES = [
    ("default", 64, 2, 4, (77, 40), 1, True, False, torch.float32),
    ("default", 128, 1, 4, (77, 40), 2, False, True, torch.float16),
    ("default", 64, 2, 7, (70, 1, 1, 40), 2, True, True, torch.bfloat16),
    ("default", 64, 2, 4, (20,), 1, True, True, torch.float16),  # no chunk yet: nothing held
    ("gear4-int8", 64, 2, 4, (77, 40, 33), 1, True, False, torch.float32),  # outliers, an unrotated 8-bit value tail
    ("gear4-int8", 64, 1, 1, (77, 40, 33), 1, False, True, torch.float16),
    ("gear4-int8-int4", 128, 1, 4, (77, 40, 33), 1, True, True, torch.float16),  # rotated tail, plain chunks
    ("b64", 64, 2, 4, (77, 70, 70), 1, True, True, torch.float16),
]


@pytest.mark.parametrize("name,d,kv_heads,group,steps,q_len,in_step,tensor_core,dtype", HELD_CASES,
                         ids=[f"{c[0]}-d{c[1]}-kv{c[2]}-g{c[3]}-{'x'.join(map(str, c[4]))}-q{c[5]}"
                              f"{'-staged' if c[6] else ''}-{'tc' if c[7] else 'reg'}-{str(c[8])[6:]}"
                              for c in HELD_CASES])
def test_kernels_read_a_held_value_chunk(name, d, kv_heads, group, steps, q_len, in_step, tensor_core, dtype):
    """Each row's newest decode chunk: keys from the chunk, values from the front of the coded value buffer (the
    row's buffer tokens after it, this step's own tokens exact), as the float32 oracle attends them; and from the
    value buffer handed decoded (full precision, its own head stride: it holds buffer_size more tokens than keys')."""
    cfg = _config(name)
    cfg = cfg.replace(value_buffer_size=2 * cfg.buffer_size, key_buffer_size=None)  # (values alone held)
    _, (out, keys, values, layout), (decoded, _, decoded_values, _), ref = _attended(
        cfg, d=d, kv_heads=kv_heads, group=group, steps=steps, q_len=q_len, in_step=in_step, tensor_core=tensor_core,
        dtype=dtype)
    assert decoded_values.tail is None and decoded_values.held_chunk
    assert _err(decoded, ref) < TOL[dtype], _err(decoded, ref)
    chunks = layout.rows[:, 2].tolist()
    assert values.held_chunk and not keys.held_chunk and values.tail is not None
    if len(steps) == 1:
        assert chunks == [0, 0]
    else:  # (the cases cover what the comment says: GearConfig()'s prompt chunk leaves row 0 one decode chunk)
        assert min(chunks) >= 1 and max(chunks) >= 2 and (chunks == [1, 3] or not name.startswith("default"))
    assert (values.decode is not None) == (max(chunks) > 1)
    assert values.tail.codes.shape[2] >= int(layout.rows[1, 3]) + cfg.buffer_size * (chunks[1] > 0)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _err(out, ref) < TOL[dtype], _err(out, ref)


# keys held a chunk longer too (GearConfig.key_buffer_size): both streams handed as they store them, each row's newest
# chunk buffered tokens of both (the register kernel, the tensor-core one with 32- and 64-token chunks)
HELD_KEY_CASES = [HELD_CASES[0], HELD_CASES[2], HELD_CASES[4], HELD_CASES[-1]]


@pytest.mark.parametrize("name,d,kv_heads,group,steps,q_len,in_step,tensor_core,dtype", HELD_KEY_CASES,
                         ids=[f"{c[0]}-d{c[1]}-{'x'.join(map(str, c[4]))}-q{c[5]}-{'tc' if c[7] else 'reg'}"
                              for c in HELD_KEY_CASES])
def test_kernels_read_held_keys_and_values(name, d, kv_heads, group, steps, q_len, in_step, tensor_core, dtype):
    """Keys and values of each row's newest decode chunk from the front of their coded buffers, as the float32
    oracle attends them; the kernel sees no held chunk, rows of (c - 1) chunks and buffer_size more buffered tokens."""
    cfg = _config(name)
    cfg = cfg.replace(value_buffer_size=2 * cfg.buffer_size, key_buffer_size=2 * cfg.buffer_size, held_for=1.0)
    cache, (out, keys, values, layout), (decoded, *_), ref = _attended(
        cfg, d=d, kv_heads=kv_heads, group=group, steps=steps, q_len=q_len, in_step=in_step, tensor_core=tensor_core,
        dtype=dtype)
    counts = cache.layout.plan.attend if in_step else cache.layout.counts
    assert not keys.held_chunk and not values.held_chunk and keys.tail is not None and values.tail is not None
    assert layout.rows[:, 2].tolist() == [max(c - 1, 0) for c in counts.chunks] and max(counts.chunks) >= 2
    assert layout.rows[:, 3].tolist() == [f + cfg.buffer_size * (c > 0) for c, f in zip(counts.chunks,
                                                                                        counts.buffer)]
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _err(out, ref) < TOL[dtype], _err(out, ref)
    assert _err(decoded, ref) < TOL[dtype], _err(decoded, ref)  # (the buffers handed decoded)


@pytest.mark.parametrize("centered", ["", "keys", "both", "chunks"])
@pytest.mark.parametrize("steps,in_step,tensor_core,dtype", [((77, 40), True, False, torch.float32),
                                                               ((77, 40, 33), False, True, torch.bfloat16)],
                         ids=["reg-staged", "tc"])
def test_kernels_read_rows_that_released_their_held_chunk(steps, in_step, tensor_core, dtype, centered):
    """Both streams held until 16 tokens follow the chunk (held_for 0.5 of a 32-token buffer): one row holds its
    newest chunk, the other has released it; each row is handed as its streams store it. centered: the key buffer's
    codes are of centered, scaled keys (`GearConfig.key_buffer_centered`), read back through each row's centers;
    "both": the value buffer's of centered values too (`value_buffer_centered`; values with a per-channel offset, so
    a kernel that ignored their centers would be off by it); "chunks": the value chunks' too (`value_chunks_centered`:
    every value handed centered, the centers added to the output by the combining kernel)."""
    cfg = _config("default").replace(value_buffer_size=64, key_buffer_size=64, held_for=0.5,
                                     key_buffer_centered=bool(centered),
                                     value_buffer_centered=centered in ("both", "chunks"),
                                     value_chunks_centered=centered == "chunks")
    cache, (out, keys, values, layout), (decoded, *_), ref = _attended(
        cfg, d=64, kv_heads=2, group=4, steps=steps, q_len=1, in_step=in_step, tensor_core=tensor_core, dtype=dtype,
        value_bias=4.0)
    assert (keys.tail.affine is not None) == bool(centered)
    assert (values.tail.affine is not None) == (centered == "both")  # ("chunks": the codes read centered)
    assert (values.center is not None) == (centered == "chunks")
    stream = cache.layers[0].key_stream
    assert stream.holding == cache.layers[0].value_stream.holding == [False, True]
    own = stream.own(cache.layout.plan.attend if in_step else cache.layout.counts)
    assert layout.rows[:, 2].tolist() == list(own.chunks) and layout.rows[:, 3].tolist() == list(own.buffer)
    assert _err(out, ref) < TOL[dtype], _err(out, ref)
    assert _err(decoded, ref) < TOL[dtype], _err(decoded, ref)


@pytest.mark.parametrize("name", ["default-int8", "gear4-int8-int4", "gear4-int8", "gear4-int8-rotated"])
def test_kernels_read_centered_values_in_the_basis_they_attend_them(name):
    """A centered value buffer (values with a per-channel offset) read by a kernel that attends values rotated (ROT_V)
    or not, from a buffer stored rotated or not: the centers are handed in the basis the values are attended in
    (`views.affine_in_basis`) and the output is the oracle's."""
    cfg = _config(name).replace(value_buffer_centered=True, value_chunks_centered=False)
    _, (out, _, values, _), (decoded, *_), ref = _attended(cfg, d=64, kv_heads=2, group=4, steps=(77, 40), q_len=1,
                                                           in_step=True, tensor_core=False, dtype=torch.float32,
                                                           value_bias=4.0)
    assert values.tail.affine is not None
    assert _err(out, ref) < TOL[torch.float32], _err(out, ref)
    assert _err(decoded, ref) < TOL[torch.float32], _err(decoded, ref)


def test_a_wrong_code_changes_the_output():
    """The kernel really reads the tail: zeroed value codes of the coded tokens change the output (the exact staged
    tokens do not come from the codes: zeroing those bytes alone changes nothing)."""
    cfg = _config("default")
    with torch.inference_mode():
        cache = _cache(cfg, d=64, kv_heads=2, steps=(77, 40), q_len=1, in_step=True, dtype=torch.float32)
        q = torch.randn(2, 8, 1, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        out, keys, values, layout = _attend(cache, q, tensor_core=False, reader=TritonBackend())
        from gear_hf.kernels.decode import decode_attention

        kw = dict(scaling=0.125, inv_freq=_inv_freq(64))
        tail = values.tail
        staged_codes = tail.codes.clone()
        staged_codes[tail.staged[:, None, :, None].expand_as(staged_codes)] = 0
        same = decode_attention(q, keys, dataclasses.replace(values, tail=dataclasses.replace(
            tail, codes=staged_codes)), layout, **kw)
        zero = decode_attention(q, keys, dataclasses.replace(values, tail=dataclasses.replace(
            tail, codes=torch.zeros_like(tail.codes))), layout, **kw)
    assert torch.equal(same, out)
    assert _err(zero, out) > 1e-2


def test_triton_backend_reads_the_formats_its_kernels_read():
    backend = TritonBackend()
    for d in (32, 64, 128):
        assert backend.reads_tail(INT8_TOKENS, d) and backend.reads_tail(INT4_TOKENS, d)
    assert not backend.reads_tail(INT8_TOKENS, 80) and not backend.reads_tail(INT4_TOKENS, 96)  # (no fused kernel)
    final = layer_formats(GearConfig(value_buffer="final"))[1].tail
    assert final is not None and not backend.reads_tail(final, 128)  # the "final" buffer is handed decoded
    assert not backend.reads_tail(dataclasses.replace(INT8_TOKENS, group=32), 128)


def test_bad_tails_say_what_is_wrong():
    from gear_hf.kernels.decode import decode_attention

    cfg = _config("default").replace(value_chunks_centered=False)  # (the value buffer's centers read as its affine)
    with torch.inference_mode():
        cache = _cache(cfg, d=64, kv_heads=2, steps=(77, 40), q_len=1, in_step=True, dtype=torch.float32)
        q = torch.zeros(2, 8, 1, 64, device=DEVICE)
        keys, values, layout = cache.kernel_views(0, 1, q.device, reader=TritonBackend())
        tail = keys.tail
        bad = [(dict(bits=2), "keys.tail.bits = 2"),
               (dict(codes=tail.codes[..., :32].contiguous()), r"keys.tail.codes must be \['torch.uint8'\]"),
               (dict(scale=tail.scale.float()[:, :1]), "keys.tail.scale must be"),
               (dict(staged=tail.staged[:1]), "keys.tail.staged must be bool"),
               (dict(codes=tail.codes.transpose(0, 1).contiguous().transpose(0, 1)), "keys.tail.codes must be "
                                                                                       "contiguous")]
        for change, match in bad:
            with pytest.raises(ValueError, match=match):
                decode_attention(q, dataclasses.replace(keys, tail=dataclasses.replace(tail, **change)), values,
                                 layout, scaling=0.125, inv_freq=_inv_freq(64))
        with pytest.raises(ValueError, match="keys.tail.staged and values.tail.staged disagree"):
            decode_attention(q, keys, dataclasses.replace(values, tail=dataclasses.replace(values.tail, staged=None)),
                             layout, scaling=0.125, inv_freq=_inv_freq(64))
        affine = values.tail.affine  # (GearConfig() centers the value buffer)
        for bad, match in ((dict(affine=affine[..., :32].contiguous()), r"values.tail.affine must be None or float32"),
                           (dict(affine_scaled=True), "cannot be read in the rotated basis")):  # (keys' kind)
            with pytest.raises(ValueError, match=match):
                decode_attention(q, keys, dataclasses.replace(values, tail=dataclasses.replace(values.tail, **bad)),
                                 layout, scaling=0.125, inv_freq=_inv_freq(64))
        with pytest.raises(ValueError, match=r"values.buffer \(this step's exact tokens"):
            decode_attention(q, keys, dataclasses.replace(values, buffer=values.buffer[:, :, :5].contiguous()), layout,
                             scaling=0.125, inv_freq=_inv_freq(64))
        for center in (torch.zeros(2, 2, 32, device=DEVICE), torch.zeros(2, 2, 64, dtype=torch.float16, device=DEVICE)):
            with pytest.raises(ValueError, match=r"values.center must be float32 \[B, H, d\] = \(2, 2, 64\)"):
                decode_attention(q, keys, dataclasses.replace(values, center=center), layout, scaling=0.125,
                                 inv_freq=_inv_freq(64))


@pytest.mark.parametrize("held", [False, True], ids=["default", "held"])
def test_generation_through_the_triton_backend_reads_the_coded_buffer(held):
    """generate (batch 2, left-padded, GQA 2, head_dim 32) with GearConfig()'s buffers forced through the Triton
    backend under inference_mode: every decode step runs the fused kernel, its views carry the codes, and the logits
    equal the torch oracle path's. held: values held a chunk longer (value_buffer_size), 22 steps (each row's decode
    chunk is held: test_kernels_read_a_held_value_chunk has rows with held chunks compressed from their codes)."""
    import gear_hf
    from tiny_models import CACHE_ARG, tiny_model

    model = tiny_model("llama3", dtype=torch.float32, head_dim=32).to(DEVICE)
    ids = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    cfg = GearConfig(group_size=16, buffer_size=16, prompt_group_size=32, value_buffer_size=32 if held else None)
    out = {}
    for backend in ("torch", "triton"):
        gear_hf.enable(model, cfg.replace(backend=backend))
        cache = gear_hf.GearCache(model)
        with torch.inference_mode():
            result = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=22 if held else 6,
                                    do_sample=False,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                    **{CACHE_ARG: cache})
        gear_hf.disable(model)
        out[backend] = (torch.stack(result.scores).float(), dict(cache.step_paths), cache)
    assert out["triton"][1].get("fused", 0) > 0 and "fused" not in out["torch"][1]
    triton_cache = out["triton"][2]
    if held:
        assert out["triton"][1] == {"fused": 21 * model.config.num_hidden_layers}
        assert min(triton_cache.decode_chunks) >= 1 and triton_cache.layers[0].value_stream.held_chunk
    keys, values, _ = triton_cache.kernel_views(0, 1, DEVICE, reader=triton_cache.plan.attend)
    assert keys.tail is not None and values.tail is not None and values.tail.rotated
    torch.testing.assert_close(out["triton"][0], out["torch"][0], atol=2e-4, rtol=1e-4)
