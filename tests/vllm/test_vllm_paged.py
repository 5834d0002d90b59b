"""The backend's two attention paths on the same steps: the paged numba kernel (pages read in place, open blocks from
their tail slots) against the reference workspace path (pages decoded by the torch oracle, CPU_ATTN over them).
Steps of several requests through the plan the metadata builder makes: a prefill of whole and partial blocks, then
decode steps that close blocks, with a tail slot freed and reused. The workspace path rounds decoded keys and values
to bf16 and attends in bf16: the two agree to that rounding, while a block read from the wrong place differs by O(1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.mark.parametrize("config", ['{}', '{"preset": "gear-2"}', '{"preset": "kivi-4", "pre_rope": false}'])
def test_paged_path_equals_the_workspace_path(monkeypatch, config):
    from vllm import _custom_ops as ops

    from gear_hf.vllm.backend import GearAttentionImpl
    from gear_hf.vllm.plan import StepPlan, TailBook
    from gear_hf.vllm.plugin import CONFIG_ENV
    from gear_hf.vllm.rotary import KeyRotary

    monkeypatch.setenv(CONFIG_ENV, config)
    bs, H, G, d, dtype = 32, 2, 2, 64, torch.bfloat16
    impl = GearAttentionImpl.__new__(GearAttentionImpl)  # (no engine: the attributes its __init__ sets)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = H * G, H, d, d ** -0.5
    impl.alibi_slopes, impl.logits_soft_cap, impl.sinks, impl.sliding_window = None, 0, None, -1
    impl.kv_cache_dtype, impl.max_num_seqs, impl.format, impl.tail_pool = "auto", 3, None, None
    pre_rope = "pre_rope" not in config
    impl.rotary = KeyRotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))) if pre_rope else None
    # CPU_ATTN's portable ISA: AMX tiles need a permission vLLM's worker asks the kernel for at start
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    book = TailBook(impl.max_num_seqs)
    kv_cache = torch.zeros(24, H, 1, 1, dtype=dtype)  # (resized once the page size is known)
    gen = torch.Generator().manual_seed(0)
    # per step: (request id, tokens this step); request 2 finishes after step 1 and request 3 takes its slot
    steps = [[(0, 70), (1, 31), (2, 20)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (3, 40)],
             [(0, 1), (1, 1), (3, 1)]] + [[(0, 1), (1, 1), (3, 1)]] * 26
    lengths, tables, next_block = {}, {}, 0
    for step in steps:
        ids = [r for r, _ in step]
        for r, n in step:
            lengths[r] = lengths.get(r, 0) + n
            table = tables.setdefault(r, [])
            while len(table) * bs < lengths[r]:
                table.append(next_block)
                next_block += 1
        counts = torch.tensor([n for _, n in step])
        starts = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])
        seq_lens = torch.tensor([lengths[r] for r in ids], dtype=torch.int32)
        width = max(len(tables[r]) for r in ids)
        block_table = torch.tensor([tables[r] + [0] * (width - len(tables[r])) for r in ids], dtype=torch.int32)
        T = int(starts[-1])
        plan = StepPlan.build(book, bs, starts, seq_lens, block_table, T)
        query = torch.randn(T, H * G, d, generator=gen).to(dtype)
        key = torch.randn(T, H, d, generator=gen).to(dtype)
        value = torch.randn(T, H, d, generator=gen).to(dtype)
        if impl.format is None:
            impl._setup(kv_cache, dtype, bs)
            assert impl.paged
            kv_cache = torch.zeros(next_block + 64, H, 1, impl.format.page_bytes // 2, dtype=dtype)
        pages = kv_cache[:, :, 0, :].view(torch.uint8)
        close_k, close_v = impl._write(plan, key, value)
        out_paged = torch.zeros(T, H * G * d, dtype=dtype)
        impl._attend_pages(plan, query, pages, close_k, close_v, out_paged)
        def scheduler(lens, query_start, count):
            return ops.cpu_attn_get_scheduler_metadata(
                num_reqs=count, num_heads=H * G, num_kv_heads=H, head_dim=d, seq_lens=lens, dtype=dtype,
                query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=layer.isa,
                enable_kv_split=False)

        metadata = SimpleNamespace(scheduler_metadata=scheduler(seq_lens, starts, len(ids)))
        part = plan.workspace_part(list(range(len(ids))))
        part.scheduler_metadata = metadata.scheduler_metadata
        out_workspace = torch.zeros(T, H * G * d, dtype=dtype)
        impl._attend_workspace(layer, plan, part, query, pages, close_k, close_v, out_workspace)
        # the requests with many query tokens through CPU_ATTN, the others through the kernel (as forward splits)
        many = [i for i, (_, n) in enumerate(step) if n > 16]
        if many:
            part = plan.workspace_part(many)
            part.scheduler_metadata = scheduler(part.seq_lens, part.query_start, len(many))
            out_split = torch.full((T, H * G * d), float("nan"), dtype=dtype)
            impl._attend_pages(plan, query, pages, close_k, close_v, out_split, skip=many)
            impl._attend_workspace(layer, plan, part, query, pages, close_k, close_v, out_split)
            assert (out_split.float() - out_workspace.float()).abs().max() < 0.05
        impl._store(plan, pages, close_k, close_v)
        difference = (out_paged.float() - out_workspace.float()).abs()
        assert difference.max() < 0.05, (step, difference.max())
        assert difference.mean() < 3e-3, (step, difference.mean())
    assert plan.read_blocks.numel() >= 3  # (the last steps read pages of every request)
    assert 0 < impl.tail_pool.keys.shape[0] <= impl.max_num_seqs


def test_tail_pool_grows_with_the_requests_running():
    from gear_hf.vllm.backend import TailPool

    pool = TailPool(6, 8, 2, 4, torch.bfloat16)
    assert pool.nbytes == 0 and pool.slot_bytes() == 2 * 8 * 2 * 4 * 2
    pool.reserve(1)
    assert pool.keys.shape[0] == TailPool.GROWTH
    pool.keys[2] = 1.5
    pool.reserve(3)
    assert pool.keys.shape[0] == TailPool.GROWTH  # (enough already)
    pool.reserve(5)
    assert pool.keys.shape[0] == 6 and pool.values.shape[0] == 6  # (at most the limit)
    assert (pool.keys[2] == 1.5).all() and (pool.keys[4:] == 0).all()
    assert pool.nbytes == 6 * pool.slot_bytes()
