"""Which blocks one step reads and writes, and where each request's open block lives: computed once per step by
the metadata builder (on the CPU, from the block table and sequence lengths), used by every layer.

A block j of a request with L tokens after this step and S = L - (this step's tokens) before it is
  closed before the step   (j+1)*bs <= S      read from its page (compressed)
  written this step        j*bs < L and (j+1)*bs > S: staged; its earlier tokens come from its tail
                           (when j*bs < S), closes this step when (j+1)*bs <= L (-> page), else stays open
                           (-> its tail)
Prefix caching: a full block found in the cache is read from its page. When a whole prompt hits the cache, vLLM
recomputes its last token; that block is already closed (its page holds the token, compressed): it is read as a
page and this step's copy of the token is not stored again (a shared page is never rewritten).
vLLM tells a backend nothing about freed blocks, so tail slots are keyed by block id and recycled least recently
used: every running request writes its open block every step, so the stalest slot belongs to a request that has
finished or was preempted. A tail that is needed and missing or stale raises instead of reading wrong keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class TailBook:
    """block id -> (tail slot, tokens held) for the open blocks; `slots` slots, recycled least recently used.
    With sink_tokens S > 0 also block id -> sink slot for the closed first blocks of requests: their first S tokens
    kept exact (the page's copies are not attended), a slot from the block's closing until the block is written
    again (a freed block's slot stays until then: at most one per block)."""

    def __init__(self, slots: int, sink_tokens: int = 0) -> None:
        self.slots = slots
        self.of_block: dict[int, tuple[int, int]] = {}
        self.owner: list[int | None] = [None] * slots
        self.last_used = [-1] * slots
        self.step = 0
        self.closed: set[int] = set()  # blocks whose page this backend wrote and nothing has rewritten since
        self.sink_tokens = sink_tokens
        self.sinks: dict[int, int] = {}  # block id -> sink slot
        self.free_sinks: list[int] = []
        self.sink_slots = 0  # slots handed out so far (the sink pools hold at least as many)

    def assign_sink(self, block: int) -> int:
        if block not in self.sinks:
            self.sinks[block] = self.free_sinks.pop(0) if self.free_sinks else self.sink_slots
            self.sink_slots = max(self.sink_slots, self.sinks[block] + 1)
        return self.sinks[block]

    def release_sink(self, block: int) -> None:
        slot = self.sinks.pop(block, None)
        if slot is not None:
            self.free_sinks.append(slot)
            self.free_sinks.sort()

    def held(self, block: int) -> tuple[int, int] | None:
        return self.of_block.get(block)

    def keep(self, block: int, count: int, busy: set[int]) -> int:
        """The slot that will hold `count` tokens of `block` after this step (its own, or a recycled one)."""
        entry = self.of_block.get(block)
        if entry is not None:
            slot = entry[0]
        else:
            free = [s for s in range(self.slots) if self.owner[s] is None]
            if free:
                slot = free[0]
            else:
                candidates = [s for s in range(self.slots) if s not in busy]
                if not candidates:
                    raise RuntimeError(f"GEAR tail pool exhausted: {self.slots} slots (max_num_seqs), all in use "
                                       "this step")
                slot = min(candidates, key=lambda s: self.last_used[s])
                del self.of_block[self.owner[slot]]
            self.owner[slot] = block
        self.of_block[block] = (slot, count)
        self.last_used[slot] = self.step
        busy.add(slot)
        return slot

    def release(self, block: int) -> None:
        entry = self.of_block.pop(block, None)
        if entry is not None:
            self.owner[entry[0]] = None


@dataclass
class WorkspacePart:
    """Requests whose attention runs through CPU_ATTN over a workspace of their blocks (closed pages decoded,
    written blocks exact), renumbered from 0 for them alone (`StepPlan.workspace_part`)."""
    requests: list[int]  # of the step's requests
    query_rows: torch.Tensor  # [T''] their query rows (of query[:num_actual_tokens]), in order
    query_start: torch.Tensor  # [R'+1] int32, into query_rows
    seq_lens: torch.Tensor  # [R'] int32
    table: torch.Tensor  # [R', max blocks] int32: each request's blocks as workspace indices
    blocks: int  # workspace blocks
    read: torch.Tensor  # [P'] indices into the step's read_* (pages to decode)
    read_ws: torch.Tensor  # [P'] their workspace indices
    stage: torch.Tensor  # [Q'] indices into the step's stage_* (blocks written this step)
    stage_ws: torch.Tensor  # [Q']
    scheduler_metadata: object = None  # CPU_ATTN's, for these requests (set by the metadata builder)


@dataclass
class StepPlan:
    block_size: int
    workspace_blocks: int
    workspace_table: torch.Tensor  # [R, max blocks] int32: each request's blocks as workspace indices
    page_table: np.ndarray  # [R, max blocks] int64 (the paged kernel's table): a page id, or for a block written
    #                         this step -1 - its source: its tail slot (open after the step), or slots + its index
    #                         among the closing blocks
    first_closing: int  # the page table's first source past the tail slots (the first closing block)
    tail_slots: int  # tail slots this step touches: 1 + the highest (the pool holds at least as many)
    sink_tokens: int  # S: the first S tokens of a request are read exact from its sink slot once block 0 is a page
    sink_slots: int  # sink slots handed out so far (the sink pools hold at least as many)
    sink_slot: np.ndarray  # [R] int64: request r's sink slot when its block 0 is read from a page, else -1
    query_start: np.ndarray  # [R+1] int64: request r's tokens are rows query_start[r] .. query_start[r+1]-1
    seq_lens: np.ndarray  # [R] int64: tokens of request r after this step
    read_blocks: torch.Tensor  # [P] page ids of closed blocks read this step
    read_ws: torch.Tensor  # [P] their workspace indices
    read_first_position: torch.Tensor  # [P] position of their first token
    read_sink: torch.Tensor  # [P] sink slot of those that are a request's block 0 with sinks, else -1
    stage_blocks: torch.Tensor  # [Q] page ids of the blocks written this step
    stage_ws: torch.Tensor  # [Q]
    stage_first_position: torch.Tensor  # [Q]
    stage_tail: torch.Tensor  # [Q] tail slot holding their earlier tokens, -1: none
    stage_closes: torch.Tensor  # [Q] bool: full after this step -> compressed into the page
    stage_keep: torch.Tensor  # [Q] tail slot to keep them in after this step, -1: closes
    stage_close_index: torch.Tensor  # [Q] their index among the closing blocks, -1: stays open
    stage_sink: torch.Tensor  # [Q] sink slot to store their first S tokens in (a block 0 closing), else -1
    token_rows: torch.Tensor  # [T'] rows of this step's tokens (of key[:num_actual_tokens])
    token_stage: torch.Tensor  # [T'] their staged block
    token_offset: torch.Tensor  # [T'] their offset in it
    # the same, by where the tokens go before the attention (GearAttentionImpl._write):
    close_loads: tuple[torch.Tensor, torch.Tensor]  # closing blocks with earlier tokens: (close index, tail slot)
    close_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens of closing blocks: (row, close index,
    #                                                                offset)
    tail_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens of blocks open after it: (row, slot, offset)

    def workspace_part(self, requests: list[int]) -> WorkspacePart:
        """The workspace of `requests` alone (every request: the whole step's, `workspace_table`'s numbering)."""
        widths = [-(-int(self.seq_lens[r]) // self.block_size) for r in requests]
        used = sorted({int(w) for r, width in zip(requests, widths) for w in self.workspace_table[r, :width]})
        renumber = torch.full((self.workspace_blocks,), -1, dtype=torch.long)
        renumber[used] = torch.arange(len(used))
        table = torch.zeros(len(requests), self.workspace_table.shape[1], dtype=torch.int32)
        for i, (r, width) in enumerate(zip(requests, widths)):
            table[i, :width] = renumber[self.workspace_table[r, :width].long()].int()
        read = torch.nonzero(renumber[self.read_ws] >= 0).flatten()
        stage = torch.nonzero(renumber[self.stage_ws] >= 0).flatten()
        rows = [torch.arange(int(self.query_start[r]), int(self.query_start[r + 1])) for r in requests]
        counts = np.diff(self.query_start)[requests]
        return WorkspacePart(requests=list(requests), query_rows=torch.cat(rows) if rows else torch.zeros(0).long(),
                             query_start=torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32),
                             seq_lens=torch.tensor(self.seq_lens[requests], dtype=torch.int32), table=table,
                             blocks=len(used), read=read, read_ws=renumber[self.read_ws[read]], stage=stage,
                             stage_ws=renumber[self.stage_ws[stage]])

    @classmethod
    def build(cls, tails: TailBook, bs: int, query_start: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, num_tokens: int) -> "StepPlan":
        tails.step += 1
        busy: set[int] = set()
        ws_of: dict[int, int] = {}
        read, stage = [], []  # (block, ws, first position[, tail, closes, keep])
        token_rows, token_stage, token_offset = [], [], []
        starts, lens = query_start.tolist(), seq_lens.tolist()
        table = block_table.tolist()
        ws_table = torch.zeros(len(lens), max(1, max((-(-L // bs) for L in lens), default=1)), dtype=torch.int32)
        page_table = np.zeros(tuple(ws_table.shape), dtype=np.int64)
        for r, L in enumerate(lens):
            q = starts[r + 1] - starts[r]
            before = L - q
            for j in range(-(-L // bs)):
                block = table[r][j]
                if (j + 1) * bs <= before:  # closed: its page (may be shared with other requests)
                    if block not in ws_of:
                        ws_of[block] = len(ws_of)
                        read.append((block, ws_of[block], j * bs))
                    ws_table[r, j] = ws_of[block]
                    page_table[r, j] = block
                    continue
                if block in ws_of:
                    raise RuntimeError(f"GEAR: block {block} is written by two requests in one step")
                entry = tails.held(block)
                if j * bs < before and entry is None and block in tails.closed and (j + 1) * bs <= L:
                    ws_of[block] = len(ws_of)  # a cached full block whose last token is recomputed: its page
                    read.append((block, ws_of[block], j * bs))
                    ws_table[r, j] = ws_of[block]
                    page_table[r, j] = block
                    continue
                tails.closed.discard(block)
                tails.release_sink(block)  # (written again: what its old page's sinks were is gone)
                ws_of[block] = len(ws_of)
                ws_table[r, j] = ws_of[block]
                tail = -1
                if j * bs < before:  # its earlier tokens are in its tail
                    if entry is None or entry[1] != before - j * bs:
                        raise RuntimeError(f"GEAR: the open block {block} of request {r} should hold "
                                           f"{before - j * bs} tokens in its tail, found "
                                           f"{'none' if entry is None else entry[1]} (tail recycled while the "
                                           "request was not scheduled? raise max_num_seqs)")
                    tail = entry[0]
                    busy.add(tail)
                closes = (j + 1) * bs <= L
                stage.append([block, ws_of[block], j * bs, tail, closes, -1, r, j])
                lo, hi = max(before, j * bs), min(L, (j + 1) * bs)
                token_rows.extend(range(starts[r] + lo - before, starts[r] + hi - before))
                token_stage.extend([len(stage) - 1] * (hi - lo))
                token_offset.extend(range(lo - j * bs, hi - j * bs))
        for entry in stage:  # tails after the step (after reading: a released slot may be reused this step)
            block, closes = entry[0], entry[4]
            if closes:
                tails.release(block)
                tails.closed.add(block)
        stage_sink = [tails.assign_sink(e[0]) if e[4] and e[2] == 0 and tails.sink_tokens else -1 for e in stage]
        for r, L in enumerate(lens):
            if L % bs:
                block = table[r][L // bs]
                entry = next(e for e in stage if e[0] == block)
                entry[5] = tails.keep(block, L % bs, busy)
        closing = 0
        for entry in stage:
            if entry[4]:
                entry.append(closing)
                page_table[entry[6], entry[7]] = -1 - (tails.slots + closing)
                closing += 1
            else:
                entry.append(-1)
                page_table[entry[6], entry[7]] = -1 - entry[5]
        if token_rows and max(token_rows) >= num_tokens:
            raise RuntimeError(f"GEAR: plan addresses token {max(token_rows)} of {num_tokens}")

        def column(rows, i, dtype=torch.long):
            return torch.tensor([e[i] for e in rows], dtype=dtype)

        def longs(values):
            return torch.tensor(values, dtype=torch.long)

        loads = [(e[8], e[3]) for e in stage if e[4] and e[3] >= 0]
        closing_tokens = [(row, stage[q][8], o) for row, q, o in zip(token_rows, token_stage, token_offset)
                          if stage[q][4]]
        tail_tokens = [(row, stage[q][5], o) for row, q, o in zip(token_rows, token_stage, token_offset)
                       if not stage[q][4]]

        used = [e[3] for e in stage] + [e[5] for e in stage]
        sink_slot = np.asarray([tails.sinks.get(int(page_table[r, 0]), -1) if page_table[r, 0] >= 0 else -1
                                for r in range(len(lens))], dtype=np.int64)
        read_sink = [tails.sinks.get(e[0], -1) if e[2] == 0 else -1 for e in read]
        return cls(block_size=bs, workspace_blocks=len(ws_of), workspace_table=ws_table, page_table=page_table,
                   first_closing=tails.slots, tail_slots=max(used, default=-1) + 1, sink_tokens=tails.sink_tokens,
                   sink_slots=tails.sink_slots, sink_slot=sink_slot, read_sink=longs(read_sink),
                   stage_sink=longs(stage_sink),
                   query_start=np.asarray(starts, dtype=np.int64), seq_lens=np.asarray(lens, dtype=np.int64),
                   read_blocks=column(read, 0), read_ws=column(read, 1), read_first_position=column(read, 2),
                   stage_blocks=column(stage, 0), stage_ws=column(stage, 1), stage_first_position=column(stage, 2),
                   stage_tail=column(stage, 3), stage_closes=column(stage, 4, torch.bool),
                   stage_keep=column(stage, 5), stage_close_index=column(stage, 8), token_rows=longs(token_rows),
                   token_stage=longs(token_stage), token_offset=longs(token_offset),
                   close_loads=tuple(longs(c) for c in zip(*loads)) if loads else (longs([]),) * 2,
                   close_tokens=tuple(longs(c) for c in zip(*closing_tokens)) if closing_tokens else (longs([]),) * 3,
                   tail_tokens=tuple(longs(c) for c in zip(*tail_tokens)) if tail_tokens else (longs([]),) * 3)
