"""`RowLayout`: the one place that knows where each row's tokens are.

Each row keeps only its real tokens, in arrival order ("row-local" order), in four segments shared by every
layer and by keys and values:

    [ sink (full precision) | prompt chunk (rank_prefill) | decode chunks of n_b (rank_decode) | buffer ]

so padding never enters a statistic and a row's compressed cache is the same alone or inside a batch. A step
appends its tokens to the buffer, attends, then flushes what the buffer no longer holds into chunks: the
attention always sees the step's own tokens exactly, and the flush is planned here once for every layer.

HF hands the cache a padded [B, T] layout (what the attention mask describes); `rect_to_local` maps its
columns to row-local indices and `positions` gives each row-local token its position. The per-row counts are
kept on the host (planning needs them; reading the step's new mask columns is the step's only device sync)
and mirrored as an int32 [B, 4] tensor for the kernels.

While every row is one run of columns after its left padding and every token's position is its row-local index
(what `generate` does), both tables follow from the host's pads: nothing is stored (8 bytes a token that the dense
cache does not own) and a step builds them when it reads them (`positions`, `rect_to_local`,
dropped when it ends). The first step that breaks this (a mask with holes, other positions) stores them (`tables`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..config import GearConfig
from .position_tables import POSITION_GRANULE, compact_tables, grown_tables
from .storage import TokenWrites, grown_capacity


@dataclass(frozen=True)
class RowCounts:
    """Tokens of each row in each segment (host lists of length B)."""

    sink: tuple[int, ...] = ()
    prompt: tuple[int, ...] = ()
    chunks: tuple[int, ...] = ()  # decode chunks of n_b tokens
    buffer: tuple[int, ...] = ()

    def held(self, chunk_len: int) -> list[int]:
        return [s + p + c * chunk_len + f for s, p, c, f in zip(self.sink, self.prompt, self.chunks, self.buffer)]

    def rows(self) -> list[tuple[int, int, int, int]]:
        return list(zip(self.sink, self.prompt, self.chunks, self.buffer))


@dataclass
class FlushPlan:
    """What leaves the buffer after this step's attention, for every layer alike.

    prompt_groups: (rows, length) — rows whose prompt chunk has that many tokens (one compress call each:
    equal lengths batch bit-identically); decode_jobs: (row, buffer offset, chunk slot) of every n_b-token chunk;
    keep: (row, buffer offset, length) of what each flushing row keeps buffered."""

    prompt_groups: list[tuple[list[int], int]] = field(default_factory=list)
    decode_jobs: list[tuple[int, int, int]] = field(default_factory=list)
    keep: list[tuple[int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompt_groups or self.decode_jobs)


@dataclass
class StepPlan:
    step: int
    query_len: int
    rect_before: int  # columns of the padded layout before this step
    attend: RowCounts  # what this step's attention sees: the buffer holds the step's own tokens
    after: RowCounts  # what the rows hold after the step's flush
    valid: torch.Tensor  # [B, q] bool: the step's real tokens (padding is stored nowhere)
    sink_writes: TokenWrites | None  # where real tokens go in the sink store (None: no row writes to it)
    buffer_writes: TokenWrites | None  # where real tokens go in the buffer (None: nowhere, or `buffer_run`)
    buffer_run: int | None  # every row writes its q tokens to buffer columns [buffer_run, +q) (a plain copy), else None
    sink_capacity: int  # tokens the sink store holds (the most any row has: never more than sink_tokens)
    buffer_capacity: int  # tokens the buffer holds during the step
    buffer_capacity_after: int  # after the flush (what was compressed is given back)
    flush: FlushPlan
    decode_reserve: int  # decode chunks the rows will reach (known: from `expected_length`), else what they hold
    shared: dict = field(default_factory=dict, repr=False, compare=False)  # memo: what all layers work out alike


@dataclass(frozen=True)
class SlotPlan:
    """Where a decode step's attention finds each row's tokens when rows differ ("slot layout"): the stored
    segments of every row side by side at the same columns, then each row's decode chunks and buffer as one run,

        [ sink: sink | prompt: prompt | tail: the row's decode chunks, then its buffer right after them ]

    so each store reconstructs for the whole batch in one call, straight into place (decode chunks: `chunks` of
    them for every row), and each row's buffer is copied in after its own chunks (`buffer_at`): the width does not
    grow with how many more chunks one row flushed than another. A row's unused slots are holes that the remapped
    attention mask hides. local: [B, T_slot] long, the row-local token in each slot (-1: a hole); columns:
    [B, T_slot] long, its column in HF's padded layout (-1: a hole)."""

    sink: int
    prompt: int
    chunks: int  # decode chunks reconstructed for every row (the most any row holds; each chunk_len tokens)
    tail: int  # width of the decode chunks + buffer run: the longest row's
    buffer_at: tuple[int, ...]  # per row: where its buffer starts in the tail (its decode chunks' tokens)
    buffer: tuple[int, ...]  # per row: its buffered tokens
    local: torch.Tensor
    columns: torch.Tensor


def buffer_capacities(current: int, needed: int, kept: int) -> tuple[int, int]:
    """(during a step, after its flush) of a buffer holding `current` tokens per row that needs `needed` during the
    step and keeps `kept` (see `RowLayout._buffer_capacities`)."""
    during = grown_capacity(current, needed, geometric=False)
    return during, (during if kept == needed else max(kept, 1))  # (never empty: kernels take its pointer)


class RowLayout:
    """Per-row bookkeeping of a GearCache, shared by all layers; plans each step once."""

    def __init__(self, config: GearConfig, expected_length: int | None = None, speculative: bool = False) -> None:
        self.config = config
        self.expected_length = expected_length
        # speculative: a decode step's own tokens stay in the buffer until the next step, so that `crop` can take
        # back what verification rejected (only tokens of earlier steps are compressed; the first step keeps up to
        # a buffer's worth of its newest tokens: the prompt's last ones, or drafts)
        self.speculative = speculative
        self.batch = 0
        self.steps = 0
        self.rect_length = 0  # columns of HF's padded layout seen so far
        self.counts = RowCounts()  # after the last step's flush
        self.prompt_capacity = 0  # token length of the prompt chunk store (max over rows)
        self.buffer_capacity = 0  # tokens every layer's buffer holds between steps
        self.pads: list[int] = []  # padding columns before each row's first token
        self.contiguous: list[bool] = []  # every column after the row's first token is one of its tokens
        # (positions [B, cap+1] int32 in row-local order (+ a scratch column), rect_to_local [B, cap] int32, -1 =
        # padding), stored once the positions do not follow from the pads; else None (`positions`)
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.device: torch.device | None = None
        self._step_tables: tuple | None = None  # ((steps, rect, held), tables) built for the current step
        self._in_step = False
        self.plan: StepPlan | None = None
        self._kernel_memo: tuple | None = None  # (key, kernel_inputs) of the current step
        self._slot_memo: tuple | None = None  # (step, SlotPlan) of the current step

    # -- planning ----------------------------------------------------------------------------------------------
    @property
    def chunk_len(self) -> int:
        return self.config.buffer_size

    @property
    def prompt_multiple(self) -> int:
        """The prompt chunk holds whole prompt groups along tokens and whole code bytes; the rest goes to decode
        chunks (whole ones) and the buffer."""
        return self.config.prompt_granule

    def plan_step(self, batch: int, query_len: int, new_valid: torch.Tensor | None,
                  position_ids: torch.Tensor | None, device: torch.device) -> StepPlan:
        """Plan a step of `query_len` new columns. new_valid: [B, q] bool (None: every token is real)."""
        cfg = self.config
        first = self.steps == 0
        if first:
            self.batch = batch
            zeros = (0,) * batch
            self.counts = RowCounts(zeros, zeros, zeros, zeros)
            self.pads, self.contiguous = [0] * batch, [True] * batch
        elif batch != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {batch} in one GearCache")
        B, q = batch, query_len
        rect_before = self.rect_length
        self.device = device
        before = self.counts
        held_before = before.held(self.chunk_len)
        given = position_ids is not None
        if position_ids is None:
            position_ids = torch.arange(rect_before, rect_before + q, device=device)[None]
        position_ids = position_ids.to(device).expand(B, q)
        if new_valid is None:
            new_valid = torch.ones(B, q, dtype=torch.bool, device=device)
            local = torch.tensor(held_before, device=device)[:, None] + torch.arange(q, device=device)
            valid_rows = [[True] * q for _ in range(B)]
            # without a mask, positions not given are the columns (the row-local indices): no sync for them
            indexed = [not given or bool((position_ids == local).all())] * B
        else:
            new_valid = new_valid.to(device=device, dtype=torch.bool)
            local = torch.tensor(held_before, device=device)[:, None] + new_valid.long().cumsum(1) - 1
            indexed = ((position_ids == local) | ~new_valid).all(1, keepdim=True)  # [B,1]
            rows = torch.cat([new_valid, indexed], 1).tolist()  # the step's one host sync (none without a mask)
            valid_rows, indexed = [row[:q] for row in rows], [row[q] for row in rows]
        self._record_columns(held_before, new_valid, valid_rows, position_ids, rect_before, device, local,
                             all(indexed))

        sink_cols = [[-1] * q for _ in range(B)]
        buffer_cols = [[-1] * q for _ in range(B)]
        sink, attend_buffer = list(before.sink), list(before.buffer)
        own = [0] * B  # the step's tokens each row appends to its buffer
        for i in range(B):
            cols = [j for j in range(q) if valid_rows[i][j]]
            room = max(cfg.sink_tokens - sink[i], 0)
            for r, j in enumerate(cols[:room]):
                sink_cols[i][j] = sink[i] + r
            sink[i] += len(cols[:room])
            for r, j in enumerate(cols[room:]):
                buffer_cols[i][j] = attend_buffer[i] + r
            attend_buffer[i] += len(cols[room:])
            own[i] = len(cols[room:])
        attend = replace(before, sink=tuple(sink), buffer=tuple(attend_buffer))
        held_back = None
        if self.speculative:  # the first step holds the prompt and the first drafted tokens, which cannot be told
            # apart here: up to a buffer's worth of its newest tokens stay uncompressed, for `crop` to take back
            held_back = [min(n, self.chunk_len) for n in own] if first else own
        flush, after = self._plan_flush(attend, first, held_back)

        buffer_capacity, self.buffer_capacity = self._buffer_capacities(attend, after)
        run = list(range(buffer_cols[0][0], buffer_cols[0][0] + q)) if buffer_cols[0][0] >= 0 else None
        run = run[0] if run is not None and all(cols == run for cols in buffer_cols) else None
        if self.expected_length:  # every row reaches it: room for its chunks at once
            base = min(s + p for s, p in zip(after.sink, after.prompt))
            known = math.floor(max(self.expected_length - base, 0) / self.chunk_len)
        else:
            known = 0
        plan = StepPlan(
            step=self.steps, query_len=q, rect_before=rect_before, attend=attend, after=after, valid=new_valid,
            sink_writes=TokenWrites.of(sink_cols, device),
            buffer_writes=None if run is not None else TokenWrites.of(buffer_cols, device), buffer_run=run,
            sink_capacity=max(sink, default=0), buffer_capacity=buffer_capacity,
            buffer_capacity_after=self.buffer_capacity, flush=flush,
            decode_reserve=max(known, max(after.chunks, default=0)),
        )
        if first and cfg.compresses:
            self.prompt_capacity = max(after.prompt, default=0)
        self.counts = after
        self.rect_length = rect_before + q
        self.steps += 1
        self.plan = plan
        self._in_step = True
        return plan

    def _buffer_capacities(self, attend: RowCounts, after: RowCounts) -> tuple[int, int]:
        """(during the step, after its flush): the buffer holds exactly what the rows need, as transformers' dense
        cache does, and gives back what it compressed. Growing by one token a step copies at most a buffer's worth
        (n_b tokens) per layer-step; spare capacity here would cost up to 16 bits per spare token for the whole run.
        A cache that compresses nothing (fp16) grows as transformers' DynamicCache does (its torch.cat),
        never sized ahead to a known final length: it would own more than the dense cache until then."""
        return buffer_capacities(self.buffer_capacity, max(attend.buffer, default=0), max(after.buffer, default=0))

    def _plan_flush(self, attend: RowCounts, first: bool, held_back: list[int] | None = None
                    ) -> tuple[FlushPlan, RowCounts]:
        """held_back: per row, the newest tokens that stay buffered whatever the buffer holds (speculative)."""
        cfg, nb = self.config, self.chunk_len
        flush = FlushPlan()
        if not cfg.compresses:
            return flush, attend
        prompt, chunks, buffer = list(attend.prompt), list(attend.chunks), list(attend.buffer)
        by_length: dict[int, list[int]] = {}
        for i, total in enumerate(attend.buffer):
            held = held_back[i] if held_back else 0
            to_prompt = (total - held) // self.prompt_multiple * self.prompt_multiple if first else 0
            decode = (total - to_prompt - held) // nb
            if not (to_prompt or decode):
                continue
            if to_prompt:
                by_length.setdefault(to_prompt, []).append(i)
            start = to_prompt
            for c in range(decode):
                flush.decode_jobs.append((i, start, chunks[i] + c))
                start += nb
            flush.keep.append((i, start, total - start))
            prompt[i] += to_prompt
            chunks[i] += decode
            buffer[i] = total - start
        # longest first: the first call fills a whole prompt chunk, so the store sizes itself from its result
        flush.prompt_groups = [(rows, length) for length, rows in sorted(by_length.items(), reverse=True)]
        return flush, replace(attend, prompt=tuple(prompt), chunks=tuple(chunks), buffer=tuple(buffer))

    def _record_columns(self, held_before, new_valid, valid_rows, position_ids, rect_before, device, local,
                        indexed: bool) -> None:
        """rect_to_local and positions for the step's columns (stored only once they do not follow from the pads);
        pads/contiguity on the host. local [B,q]: row-local index of each new token; indexed: every new token's
        position is its row-local index."""
        B, q = new_valid.shape
        for i, row in enumerate(valid_rows):
            seen = held_before[i]
            for ok in row:
                if not ok and seen == 0:
                    self.pads[i] += 1
                elif not ok:
                    self.contiguous[i] = False
                seen += ok
        if self.tables is None and indexed and all(self.contiguous):
            return  # the tables follow from the pads (`positions`)
        held_after = [h + sum(v) for h, v in zip(held_before, valid_rows)]
        if self.tables is None:  # from now on stored: what the compact layout described so far, then this step
            known = self.expected_length or 0  # (sized as stored tables grow: to a known final length, in steps)
            capacity = tuple(grown_capacity(0, max(n, known), POSITION_GRANULE)
                             for n in (max(held_after, default=0), rect_before + q))
            self.tables = compact_tables(self.pads, max(held_before, default=0), rect_before, device, capacity)
        self.tables = grown_tables(self.tables, max(held_after, default=0), rect_before + q)
        positions, rect_to_local = self.tables
        rect_to_local[:, rect_before : rect_before + q] = torch.where(new_valid, local, -1).int()
        scratch = positions.shape[1] - 1
        positions.scatter_(1, torch.where(new_valid, local, scratch), position_ids.int())

    @property
    def positions(self) -> torch.Tensor | None:
        """[B, cap+1] int32: each row-local token's position (+ a scratch column); built for the step when the
        layout is compact (not kept: see the module docstring)."""
        tables = self._tables()
        return None if tables is None else tables[0]

    @property
    def rect_to_local(self) -> torch.Tensor | None:
        """[B, cap] int32: the row-local index of each padded column (-1: padding); as `positions`."""
        tables = self._tables()
        return None if tables is None else tables[1]

    def _tables(self):
        if self.tables is not None or self.device is None:
            return self.tables
        held = max(self.counts.held(self.chunk_len), default=0)
        key = (self.steps, self.rect_length, held)
        if self._step_tables is not None and self._step_tables[0] == key:
            return self._step_tables[1]
        tables = compact_tables(self.pads, held, self.rect_length, self.device)
        if self._in_step:  # during a step: kept until it ends (`end_step`)
            self._step_tables = (key, tables)
        return tables

    # -- reading -----------------------------------------------------------------------------------------------
    def uniform(self, counts: RowCounts) -> bool:
        """Every row holds the same segments with no padding: the padded layout is the row-local one."""
        return len(set(counts.rows())) == 1 and not any(self.pads) and all(self.contiguous)

    def tokens_before(self, column: int) -> list[int]:
        """Per row, how many of its tokens lie in padded columns < `column` (rows with holes: 0, which only
        makes a sliding layer keep more)."""
        return [max(0, column - pad) if ok else 0 for pad, ok in zip(self.pads, self.contiguous)]

    def read_positions(self, start: int) -> torch.Tensor:
        """[B, T-start] long: positions of the padded columns start.. (padding columns read token 0)."""
        local = self.rect_to_local[:, start : self.rect_length].long().clamp(min=0)
        return self.positions.long().gather(1, local)

    def slot_plan(self, counts: RowCounts, prompt_width: int) -> SlotPlan:
        """The slot layout of this step's attention (see `SlotPlan`), for layers that released nothing; computed
        once per step. prompt_width: tokens of the prompt chunk store (0: none)."""
        if self._slot_memo is not None and self._slot_memo[0] == self.steps:
            return self._slot_memo[1]
        nb, device = self.chunk_len, self.positions.device
        rows = counts.rows()
        sink, prompt = max(counts.sink, default=0), prompt_width if any(counts.prompt) else 0
        tail = max((c * nb + f for _, _, c, f in rows), default=0)
        per_row = torch.tensor([(s, p, c * nb + f) for s, p, c, f in rows], device=device)  # [B, 3]
        first = torch.cumsum(per_row, 1) - per_row  # row-local index of each segment's first token
        parts = []
        for i, width in enumerate((sink, prompt, tail)):
            if width:
                j = torch.arange(width, device=device)[None]
                parts.append(torch.where(j < per_row[:, i : i + 1], first[:, i : i + 1] + j, -1))
        local = torch.cat(parts, 1)  # [B, T_slot]
        # the padded column of each row-local token: rect_to_local inverted
        held = max(counts.held(nb), default=0)
        rect = self.rect_to_local[:, : self.rect_length].long()
        column_of_local = torch.full((self.batch, held + 1), -1, dtype=torch.long, device=device)
        column_of_local.scatter_(1, torch.where(rect >= 0, rect, held),
                                 torch.arange(self.rect_length, device=device).expand_as(rect))
        columns = torch.where(local >= 0, column_of_local.gather(1, local.clamp(min=0)), -1)
        plan = SlotPlan(sink, prompt, max(counts.chunks, default=0), tail, tuple(c * nb for c in counts.chunks),
                        counts.buffer, local=local, columns=columns)
        self._slot_memo = (self.steps, plan)
        return plan

    def slot_positions(self, slots: SlotPlan) -> torch.Tensor:
        """[B, T_slot] long: the position of each slot's token (holes read token 0's)."""
        return self.positions.long().gather(1, slots.local.clamp(min=0))

    def query_limits(self, query_len: int) -> torch.Tensor:
        """[B, q] int32: row-local index of each of the step's query tokens (-1: padding)."""
        return self.rect_to_local[:, self.rect_length - query_len : self.rect_length].contiguous()

    def kernel_inputs(self, counts: RowCounts, released, query_len: int, device) -> dict:
        """What the fused kernel reads for one layer: rows [B,4] int32 (sink, prompt, chunks, buffer), their host
        copy, limits [B,q] int32 and positions [B,cap] int32 on `device`. For a sliding layer that released its
        prompt chunk or leading decode chunks, the row-local indices skip what was released (the kernel sees
        [sink | live chunks | buffer]); no device sync either way."""
        nb = self.chunk_len
        offset = [(p if released.prompt else 0) + released.chunks * nb for p in counts.prompt]
        rows = [(s, 0 if released.prompt else p, c - released.chunks, f) for s, p, c, f in counts.rows()]
        key = (self.steps, query_len, rows, str(device))
        if self._kernel_memo is not None and self._kernel_memo[0] == key:
            return self._kernel_memo[1]
        limits = self.query_limits(query_len).to(device)
        positions = self.positions.to(device)
        if any(offset):
            shift = torch.tensor(offset, device=device, dtype=torch.int32)[:, None]
            sink = torch.tensor(counts.sink, device=device)[:, None]
            j = torch.arange(positions.shape[1], device=device)[None]
            index = torch.where(j < sink, j, (j + shift).clamp(max=positions.shape[1] - 1))
            positions = positions.gather(1, index)
            limits = torch.where(limits >= 0, limits - shift, limits)
        inputs = {"rows": torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True), "row_lengths": rows,
                  "limits": limits.contiguous(), "positions": positions.contiguous()}
        self._kernel_memo = (key, inputs)
        return inputs

    def end_step(self) -> None:
        """Drop the step's temporaries (nothing per-step is kept between steps)."""
        self._kernel_memo = self._slot_memo = self._step_tables = None
        if self.plan is not None:
            self.plan.sink_writes = self.plan.buffer_writes = self.plan.valid = None
            self.plan.shared.clear()
        self._in_step = False

    # -- crop (speculative decoding) ---------------------------------------------------------------------------
    def crop(self, remove: int) -> None:
        """Take back the last `remove` columns of the padded layout (between steps): each row's tokens among them
        must still be in its buffer (the newest tokens), or in its sink when the row has nothing compressed (a
        prompt shorter than sink_tokens, drafts in the sink), else nothing changes and a ValueError says which row."""
        if not 0 < remove <= self.rect_length:
            raise ValueError(f"cannot crop {remove} of the {self.rect_length} tokens a GearCache holds")
        start = self.rect_length - remove
        taken = (self.rect_to_local[:, start : self.rect_length] >= 0).sum(1).tolist()  # per row
        c = self.counts
        for row, (n, buffered) in enumerate(zip(taken, c.buffer)):
            if not (c.prompt[row] or c.chunks[row]):  # every token of the row uncompressed: the sink's too
                buffered += c.sink[row]
            if n > buffered:
                how = ("build it with GearCache(..., speculative=True), as generate does with assistant_model= or "
                       "prompt_lookup_num_tokens=, so that a step's own tokens stay buffered until the next step"
                       if not self.speculative else "only the last step's own tokens (and older ones still "
                       "buffered) can be taken back")
                raise ValueError(f"GearCache cannot crop {remove} tokens: row {row} would lose {n} tokens but holds "
                                 f"only its newest {buffered} uncompressed (the rest are in compressed chunks, "
                                 f"which cannot be taken back); {how}")
        from_buffer = [min(n, b) for n, b in zip(taken, c.buffer)]  # (the newest first; then the sink's)
        self.counts = replace(c, sink=tuple(s - n + b for s, n, b in zip(c.sink, taken, from_buffer)),
                              buffer=tuple(b - n for b, n in zip(c.buffer, from_buffer)))
        if self.tables is not None:
            self.tables[1][:, start : self.rect_length] = -1
        self.rect_length = start
        self._kernel_memo = self._slot_memo = self._step_tables = None

    # -- rows selection (beams) --------------------------------------------------------------------------------
    def select_rows(self, rows: list[int], index: torch.Tensor) -> None:
        pick = lambda values: tuple(values[r] for r in rows)  # noqa: E731
        c = self.counts
        self.counts = RowCounts(pick(c.sink), pick(c.prompt), pick(c.chunks), pick(c.buffer))
        self.pads, self.contiguous = list(pick(self.pads)), list(pick(self.contiguous))
        if self.tables is not None:
            self.tables = tuple(t.index_select(0, index) for t in self.tables)
        self.batch = len(rows)
        self._kernel_memo = self._slot_memo = self._step_tables = None
