"""`memory_report()` against an independent walk of every tensor the cache and the kernels keep for it.

What the report counts (gear_hf/cache/memory.py): the layout's stored position tables (none while they follow from
the pads), each stream's sink, buffer, allocated key widths and chunk-store fields (held + spare), a dense window's
tensors, the stores' and the cache's kernel state, and the workspaces kept from one step to the next (the rotary memo
`cache._rotary`, a layer's query energy: both dropped when a step ends) —
`owned_bytes`. The walk, run after a generate through a real attention forward, must find no more than that: the
per-step memos (the layout's kernel inputs and slot plan, the step workspace) are dropped when a step ends.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch

import gear_hf
from memory_walk import _entries_for, kernel_memos, walk, walk_cache
from tiny_models import CACHE_ARG, tiny_model

PROMPT, NEW = 300, 20  # GearConfig(): a 256-token prompt group + a 44-token buffer; 20 decode steps, no flush

# Paths of per-step memos (dropped when a step ends, so nothing should be found under them between steps).
UNREPORTED = ("cache.layout._kernel_memo", "cache.layout._slot_memo", "gear_hf.")


@dataclasses.dataclass
class _Slotted:
    __slots__ = ("a", "b")
    a: object
    b: object


def test_walk_counts_each_storage_once_and_follows_containers():
    base = torch.zeros(1000)  # 4000 B
    other = torch.zeros(10, dtype=torch.int16)  # 20 B
    owned_array = np.zeros(50, dtype=np.float32)  # 200 B, numpy's own
    gone = torch.zeros(500)  # reachable only through a weak reference: not kept alive by the object
    module = torch.nn.Linear(4, 4)
    obj = {"views": [base[:10], base[500:], base.view(10, 100)], "same": base,
           (base[:1], "key"): _Slotted(other, base.numpy()[3:]),  # a tensor in a key; a numpy view of a tensor
           "array": owned_array[::2], "weak": weakref.ref(gone), "model": module, "empty": torch.zeros(0)}
    result = walk({"obj": obj})
    assert result.total == 4000 + 20 + 200
    assert sorted(b.nbytes for b in result.blocks) == [20, 200, 4000]
    assert result.skipped_modules == ["obj['model']"]
    assert walk({"a": base, "b": base[1:]}).by_root() == {"a": 4000}  # the first root claims a shared storage


def test_walk_sees_quanto_style_inner_tensors():
    class Wrapped(torch.Tensor):  # a tensor subclass storing its data in inner tensors (as quanto's do)
        @staticmethod
        def __new__(cls, data, scale):
            t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32)
            t._data, t._scale = data, scale
            return t

        def __tensor_flatten__(self):
            return ["_data", "_scale"], None

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(f"{func} on a test wrapper")

    w = Wrapped(torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.float16))
    assert walk({"w": [w]}).total == 8 + 4


def test_memo_entries_anchored_on_another_cache_are_not_counted():
    mine, theirs = torch.zeros(100), torch.zeros(100)
    storages = {(str(mine.device), mine.untyped_storage().data_ptr())}
    memo = {1: (weakref.ref(mine), {"copy": np.zeros(10)}), 2: (weakref.ref(theirs), {"copy": np.zeros(1000)})}
    assert list(_entries_for(memo, storages)) == [1]
    shared = [(mine, np.zeros(3))]  # not anchored (the last step's tables): kept whole
    assert _entries_for(shared, storages) is shared


CONFIGS = {"default": gear_hf.GearConfig(),
           # keys flushing every 64 tokens, values a chunk later (held at the value buffer's front): one flush
           "held": gear_hf.GearConfig(buffer_size=64, key_group_size=64, value_buffer_size=128,
                                      value_statistics="8")}


@pytest.fixture(scope="module", params=list(CONFIGS))
def generated(request):
    """(cache, model) after a config generated NEW tokens after a PROMPT-token prompt, one cache alive."""
    gc.collect()  # other tests' caches: their memo entries die with their tensors
    model = tiny_model("llama3", dtype=torch.bfloat16, head_dim=32)  # head_dim 32: the fused CPU decode kernel
    gear_hf.enable(model, CONFIGS[request.param])
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    cache = gear_hf.GearCache(model, expected_length=PROMPT + NEW)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                   do_sample=False, pad_token_id=0, **{CACHE_ARG: cache})
    gear_hf.disable(model)
    yield cache, model
    del cache
    gc.collect()


def _gap(cache, with_memos: bool, model=None) -> str:
    report = cache.memory_report()
    result = walk_cache(cache, memos=with_memos, model=model)
    missing = [(p, n) for p, n in result.largest(len(result.blocks)) if p.startswith(UNREPORTED)]
    return (f"report owned {report['owned_bytes']} B (held {report['held_bytes']} + spare "
            f"{report['spare_bytes']}) vs walk {result.total} B; not in the report: {missing}")


def test_walk_finds_at_least_what_the_report_counts(generated):
    cache, _ = generated
    report = cache.memory_report()
    stores = walk({"layers": cache.layers, "tables": cache.layout.tables, "kernel_state": cache.kernel_state,
                   "rotary": cache._rotary})
    assert stores.total == report["owned_bytes"], _gap(cache, False)  # what the report names: counted exactly
    assert report["held_bytes"] <= report["owned_bytes"] <= walk_cache(cache, memos=False).total
    assert not walk_cache(cache).skipped_modules, "the cache or a memo keeps a reference to a model"
    model_storages = walk({"model": list(generated[1].parameters()) + list(generated[1].buffers())})
    assert not {b.start for b in walk_cache(cache, memos=False).blocks} & {b.start for b in model_storages.blocks}, \
        "the cache object itself references a model tensor"


def test_nothing_else_is_missing_from_the_report(generated):
    """The report leaves nothing out: the walk of the cache and the kernels' state finds no more than it counts."""
    cache, model = generated
    assert walk_cache(cache, model=model).total <= cache.memory_report()["owned_bytes"], _gap(cache, True, model)


def test_report_counts_everything_the_cache_object_keeps(generated):
    cache, _ = generated
    assert cache.memory_report()["owned_bytes"] >= walk_cache(cache, memos=False).total, _gap(cache, False)


def test_no_kernel_module_keeps_a_memo(generated):
    """Derived kernel state is the store's and the cache's: no module-level memo of MEMO_NAMES exists."""
    pytest.importorskip("numba")
    cache, _ = generated
    assert cache.step_paths.get("fused", 0) > 0, "the CPU decode kernel did not run"
    assert kernel_memos() == {}


def test_report_counts_the_kernel_state_kept_for_the_cache(generated):
    pytest.importorskip("numba")
    cache, model = generated
    assert cache.memory_report()["owned_bytes"] >= walk_cache(cache, model=model).total, _gap(cache, True, model)


@pytest.mark.gpu
def test_walk_sees_what_the_cuda_allocator_kept():
    """On CUDA: the bytes the caching allocator still has after generate (cache alive) are the storages the walk
    finds, up to its 512-byte rounding of each block (a warm-up generate pays the one-time allocations)."""
    model = tiny_model("llama3", dtype=torch.bfloat16, head_dim=32).cuda()
    gear_hf.enable(model, gear_hf.GearConfig())
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)

    def run():
        cache = gear_hf.GearCache(model, expected_length=PROMPT + NEW)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, **{CACHE_ARG: cache})
        return cache, out

    run()
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache, out = run()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    result = walk_cache(cache, model=model)
    out_bytes = -(-out.numel() * out.element_size() // 512) * 512
    slack = 512 * len(result.blocks)
    assert result.total - slack <= kept - out_bytes <= result.total + slack, (kept, out_bytes, result.total)
    gear_hf.disable(model)


def test_no_rotary_table_is_kept_from_one_step_to_the_next(generated):
    """cos/sin for the read positions grow with T: the reference path's and the CPU kernel's are computed once per
    step and dropped when it ends (they were kept, twice, ~8% of held on SmolLM2 at T=1k)."""
    cache, _ = generated
    report = cache.memory_report()
    assert cache._rotary.nbytes() == 0 and not cache.kernel_state._rope
    assert report["kernel_state_bytes"] + report["workspace_bytes"] <= 0.10 * report["held_bytes"], report
