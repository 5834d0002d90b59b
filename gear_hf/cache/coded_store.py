"""`CodedTokenStore`: the buffer's tokens in a per-token format (`GearConfig.key_buffer` / `value_buffer`).

Same interface as `gear_hf.cache.storage.TokenStore` (the full-precision buffer), [B, H, capacity, ...] fields with
the token
axis at dim 2; what it holds is what the memory report counts.
"""

from __future__ import annotations

import math

import torch

from ..compress import ChunkSpec, CompressedChunk, compress, decompress, side_dtype
from ..compress.terms import chunk_fields
from ..kernels.views import CodedTailView
from .channel_centers import ChannelCenters
from .storage import TokenWrites, _grown


class CodedTokenStore:
    """Tokens [B, H, capacity, d] stored in a per-token format (a `ChunkSpec` whose every field holds one entry per
    token, e.g. values quantized per token, or keys at 8 bits per token with a 16-bit scale and minimum): each token
    is encoded when its step ends (by a kernel of the cache's backends where one has it, `Backend.encode_tokens`: the
    numba one for the 8-bit and rotated 4-bit formats, bit for bit the oracle's; else by the torch oracle), and decoded
    by the oracle when read, or read as stored by a fused kernel that reads it (`kernel_tail`). Same interface as
    `TokenStore`; what it holds is what `nbytes` counts (the buffer of `GearConfig.key_buffer` / `value_buffer`).

    Tokens are encoded when their step ends (`end_step`), and only those that stay: until then they are staged in
    full precision, so the attention of that step sees them as the model made them and a prompt compressed in the
    step it arrived is compressed from them (never encoded to the buffer's format at all).

    centered (`GearConfig.key_buffer_centered` / `value_buffer_centered`): each token is coded centered (scaled: and
    scaled) per channel, by its row's `ChannelCenters` (fitted to the row's first step), and read back through them."""

    def __init__(self, spec: ChunkSpec, centered: bool = False, scaled: bool = True) -> None:
        self.spec = spec
        self.centers = ChannelCenters(scaled) if centered else None
        # gear_hf.backends.BackendPlan (`Stream.bind`): its compress backend may encode the staged tokens with a
        # kernel (`Backend.encode_tokens`, bit for bit the oracle's); None, or a backend that does not: the oracle
        self.plan = None
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's tokens [B,H,cap,d], written [B,cap]
        self._mask_shared = False  # the staged mask is the step's, shared with other stores (`write_run`, `write`)
        self.fields: dict[str, torch.Tensor] = {}
        self.dtype: torch.dtype | None = None  # the model's (what reads return by default)
        self.head_dim = 0

    @staticmethod
    def per_token_fields(spec: ChunkSpec, d: int, side: torch.dtype):
        """The fields of one token (those that store something), or a ValueError when the format is not per
        token."""
        one, two = (chunk_fields(spec, n, d, side) for n in (1, 2))
        kept = []
        for a, b in zip(one, two):
            if a.shape[0] * math.prod(a.shape[1:]) == 0 and b.shape[0] * math.prod(b.shape[1:]) == 0:
                continue
            if a.shape[0] != 1 or b.shape[0] != 2 or a.shape[1:] != b.shape[1:]:
                raise ValueError(f"{spec} does not store each token on its own (field {a.name!r}: {a.shape} for "
                                 f"one token, {b.shape} for two): it cannot hold a buffer")
            kept.append(a)
        return kept

    @property
    def capacity(self) -> int:
        return next(iter(self.fields.values())).shape[2] if self.fields else 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        codes = self.fields["codes"]
        return codes.shape[0], codes.shape[1], codes.shape[2], self.head_dim

    device = property(lambda self: self.fields["codes"].device)

    def reserve(self, like: torch.Tensor, capacity: int) -> None:
        """Room for `capacity` tokens per row (like: a [B,H,*,d] tensor of the model's dtype)."""
        if not self.fields:
            B, H, _, d = like.shape
            self.dtype, self.head_dim = like.dtype, d
            for f in self.per_token_fields(self.spec, d, side_dtype(like.dtype)):
                self.fields[f.name] = torch.zeros(B, H, capacity, *f.shape[1:], dtype=f.dtype, device=like.device)
        elif capacity != self.capacity:
            self.end_step()  # (staged tokens are encoded before the columns change)
            self.fields = {name: _grown(t, capacity) for name, t in self.fields.items()}

    def _backends(self) -> tuple:
        """The plan's backends (`BackendPlan.accelerators`), whose kernels may encode tokens and decode centers."""
        return self.plan.accelerators if self.plan is not None else ()

    def center_affine(self) -> torch.Tensor | None:
        """The centers' float32 (scales, centers) [B,H,2,d] for this step (`ChannelCenters.kernel_affine`, decoded by
        a kernel of the plan where one does), or None: not centered, or no row fitted yet."""
        return self.centers.kernel_affine(self._backends()) if self.centers is not None else None

    def encode(self, x: torch.Tensor) -> CompressedChunk:
        """x [J,H,n,d] (centered already, where the store centers) in this store's format (every token on its own:
        batching changes no bit), by the oracle."""
        return compress(x, self.spec)

    def _stage(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.staged is None:
            B, H, cap, d = self.shape
            self.staged = (like.new_zeros(B, H, cap, d), torch.zeros(B, cap, dtype=torch.bool, device=like.device))
            self._mask_shared = False
        return self.staged

    def write_run(self, x: torch.Tensor, at: int, shared: dict | None = None) -> None:
        """Every row's tokens x [B,H,q,d] to columns [at, at+q), staged until the step ends. shared: the step's memo
        (`StepPlan.shared`), where every layer's stores find the same staged mask [B,cap] (made once a step; read
        only: a store that changes its mask copies it first, `_own_mask`)."""
        q = x.shape[2]
        if self.staged is None:  # (the step's first write: its tokens padded out to the buffer, one op)
            B, _, cap, _ = self.shape
            key = ("staged mask", B, cap, at, q, x.device)
            written = shared.get(key) if shared is not None else None
            if written is None:
                written = torch.zeros(B, cap, dtype=torch.bool, device=x.device)
                written[:, at : at + q] = True
                if shared is not None:
                    shared[key] = written
            self.staged = (torch.constant_pad_nd(x, (0, 0, at, cap - at - q)), written)
            self._mask_shared = shared is not None
            return
        exact, written = self.staged
        exact[:, :, at : at + q] = x
        self._own_mask()[:, at : at + q] = True

    def _own_mask(self) -> torch.Tensor:
        """The staged mask, this store's own (a copy of the step's shared one the first time it is changed)."""
        exact, written = self.staged
        if self._mask_shared:
            written, self._mask_shared = written.clone(), False
            self.staged = (exact, written)
        return written

    def write(self, x: torch.Tensor, where: TokenWrites, shared: dict | None = None) -> None:
        """x[rows[i], :, tokens[i]] to column columns[i] of row rows[i], staged until the step ends. shared: the step's
        memo, where every layer's stores find the same staged mask for the same writes (as `write_run`'s)."""
        if self.staged is None and shared is not None:  # (the step's first write: the mask made once a step)
            B, H, cap, d = self.shape
            key = ("staged mask of writes", id(where), B, cap, x.device)
            if key not in shared:
                written = torch.zeros(B, cap, dtype=torch.bool, device=x.device)
                written[where.rows, where.columns] = True
                shared[key] = (where, written)  # (where kept alive: its id names it for the whole step)
            self.staged, self._mask_shared = (x.new_zeros(B, H, cap, d), shared[key][1]), True
        else:
            self._stage(x)
            self._own_mask()[where.rows, where.columns] = True
        exact = self.staged[0]
        exact[where.rows, :, where.columns] = x[where.rows, :, where.tokens].to(exact.dtype)

    def fit_centers(self) -> None:
        """Fit the centers of the rows whose first step this is, now (before `end_step`, which would): the value chunks
        that leave in this step are coded by them (`GearConfig.value_chunks_centered`)."""
        if self.centers is not None and self.staged is not None:
            self.centers.fit(*self.staged)

    def end_step(self, kept: list[tuple[int, int, int]] | None = None) -> None:
        """The step ended: encode its tokens that stay (kept: (row, start, length), the columns a flushing row keeps;
        the other rows keep all), read coded from now on. Call before the buffer's columns move."""
        if self.staged is None:
            if self.centers is not None:
                self.centers.end_step()
            return
        exact, written = self.staged
        if self.centers is not None:  # (a row's first step fits its centers: every token it wrote, kept or not)
            self.centers.fit(exact, written)
        if kept:
            written = self._own_mask()
        for row, start, length in kept or ():
            written[row, :start] = False
            written[row, start + length :] = False
        # any backend of the plan whose kernel encodes this format (bit for bit the oracle's: which one does not
        # matter; the compress backend may be the torch one for chunk features its kernels lack, e.g. range search)
        affine = self.center_affine()
        if not any(backend.encode_tokens(self.spec, exact, written, self.fields, affine)
                   for backend in self._backends()):
            coded = exact if self.centers is None else self.centers.normalized(exact)
            rows, columns = written.nonzero(as_tuple=True)
            if rows.numel():
                chunk = self.encode(coded[rows, :, columns].unsqueeze(2))  # [N,H,1,d]: one token per entry
                for name, t in self.fields.items():
                    t[rows, :, columns] = getattr(chunk, name)[:, :, 0]
        self.staged = None
        if self.centers is not None:
            self.centers.end_step()

    def kernel_tail(self, affine: bool = True):
        """(this step's staged tokens [B,H,cap,d], or an empty [B,H,0,d] between steps; `views.CodedTailView` of the
        stored fields): the buffer as a fused kernel reads it without decoding it (`Backend.reads_tail`); affine
        False: without the centers (a caller that hands the tokens centered)."""
        codes = self.fields["codes"]
        if self.staged is None:
            exact, staged = codes.new_empty(*codes.shape[:2], 0, self.head_dim, dtype=self.dtype), None
        else:
            exact, staged = self.staged
        affine = self.center_affine() if affine else None
        return exact, CodedTailView(codes=codes, scale=self.fields["scale"], minimum=self.fields["minimum"],
                                    staged=staged, bits=int(self.spec.bits), rotated=bool(self.spec.rotate),
                                    affine=affine, affine_scaled=self.centers is not None and self.centers.scaled)

    def _exact_where_staged(self, decoded: torch.Tensor, rows: list[int] | None, starts: list[int] | None,
                            length: int, centered: bool = False) -> torch.Tensor:
        """decoded [J,H,length,d] (every row from column 0, or rows[j] from starts[j]) with this step's own tokens
        put back exact (centered: minus their centers, as the coded ones read)."""
        if self.staged is None:
            return decoded
        exact, written = self.staged
        if rows is None:
            exact, written = exact[:, :, :length], written[:, :length]
        else:
            exact = torch.stack([exact[row, :, at : at + length] for row, at in zip(rows, starts)])
            written = torch.stack([written[row, at : at + length] for row, at in zip(rows, starts)])
        if centered:
            exact = self.centers.normalized(exact, rows)
        return torch.where(written[:, None, :, None], exact.to(decoded.dtype), decoded)

    def keep_tail(self, row: int, start: int, length: int) -> None:
        self.end_step()
        if start and length:
            for t in self.fields.values():
                t[row, :, :length] = t[row, :, start : start + length].clone()

    def _chunk(self, parts: dict[str, torch.Tensor], n: int) -> CompressedChunk:
        """parts (the stored fields of n tokens, [J,H,n,...]) as a chunk of the spec, with its empty fields."""
        like = parts["codes"]
        fields = {}
        for f in chunk_fields(self.spec, n, self.head_dim, side_dtype(self.dtype)):
            fields[f.name] = parts[f.name] if f.name in parts else \
                torch.zeros(*like.shape[:2], *f.shape, dtype=f.dtype, device=like.device)
        return CompressedChunk(fields)

    def coded(self, rows: list[int], starts: list[int], length: int, fresh: bool = True) -> CompressedChunk:
        """The stored fields of tokens [starts[j], starts[j]+length) of row rows[j]: a chunk [J,H,length,...]
        (this step's own tokens encoded now; fresh=False: left as the fields hold them, for a caller that puts them
        back exact)."""
        parts = {name: torch.stack([t[row, :, at : at + length] for row, at in zip(rows, starts)])
                 for name, t in self.fields.items()}
        if fresh and self.staged is not None:
            exact, written = self.staged
            fresh = torch.stack([written[row, at : at + length] for row, at in zip(rows, starts)])  # [J,length]
            if bool(fresh.any()):
                j, c = fresh.nonzero(as_tuple=True)
                x = torch.stack([exact[row, :, at : at + length] for row, at in zip(rows, starts)])
                if self.centers is not None:
                    x = self.centers.normalized(x, rows)
                chunk = self.encode(x[j, :, c].unsqueeze(2))
                for name, t in parts.items():
                    t[j, :, c] = getattr(chunk, name)[:, :, 0]
        return self._chunk(parts, length)

    def _decode(self, chunk: CompressedChunk, n: int, dtype: torch.dtype, out: torch.Tensor | None = None,
                rows: list[int] | None = None, centered: bool = False):
        """The tokens of chunk (rows' tokens; None: every row's), read back (centered: as coded, without their
        centers added back)."""
        if n == 0:  # (an empty buffer: nothing to decode)
            codes = chunk.codes
            return torch.empty(*codes.shape[:2], 0, self.head_dim, dtype=dtype, device=codes.device)
        if self.centers is not None and not centered:
            return self.centers.restored(decompress(chunk, self.spec, n, self.head_dim, dtype), rows)
        return decompress(chunk, self.spec, n, self.head_dim, dtype, out=out)

    def tokens(self, dtype: torch.dtype | None = None, n: int | None = None,
               out: torch.Tensor | None = None, centered: bool = False) -> torch.Tensor:
        """The first n tokens of every row [B,H,n,d] (centered: minus each row's centers, as a centered store codes
        them)."""
        n = self.capacity if n is None else n
        decoded = self._decode(self._chunk({k: t[:, :, :n] for k, t in self.fields.items()}, n), n,
                               dtype or self.dtype, centered=centered)
        decoded = self._exact_where_staged(decoded, None, None, n, centered)
        return decoded if out is None else out.copy_(decoded)

    def gather(self, rows: list[int], starts: list[int], length: int, dtype: torch.dtype | None,
               centered: bool = False) -> torch.Tensor:
        """Tokens [starts[j], +length) of row rows[j]: [J,H,length,d] (centered: as `tokens`)."""
        decoded = self._decode(self.coded(rows, starts, length, fresh=False), length, dtype or self.dtype, rows=rows,
                               centered=centered)
        return self._exact_where_staged(decoded, rows, starts, length, centered)  # (this step's own tokens: exact)

    def token_nbytes(self, cap: int | None = None) -> int:
        return sum(t.shape[1] * math.prod(t.shape[3:]) * (min(t.element_size(), cap) if cap and
                   t.is_floating_point() else t.element_size()) for t in self.fields.values())

    def row_state_nbytes(self) -> int:
        """Bytes kept per row beside the tokens (its `ChannelCenters`)."""
        return self.centers.nbytes() if self.centers is not None else 0

    def nbytes(self) -> int:
        staged = sum(t.numel() * t.element_size() for t in self.staged) if self.staged is not None else 0
        return staged + sum(t.numel() * t.element_size() for t in self.fields.values()) + self.row_state_nbytes()

    def select_rows(self, index: torch.Tensor) -> None:
        self.end_step()
        self.fields = {name: t.index_select(0, index) for name, t in self.fields.items()}
        if self.centers is not None:
            self.centers.select_rows(index)
