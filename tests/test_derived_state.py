"""Derived state a store owns (`ChunkStore.derived`) equals what would be derived afresh from its fields, at every
read: the Triton backend's key-outlier ordering, kept per chunk and extended only by the chunks written since the
last read, through prompt chunks of padded rows, decode flushes at different steps per row, a sliding layer
and dropping its leading chunks (a replaced spec: tests/test_kernels_decode.py)."""

from __future__ import annotations

import pytest
import torch

import gear_hf
from tiny_models import greedy, prompts, tiny_model


def _checking_view_derived(monkeypatch) -> dict:
    from gear_hf.backends import triton_backend
    from gear_hf.kernels.views import prepare_derived

    original = triton_backend.TritonBackend.view_derived
    reads = {"checked": 0}

    def checking(self, store, view, chunks_used, stream):
        kept = original(self, store, view, chunks_used, stream)
        if kept:
            fresh = prepare_derived(view, chunks_used)
            assert kept.keys() == fresh.keys()
            for name, t in fresh.items():  # kept: the whole capacity (the kernel reads the chunks in use)
                assert kept[name].is_contiguous(), name
                used = kept[name][:, :, :chunks_used] if name == "key_outlier_tile" else \
                    kept[name][:, :, : t.shape[-1]]
                assert torch.equal(used, t), (name, chunks_used, store.capacity)
            reads["checked"] += 1
        return kept

    monkeypatch.setattr(triton_backend.TritonBackend, "view_derived", checking)
    return reads


def test_triton_kept_outlier_order_equals_a_fresh_one(monkeypatch):
    """gemma3_text: a sliding layer (window 16, GQA) beside a full one; three rows padded 0/5/10 tokens."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        device = "cuda"
    else:
        from gear_hf.kernels import interpreting

        if not interpreting():
            pytest.skip("no CUDA and TRITON_INTERPRET is not set")
        device = "cpu"
    reads = _checking_view_derived(monkeypatch)
    model = tiny_model("gemma3_text", head_dim=32).to(device)
    # outlier_ratio 1/8: two key outliers per channel in every 16-token chunk (2% would keep none)
    config = gear_hf.GearConfig.preset("gear", bits=4, group_size=16, buffer_size=16, outlier_ratio=0.125,
                                       backend="triton")
    ids, mask = prompts(3, length=21)
    with gear_hf.enabled(model, config), torch.inference_mode():
        greedy(model, ids.to(device), mask.to(device), 30)
    assert reads["checked"] > 0

