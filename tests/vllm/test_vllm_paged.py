"""The backends' attention paths on the same steps: the CPU backend's paged numba kernel (pages read in place, open
blocks from their tail slots) against its reference workspace path (pages decoded by the torch oracle, CPU_ATTN over
them), and the GPU backend (its Triton kernel under the interpreter) against the CPU backend.
Steps of several requests through the plan the metadata builder makes: a prefill of whole and partial blocks, then
decode steps that close blocks, with a tail slot freed and reused. The workspace path rounds decoded keys and values
to bf16 and attends in bf16: the two agree to that rounding, while a block read from the wrong place differs by O(1)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

# per step: (request id, tokens this step); request 2 finishes after step 1 and request 3 takes its slot
STEPS = [[(0, 70), (1, 31), (2, 20)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (3, 40)],
         [(0, 1), (1, 1), (3, 1)]] + [[(0, 1), (1, 1), (3, 1)]] * 26


def _steps(bs, H, G, d, dtype, book):
    """(plan, query, key, value) of each step of STEPS, the plan as the metadata builder makes it (book: its
    TailBook)."""
    from gear_hf.vllm.plan import StepPlan

    gen = torch.Generator().manual_seed(0)
    lengths, tables, next_block = {}, {}, 0
    for step in STEPS:
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
        yield (plan, torch.randn(T, H * G, d, generator=gen).to(dtype), torch.randn(T, H, d, generator=gen).to(dtype),
               torch.randn(T, H, d, generator=gen).to(dtype))


def _book(bs, max_num_seqs):
    from gear_hf.vllm.blocks import sink_tokens
    from gear_hf.vllm.plan import TailBook

    return TailBook(max_num_seqs, sink_tokens(bs))


def _impl(cls, H, G, d, max_num_seqs, pre_rope):
    """A backend impl without an engine: the attributes its __init__ sets."""
    from gear_hf.vllm.rotary import KeyRotary

    impl = cls.__new__(cls)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = H * G, H, d, d ** -0.5
    impl.alibi_slopes, impl.logits_soft_cap, impl.sinks, impl.sliding_window = None, 0, None, -1
    impl.kv_cache_dtype, impl.max_num_seqs, impl.format, impl.tail_pool = "auto", max_num_seqs, None, None
    impl.rotary = KeyRotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))) if pre_rope else None
    return impl


BLOCKS = 24 + 64  # pages in the caches (the steps use 22)


@pytest.mark.parametrize("config", ['{}', '{"preset": "gear-2"}', '{"preset": "kivi-4", "pre_rope": false}'])
def test_paged_path_equals_the_workspace_path(monkeypatch, config):
    from vllm import _custom_ops as ops

    from gear_hf.vllm.backend import GearAttentionImpl
    from gear_hf.vllm.plugin import CONFIG_ENV

    monkeypatch.setenv(CONFIG_ENV, config)
    bs, H, G, d, dtype = 32, 2, 2, 64, torch.bfloat16
    impl = _impl(GearAttentionImpl, H, G, d, 3, "pre_rope" not in config)
    # CPU_ATTN's portable ISA: AMX tiles need a permission vLLM's worker asks the kernel for at start
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    kv_cache = None
    book = _book(bs, impl.max_num_seqs)
    for step, (plan, query, key, value) in enumerate(_steps(bs, H, G, d, dtype, book)):
        T = query.shape[0]
        if impl.format is None:
            impl._setup(torch.zeros(1, H, 1, 1, dtype=dtype), dtype, bs)
            assert impl.paged
            kv_cache = torch.zeros(BLOCKS, H, 1, impl.format.page_bytes // 2, dtype=dtype)
        pages = kv_cache[:, :, 0, :].view(torch.uint8)
        if step == 0:
            first_k, first_v = key[:4].clone(), value[:4].clone()  # (request 0's first tokens: block 0)
        close_k, close_v = impl._write(plan, key, value)
        out_paged = torch.zeros(T, H * G * d, dtype=dtype)
        impl._attend_pages(plan, query, pages, close_k, close_v, out_paged)

        def scheduler(lens, query_start, count):
            return ops.cpu_attn_get_scheduler_metadata(
                num_reqs=count, num_heads=H * G, num_kv_heads=H, head_dim=d, seq_lens=lens, dtype=dtype,
                query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=layer.isa,
                enable_kv_split=False)

        part = plan.workspace_part(list(range(len(plan.seq_lens))))
        part.scheduler_metadata = scheduler(part.seq_lens, part.query_start, len(plan.seq_lens))
        out_workspace = torch.zeros(T, H * G * d, dtype=dtype)
        impl._attend_workspace(layer, plan, part, query, pages, close_k, close_v, out_workspace)
        # the requests with many query tokens through CPU_ATTN, the others through the kernel (as forward splits)
        many = [r for r, n in enumerate(np.diff(plan.query_start)) if n > 16]
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
    if config == "{}":  # GearConfig(): 4 sinks; request 0's block 0 (block id 0) closed at step 0
        S, slot = book.sink_tokens, book.sinks[0]
        assert S == 4 and plan.sink_slot[0] == slot and plan.sink_slots == len(book.sinks) == 3
        assert torch.equal(impl.sink_pool.keys[slot], first_k) and torch.equal(impl.sink_pool.values[slot], first_v)
        k_page, v_page = impl.format.decode(pages[:1])  # the page holds copies of token S where the sinks were
        assert torch.equal(k_page[0, :, :S], k_page[0, :, S:S + 1].expand(-1, S, -1))
        assert torch.equal(v_page[0, :, :S], v_page[0, :, S:S + 1].expand(-1, S, -1))


@pytest.mark.parametrize("config", ['{}', '{"preset": "gear-2"}', '{"preset": "fp16"}'])
def test_triton_backend_equals_the_cpu_backend(monkeypatch, config):
    """The GPU backend's forward (its Triton kernel under the interpreter, float32 so both kernels' arithmetic is
    exact to rounding) against the CPU backend on the same steps: the paged numba kernel for compressed pages,
    CPU_ATTN for the fp16 format. Both write their own pages and tails from the same plans."""
    from vllm import _custom_ops as ops

    from gear_hf.vllm.backend import GearAttentionImpl
    from gear_hf.vllm.blocks import page_format
    from gear_hf.vllm.plugin import CONFIG_ENV
    from gear_hf.vllm.triton_backend import GearTritonImpl, GearTritonMetadata

    monkeypatch.setenv(CONFIG_ENV, config)
    bs, H, G, d, dtype = 32, 2, 2, 64, torch.float32
    raw = "fp16" in config
    cpu = _impl(GearAttentionImpl, H, G, d, 3, not raw)
    gpu = _impl(GearTritonImpl, H, G, d, 3, not raw)
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    caches = None
    for step, (plan, query, key, value) in enumerate(_steps(bs, H, G, d, dtype, _book(bs, cpu.max_num_seqs))):
        T = query.shape[0]
        if caches is None:
            page_bytes = page_format(bs, d, dtype).page_bytes
            caches = [torch.zeros(BLOCKS, H, 1, page_bytes // 4, dtype=dtype) for _ in range(2)]
        out_gpu = torch.full((T, H * G * d), float("nan"), dtype=dtype)
        meta = GearTritonMetadata.of(plan, T, query.device)
        gpu.forward(layer, query, key, value, caches[1], meta, out_gpu)
        if cpu.format is None:
            cpu._setup(caches[0], dtype, bs)
            assert cpu.paged != raw
        pages = caches[0][:, :, 0, :].view(torch.uint8)
        close_k, close_v = cpu._write(plan, key, value)
        out_cpu = torch.zeros(T, H * G * d, dtype=dtype)
        if raw:
            part = plan.workspace_part(list(range(len(plan.seq_lens))))
            part.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(plan.seq_lens), num_heads=H * G, num_kv_heads=H, head_dim=d, seq_lens=part.seq_lens,
                dtype=dtype, query_start_loc=part.query_start, causal=True, sliding_window_size=-1, isa=layer.isa,
                enable_kv_split=False)
            cpu._attend_workspace(layer, plan, part, query, pages, close_k, close_v, out_cpu)
        else:
            cpu._attend_pages(plan, query, pages, close_k, close_v, out_cpu)
        cpu._store(plan, pages, close_k, close_v)
        assert torch.equal(*(c.view(torch.int32) for c in caches)), step  # (the same pages written)
        difference = (out_gpu - out_cpu).abs().max()
        assert difference < 1e-4, (step, difference)
    assert plan.read_blocks.numel() >= 3


def test_tail_pool_grows_with_the_requests_running():
    from gear_hf.vllm.blocks import TailPool

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


def test_plugin_registers_the_triton_backend_as_custom(monkeypatch):
    """With GEAR_HF_VLLM=1, `--attention-backend CUSTOM` names the Triton backend, and vLLM's GPU selection
    (`validate_configuration`, what CudaPlatform asks of a selected backend) accepts it for a Llama-3-8B layer on
    an sm_90 GPU; ALiBi and the like are refused when an impl is made, by name."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from gear_hf.vllm import plugin
    from gear_hf.vllm.triton_backend import GearTritonBackend, GearTritonImpl

    monkeypatch.setattr("vllm.v1.attention.backends.registry._ATTN_OVERRIDES", dict(_ATTN_OVERRIDES))
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is GearTritonBackend
    selector = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    assert GearTritonBackend.validate_configuration(**selector._asdict(),
                                                    device_capability=DeviceCapability(9, 0)) == []
    for wrong in (dict(head_size=80), dict(kv_cache_dtype="fp8"), dict(has_sliding_window=True),
                  dict(block_size=24)):
        assert GearTritonBackend.validate_configuration(**selector._replace(**wrong)._asdict(),
                                                        device_capability=DeviceCapability(9, 0))
    with pytest.raises(NotImplementedError, match="ALiBi"):
        GearTritonImpl(32, 128, 128 ** -0.5, 8, alibi_slopes=[1.0] * 32)
