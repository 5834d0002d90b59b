"""`HeldChunkPlans`: a stream's held chunk (`StreamFormat.held_chunk`), the layout's plans in the stream's own columns.

A stream with a held chunk keeps each row's newest decode chunk at its buffer's front, in the buffer's format, until
`release_after` newer tokens are buffered after it (`GearConfig.held_for`; n_b: until the row's next chunk flushes),
then compresses it from its buffered codes. While a row holds one its decode chunks lag the layout's by one
(`holding`, per row, set at each flush; `own` gives the counts as the stream stores them). A crop takes back only
buffered tokens and leaves a released row released until its next chunk flushes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .layout import FlushPlan, RowCounts, SlotPlan, StepPlan, buffer_capacities
from .storage import TokenWrites


class HeldChunkPlans:
    """Mixed into `Stream` (which sets held_chunk, chunk_len, release_after, holding and buffer)."""

    held_chunk: bool
    chunk_len: int
    release_after: int
    holding: list[bool]
    _own_memo: list | None = None  # [(counts, the rows' holding, `own` of them)], the newest first

    def own(self, counts: RowCounts, holding: list[bool] | None = None) -> RowCounts:
        """The rows' counts as this stream stores them: each row that holds a chunk (`holding`, default: this
        stream's rows now) has its newest decode chunk as the first nb tokens of its buffer."""
        if not self.held_chunk:
            return counts
        holding = self.holding if holding is None else holding
        # (a step asks for the same few counts again and again: the last answers, their counts kept alive)
        memo = self._own_memo = self._own_memo or []
        for known, known_holding, own in memo:
            if known is counts and known_holding == holding:
                return own
        front = self._front(holding, len(counts.chunks))
        own = RowCounts(counts.sink, counts.prompt, tuple(c - (h > 0) for c, h in zip(counts.chunks, front)),
                        tuple(f + h for f, h in zip(counts.buffer, front)))
        memo[:] = [(counts, list(holding), own), *memo[:3]]
        return own

    def _front(self, holding: list[bool] | None = None, rows: int | None = None) -> list[int]:
        """Per row, the buffer columns before its buffered tokens: its held chunk, if it holds one."""
        holding = self.holding if holding is None else holding
        rows = len(holding) if rows is None else rows
        return [self.chunk_len if self.held_chunk and row < len(holding) and holding[row] else 0
                for row in range(rows)]

    def _holding_after(self, plan: StepPlan) -> list[bool]:
        """Which rows hold a chunk after this step's flush: a row whose newest chunk flushes now holds it unless
        release_after tokens are buffered after it; a row that held one keeps it until that many are. Worked out
        once per step (append, `compresses` and the flush of every layer ask for it: `_per_step`)."""
        return self._per_step(plan, "holding after", (), lambda: self._work_out_holding(plan))

    def _per_step(self, plan: StepPlan, name: str, extra: tuple, work_out):
        """work_out() for this stream's held-chunk state, memoized on the step's plan (`StepPlan.shared`): every
        layer's streams hold the same rows in the same step, so all but the first find it there. The key is all it
        depends on: the stream's chunk length, release point and rows holding, and `extra`."""
        key = (name, self.chunk_len, self.release_after, tuple(self.holding), extra)
        shared = plan.shared
        if key not in shared:
            shared[key] = work_out()
        return shared[key]

    def _work_out_holding(self, plan: StepPlan) -> list[bool]:
        after, flushing = plan.after, {row for row, _, _ in plan.flush.decode_jobs}
        now = self._front(rows=len(after.chunks))
        # (release_after = n_b: held until the next chunk flushes, however many tokens a speculative step buffers)
        early = self.release_after < self.chunk_len
        return [(row in flushing or bool(now[row])) and not (early and f >= self.release_after)
                for row, f in enumerate(after.buffer)]

    def _capacities(self, plan: StepPlan, holding_after: list[bool]) -> tuple[int, int]:
        """(during the step, after its flush): the layout's, or this stream's own with a held chunk."""
        if not self.held_chunk:
            return plan.buffer_capacity, plan.buffer_capacity_after
        current = self.buffer.capacity
        return self._per_step(plan, "capacities", (current, tuple(holding_after)), lambda: buffer_capacities(
            current, max(self.own(plan.attend).buffer, default=0),
            max(self.own(plan.after, holding_after).buffer, default=0)))

    def _shifted_writes(self, plan: StepPlan, front: list[int], x: torch.Tensor) -> TokenWrites:
        """The step's buffer writes with each row's columns moved past its held chunk (worked out once a step for
        every layer holding the same rows: `StepPlan.shared`)."""
        key = ("shifted writes", tuple(front), x.shape[0], x.shape[2], x.device)
        if key not in plan.shared:
            plan.shared[key] = self._work_out_shifted_writes(plan, front, x)
        return plan.shared[key]

    @staticmethod
    def _work_out_shifted_writes(plan: StepPlan, front: list[int], x: torch.Tensor) -> TokenWrites:
        where = plan.buffer_writes
        if where is None:  # (a run: every row to the same columns)
            B, q = x.shape[0], x.shape[2]
            rows = torch.arange(B, device=x.device).repeat_interleave(q)
            tokens = torch.arange(q, device=x.device).repeat(B)
            where = TokenWrites(rows, tokens, tokens + plan.buffer_run)
        shift = torch.tensor(front, dtype=torch.long, device=where.rows.device)
        return TokenWrites(where.rows, where.tokens, where.columns + shift[where.rows])

    def _own_flush(self, plan: StepPlan) -> tuple[FlushPlan, list[bool]]:
        """(the layout's flush in this stream's buffer columns, which rows hold a chunk after it). With a held chunk
        a row's decode chunks leave late: its held chunk (columns [0, nb)) and every new chunk but the last are
        compressed, and the last one stays at the buffer's front, with what the keys keep after it; a held chunk
        with release_after tokens buffered after it leaves too (with or without a new chunk)."""
        if not self.held_chunk:
            return plan.flush, self.holding
        return self._per_step(plan, "own flush", (), lambda: self._work_out_own_flush(plan))

    def _work_out_own_flush(self, plan: StepPlan) -> tuple[FlushPlan, list[bool]]:
        flush, nb, after = plan.flush, self.chunk_len, plan.after
        front = self._front(rows=len(after.chunks))
        holding = self._holding_after(plan)
        new = {}
        for row, start, chunk in flush.decode_jobs:
            new.setdefault(row, []).append((start, chunk))
        jobs, keep = [], []
        for row, start, length in flush.keep:
            h = front[row]
            chunks = new.get(row, [])
            if not chunks:
                if h and not holding[row]:
                    raise AssertionError(f"row {row} flushes a prompt chunk while it holds a decode chunk")
                keep.append((row, start + h, length))
                continue
            first_start, first_chunk = chunks[0]
            if h:  # the held chunk (the row's previous newest) leaves now
                chunks = [(first_start - nb, first_chunk - 1)] + chunks
            if start != chunks[-1][0] + nb:
                raise AssertionError(f"row {row} keeps buffer columns from {start}, not after its last chunk")
            if holding[row]:  # the newest chunk stays, at the buffer's front
                *chunks, (last_start, _) = chunks
                keep.append((row, last_start + h, nb + length))
            else:
                keep.append((row, start + h, length))
            jobs += [(row, at + h, chunk) for at, chunk in chunks]
        flushing = {row for row, _, _ in flush.keep}
        for row, (h, c, f) in enumerate(zip(front, after.chunks, after.buffer)):
            if h and not holding[row] and row not in flushing:  # released: release_after tokens buffered after it
                jobs.append((row, 0, c - 1))
                keep.append((row, nb, f))
        if any(front[row] for rows, _ in flush.prompt_groups for row in rows):
            raise AssertionError("a prompt chunk flushed from a row that holds a decode chunk")
        return FlushPlan(flush.prompt_groups, jobs, keep), holding

    def _own_slots(self, slots: SlotPlan) -> SlotPlan:
        """The slot layout in this stream's segments: with a held chunk, each row's newest decode chunk is read
        from the front of its buffer, which starts a chunk earlier."""
        if not self.held_chunk:
            return slots
        front = self._front(rows=len(slots.buffer_at))
        if not any(front):
            return slots
        chunks = max(at // self.chunk_len - (h > 0) for at, h in zip(slots.buffer_at, front))
        return replace(slots, chunks=chunks,
                       buffer_at=tuple(at - h for at, h in zip(slots.buffer_at, front)),
                       buffer=tuple(n + h for n, h in zip(slots.buffer, front)))
