"""What transformers' dense cache owns at each generate step, beside what a GearCache owns.

`run_case` runs the same greedy generate twice through a tiny model (tests/tiny_models.py), under
torch.inference_mode(): with transformers' DynamicCache (every storage its layers keep alive after each step: a sliding
layer's window view keeps its whole torch.cat result, as transformers' does) and with a GearCache (its
`memory_report()` after each step). Used by tests/test_never_above_dense.py and scripts/dev/above_dense.py.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import gear_hf
from tiny_models import CACHE_ARG, tiny_model


def dense_owned(cache) -> int:
    """Bytes of every distinct storage a transformers cache's layers keep."""
    seen = {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class _EachStep(StoppingCriteria):
    def __init__(self, measure):
        self.measure, self.values = measure, []

    def __call__(self, input_ids, scores, **kwargs):
        self.values.append(self.measure())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _report(cache) -> dict:
    """memory_report(), with each row's decode chunks (rows of a padded batch flush on different steps)."""
    return {**cache.memory_report(), "row_chunks": list(cache.layout.counts.chunks)}


def _inputs(batch: int, prompt: int):
    ids = torch.randint(3, 128, (batch, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding: row 1 is 3 tokens shorter (at least 1 token)
        pad = min(3, prompt - 1)
        mask[1, :pad] = 0
        ids[1, :pad] = 0
    return ids, mask


def run_case(config, arch="llama3", dtype=torch.bfloat16, batch=1, prompt=5, new=40, window=None,
             explicit_cache: bool = False):
    """([(step, GearCache owned, DynamicCache owned, report dense_bytes)], the GearCache, its report after each
    step) of one case: a tiny `arch` model (head_dim 32; window: its sliding window), `batch` rows of `prompt`
    tokens (row 1 left-padded by 3), `new` greedy tokens. The GearCache is the one plain generate builds on an enabled
    model (it knows the final length: min_new_tokens), or GearCache(model) passed to generate (explicit_cache)."""
    model = tiny_model(arch, dtype=dtype, head_dim=32, window=window)
    ids, mask = _inputs(batch, prompt)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)
    dense_cache = DynamicCache(config=model.config)
    dense = _EachStep(lambda: dense_owned(dense_cache))
    with torch.inference_mode():
        model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([dense]), **{CACHE_ARG: dense_cache})
    gear_hf.enable(model, config)
    passed = {CACHE_ARG: gear_hf.GearCache(model)} if explicit_cache else {}
    reports = _EachStep(lambda: _report(gear_hf.last_cache(model)))
    with torch.inference_mode():
        model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([reports]), **passed)
    cache = gear_hf.last_cache(model)
    if gear_hf.is_enabled(model):
        gear_hf.disable(model)
    rows = [(i, r["owned_bytes"], d, r["dense_bytes"]) for i, (r, d) in enumerate(zip(reports.values, dense.values))]
    return rows, cache, reports.values
