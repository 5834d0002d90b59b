"""Bits/element a GearCache holds and owns at every step of one `generate` (scripts/bench_memory_peak.py --steps).

`StepMemory` is a logits processor: generate calls it after every forward, when the step's layers have all stored,
attended and compressed. It then reads the cache's own `memory_report()` (held by tokens; held + reserved) and
walks it with an independent walk (`walk(cache, memos)`: the cache object alone, and with the kernels'
module-level memos). It also hooks the cache's per-step workspace so that, once per step, just before the
workspace is dropped (after the last layer attended), the walk runs again: what the cache owns inside a step.
"""

from __future__ import annotations


class StepMemory:
    def __init__(self, model, walk, cache=None) -> None:
        """walk(cache, memos: bool) -> object with .total (bytes), e.g. tests/memory_walk.walk_cache. cache: the
        GearCache that generate will be given (hooked now, so the prompt step's in-step walk is seen too); None:
        the enabled model's `gear_hf.last_cache`, hooked at the first call (after the prompt step)."""
        self.model = model
        self.walk = walk
        self.rows: list[dict] = []
        self._hooked = None
        self._in_step: int | None = None
        if cache is not None:
            self._hook(cache)

    def _hook(self, cache) -> None:
        """Walk the cache inside each step, before its workspace is cleared (when the cache has one)."""
        workspace = getattr(cache, "_workspace", None)
        if workspace is None or not hasattr(workspace, "clear"):
            return
        clear = workspace.clear

        def walked_then_clear():
            self._in_step = max(self._in_step or 0, self.walk(cache, True).total)
            clear()

        workspace.clear = walked_then_clear
        self._hooked = cache

    def release(self) -> None:
        """Drop the reference to the cache (its storage and memo entries must not outlive its generate)."""
        self._hooked = None

    def __call__(self, input_ids, scores):
        import gear_hf

        cache = self._hooked or gear_hf.last_cache(self.model)
        if cache is None:
            raise RuntimeError("StepMemory: the model is not enabled with gear_hf (no GearCache to read)")
        if cache is not self._hooked:
            self._hook(cache)  # (the first step ran before the hook: its in-step walk is missing)
        report = cache.memory_report()
        elements = report["elements"]
        per = 8 / elements if elements else 0.0
        alone = self.walk(cache, False).total
        owned = self.walk(cache, True).total
        self.rows.append({
            "step": len(self.rows), "tokens": report["tokens"], "elements": elements,
            "held_bits": report["held_bytes"] * per,
            "buffer_bits": report["buffer"] * per,
            "report_total_bits": report["owned_bytes"] * per,  # held + reserved (spare capacity)
            "walk_cache_bits": alone * per,  # every storage reachable from the cache object
            "owned_bits": owned * per,  # ... and the kernels' module-level memos
            "in_step_owned_bits": self._in_step * per if self._in_step is not None else None,
            "spare_bits": (report["owned_bytes"] - report["held_bytes"]) * per,
            "unreported_cache_bits": (alone - report["owned_bytes"]) * per,  # in the cache, not in the report
            "memo_bits": (owned - alone) * per,
            "held_bytes": report["held_bytes"], "report_owned_bytes": report["owned_bytes"],
            "walk_cache_bytes": alone, "owned_bytes": owned,
        })
        self._in_step = None
        return scores
