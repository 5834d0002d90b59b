"""A decode step's query is handed to the CPU fused attention before RoPE and rotated there (`kernels.cpu.query`):
bit for bit as the host rotates it (`compress.rope.apply_rotary`, then float32 times the scale), so the logits of a
generate are the same bits either way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")

import gear_hf  # noqa: E402
from gear_hf.backends.numba_backend import NumbaBackend  # noqa: E402
from gear_hf.compress.rope import apply_rotary, rope_tables  # noqa: E402
from gear_hf.kernels.cpu.attend import query_rotation_tables, rotates_query  # noqa: E402
from gear_hf.kernels.cpu.query import _query_row  # noqa: E402
from gear_hf.warmup import tiny_model  # noqa: E402


@numba.njit(fastmath={"reassoc", "contract"})
def _query_row_in_fast_caller(q, q_cos, q_sin, rounding, scale, b, head, token, row):
    _query_row(q, q_cos, q_sin, rounding, scale, b, head, token, row)


@pytest.mark.parametrize("query_dtype, table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("attention_scaling", [1.0, 0.7])
def test_the_kernels_query_rows_are_the_hosts_bits(query_dtype, table_dtype, attention_scaling):
    torch.manual_seed(0)
    B, Hq, QL, d = 3, 5, 2, 48  # (odd head count, head_dim not a power of two)
    query = (torch.randn(B, Hq, QL, d) * torch.logspace(-3, 3, d)).to(query_dtype)
    positions = torch.tensor([[7, 8], [1999, 2000], [40000, 40001]])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(positions, inv_freq, attention_scaling)  # [B,QL,d] float32, as HF's rotary module
    cos, sin = cos.to(table_dtype), sin.to(table_dtype)
    scale = 1 / math.sqrt(d) * attention_scaling
    expected = (apply_rotary(query, cos, sin).float() * scale).numpy()
    assert rotates_query(query, cos)
    q_cos, q_sin, rounding = query_rotation_tables(query, (cos, sin))
    q = query.float().numpy()
    # (through a caller with the attention kernel's fastmath, as the kernel calls it, and a row strided as no other
    # call's: numba compiles it here, in that caller's context, whose `contract` it must not take)
    rows = np.empty((d, 2), dtype=np.float32)
    for b in range(B):
        for head in range(Hq):
            for token in range(QL):
                _query_row_in_fast_caller(q, q_cos, q_sin, rounding, np.float32(scale), b, head, token, rows[:, 1])
                got = np.ascontiguousarray(rows[:, 1])
                assert np.array_equal(got.view(np.int32), expected[b, head, token].view(np.int32)), (b, head, token)
    row = np.empty(d, dtype=np.float32)
    rotated = apply_rotary(query, cos, sin).float().numpy()  # (handed rotated: only scaled)
    none, _, _ = query_rotation_tables(query, None)
    _query_row(rotated, none, none, 0, np.float32(scale), 1, 2, 1, row)
    assert np.array_equal(row, expected[1, 2, 1])


def test_other_queries_and_bad_tables_are_named():
    query = torch.zeros(1, 2, 1, 8)
    assert not rotates_query(query.half(), torch.zeros(1, 1, 8).half())  # (fp16: the host rotates it)
    assert not rotates_query(query, torch.zeros(1, 1, 4))  # (partial rotary)
    with pytest.raises(ValueError, match=r"query_rotary: cos/sin must be \[B\|1, q, d\]"):
        query_rotation_tables(query, (torch.zeros(1, 3, 8), torch.zeros(1, 3, 8)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_generate_gives_the_same_logits_with_the_query_rotated_on_the_host(dtype, monkeypatch):
    model = tiny_model(dtype)
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    scores = []
    for host in (False, True):
        if host:  # (the fused path rotates it with apply_rotary before the kernel)
            monkeypatch.setattr(NumbaBackend, "rotates_queries", lambda self, query, cos: False)
        with gear_hf.enabled(model, gear_hf.GearConfig()), torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=70, min_new_tokens=70, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        scores.append(torch.stack(out.scores))
    assert torch.equal(scores[0], scores[1])


def test_the_query_rotation_tables_are_made_once_a_step_for_every_layer(monkeypatch):
    from gear_hf.kernels import cpu

    model = tiny_model("float32")  # (two layers)
    made = []
    tables = cpu.query_rotation_tables
    monkeypatch.setattr(cpu, "query_rotation_tables", lambda *a: made.append(1) or tables(*a))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = gear_hf.GearCache(model)
    with gear_hf.enabled(model, gear_hf.GearConfig()), torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=6,
                       min_new_tokens=6, do_sample=False, pad_token_id=0)
    fused_steps = sum(cache.step_paths.get(name, 0) for name in ("fused", "fused-tc"))
    assert fused_steps == 5 * model.config.num_hidden_layers  # (every decode step of every layer fused)
    assert len(made) == 5  # once a step, not once a layer
    assert cache.kernel_state._step_values == {}  # (dropped when the step ended)
