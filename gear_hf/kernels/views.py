"""The seam between a GEAR cache and the fused decode kernel: plain tensors, no cache objects, no triton.

The cache builds these views (cheap: references to its storage tensors) and hands them to
`gear_hf.kernels.decode.decode_attention`; the kernel never sees a cache object.

* `ChunkRunView`: one run of compressed chunks of one stream (the prompt chunk, or the decode chunks one after
  the other), exactly the `ChunkStore.fields` tensors, [B, H, capacity*extent, ...], plus optional derived data
  (`prepare_derived`) that the cache computes once per flush and passes back on every step.
* `StreamView`: where one stream's (keys' or values') tokens live, in row-local order
  [ sink | prompt chunk | decode chunks | buffer ].
* `DecodeLayout`: per-row lengths and positions as device tensors, and host-side upper bounds (no sync).

`prepare_derived` is pure torch; its cost is documented there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

# Key outliers sorted by token are indexed per 16-token tile (the smallest kernel block); see prepare_derived.
OUTLIER_TILE = 16
# Low-rank factors enter the fused kernel padded to one 16-wide tl.dot operand: ranks up to this are read.
MAX_FUSED_RANK = 16


@dataclass(frozen=True, eq=False)
class ChunkRunView:
    """Compressed chunks of `chunk_len` tokens, chunk c of row b at slots [c*e, (c+1)*e) of each field's dim 2
    (e: the field's extent per chunk), as `gear_hf.cache.storage.ChunkStore.fields` holds them."""

    codes: torch.Tensor  # uint8 packed codes
    scale: torch.Tensor
    minimum: torch.Tensor
    sparse_values: torch.Tensor
    sparse_index: torch.Tensor
    lowrank_a: torch.Tensor  # [B,H,capacity*chunk_len,r]: 16-bit, or int8 (spec.factor_bits=8)
    lowrank_b: torch.Tensor  # [B,H,capacity*d,r]
    lowrank_a_scale: torch.Tensor  # [B,H,capacity,r] per-column scales of int8 factors, else [B,H,0,r]
    lowrank_b_scale: torch.Tensor
    spec: object  # gear_hf.compress.ChunkSpec
    chunk_len: int
    derived: dict = field(default_factory=dict)  # prepare_derived(...) output, or {} (the kernel derives it)
    channel_bits: torch.Tensor | None = None  # uint8 [B,H,capacity,d]: key widths per channel (spec.allocated)

    FIELDS = ("codes", "scale", "minimum", "sparse_values", "sparse_index", "lowrank_a", "lowrank_b",
              "lowrank_a_scale", "lowrank_b_scale")

    @classmethod
    def of(cls, store) -> ChunkRunView:
        """A `gear_hf.cache.storage.ChunkStore` as the kernels read it: references to its fields, nothing copied."""
        fields = {name: store.fields[name] for name in cls.FIELDS}
        widths = store.fields["channel_bits"] if store.spec.allocated else None
        return cls(**fields, spec=store.spec, chunk_len=store.chunk_len, channel_bits=widths)

    @property
    def capacity(self) -> int:
        """Chunks the storage holds per row (used or not)."""
        return self.lowrank_a.shape[2] // self.chunk_len

    def extent(self, name: str) -> int:
        """Slots of field `name` along dim 2 per chunk."""
        return getattr(self, name).shape[2] // self.capacity


@dataclass(frozen=True, eq=False)
class CodedTailView:
    """The buffer held per token (`gear_hf.cache.coded_store.CodedTokenStore`, format `format.INT8_TOKENS`,
    `INT8_ROTATED_TOKENS` or `INT4_TOKENS`), as stored: token t of row b, head h is codes[b,h,t] * scale[b,h,t] +
    minimum[b,h,t] (float32; 4-bit codes two a byte, the even channel in the low nibble), in the Walsh–Hadamard-rotated
    basis when rotated (the vector is that times `compress.rotation.hadamard(d)`), except this step's own tokens
    (staged[b, t]), which `StreamView.buffer` holds exact (never rotated) at the same columns. With affine (a centered
    buffer, `channel_centers.ChannelCenters`), that vector (back in the plain basis) times affine[b,h,0] plus
    affine[b,h,1], per channel, is the token (a kernel that attends the tokens rotated: `affine_in_basis`)."""

    codes: torch.Tensor  # uint8 [B, H, cap, ceil(d * bits / 8)]
    scale: torch.Tensor  # [B, H, cap, 1] 16-bit
    minimum: torch.Tensor  # [B, H, cap, 1] 16-bit
    staged: torch.Tensor | None  # bool [B, cap]: read from StreamView.buffer; None: every token coded
    bits: int = 8  # bits per code: 8 or 4
    rotated: bool = False  # codes of the rotated vector (INT8_ROTATED_TOKENS, INT4_TOKENS)
    affine: torch.Tensor | None = None  # float32 [B, H, 2, d]: per channel scale and center, or None
    affine_scaled: bool = True  # its scales may differ from 1 (keys' centers); False: centers only (values')


def affine_in_basis(tail: CodedTailView, rotated: bool) -> torch.Tensor:
    """`tail.affine` (float32 [B,H,2,d], plain basis) for a kernel that reads the tokens in the rotated basis when
    rotated: the centers rotated (x·H + c·H = (x + c)·H). Only for centers without scales (`affine_scaled` False:
    values' `ChannelCenters(scaled=False)`; told by the view, not checked on the data: no device sync): a per-channel
    scale of the plain basis is no per-channel scale of the rotated one, and a scaled affine asked for rotated is a
    ValueError."""
    if not rotated:
        return tail.affine
    if tail.affine_scaled:
        raise ValueError("a centered buffer with per-channel scales (keys) cannot be read in the rotated basis: "
                         "only centers without scales (values) can")
    from ..compress.rotation import rotate

    return torch.stack([tail.affine[:, :, 0], rotate(tail.affine[:, :, 1])], dim=2).contiguous()


TAIL_FORMATS = ((8, False), (8, True), (4, True))  # the per-token buffer formats the kernels read: (bits, rotated)


@functools.lru_cache(maxsize=64)  # (asked for every stream at every step; ChunkSpec is frozen)
def tail_format(spec, head_dim: int) -> bool:
    """True when spec (a `compress.ChunkSpec`) stores each token as codes of one group over the head vector with a
    scale and minimum, and nothing else: 8-bit codes of the vector or of the Walsh–Hadamard-rotated vector, or 4-bit
    codes of the rotated vector (`format.INT8_TOKENS`, `INT8_ROTATED_TOKENS`, `INT4_TOKENS`: what the CPU kernel
    encodes and the fused kernels read as a `CodedTailView`;
    any head_dim here: the rotation's blocks are its largest power-of-two divisor, and an odd one's last byte holds
    one code; a kernel may ask more of head_dim)."""
    return ((spec.bits, bool(spec.rotate)) in TAIL_FORMATS and head_dim >= 1 and spec.axis == "token"
            and spec.group_for(1, head_dim) >= head_dim
            and not (spec.outlier_ratio or spec.rank or spec.range_search or spec.allocated or spec.extra_terms))


@dataclass(frozen=True, eq=False)
class StreamView:
    buffer: torch.Tensor  # [B, H, cap, d] full-precision tokens (this step's own tokens included); with a coded tail:
    # [B, H, cap, d] holding this step's staged tokens, or [B, H, 0, d] when none is staged
    sink: torch.Tensor | None = None  # [B, H, S+1, d] full-precision first tokens, or None
    prompt: ChunkRunView | None = None  # one chunk (the prompt), or None
    decode: ChunkRunView | None = None  # decode chunks of buffer_size tokens, or None
    tail: CodedTailView | None = None  # the buffer's coded tokens (a backend that reads them), or None
    # each row's newest decode chunk is not in `decode` but the first buffer_size tokens of its buffer (values with
    # GearConfig.value_buffer_size): the row's (decode chunks, buffer) are (c - 1, buffer_size + f) when c > 0. (Keys
    # held too: both views come without it, the layout's rows counted as the streams store them.)
    held_chunk: bool = False
    # (prompt spec, decode spec) of the stream's chunks, present or not: what a kernel types an absent run as, so
    # that its compiled signature does not change as the cache fills (None: a view built by hand)
    specs: tuple | None = None
    # float32 [B, H, d]: every token of this view is handed minus this per-channel center (values coded centered in
    # their chunks, GearConfig.value_chunks_centered): a kernel adds it to each output row that attends anything
    # (the weights sum to one); None: the tokens as they are
    center: torch.Tensor | None = None
    # with center: the sink's and the buffer's exact tokens (`buffer`: this step's own) are handed minus it too; False:
    # as they are, and the kernel subtracts it (a backend with `centers_exact_tokens`)
    exact_centered: bool = True


@dataclass(frozen=True, eq=False)
class DecodeLayout:
    rows: torch.Tensor  # int32 [B, 4]: (sink_len, prompt_len, decode_chunks, buffer_len), on the query's device
    limits: torch.Tensor  # int32 [B, q]: row-local index of each query token; -1 = padding (sees nothing)
    positions: torch.Tensor  # int32 [B, >=tokens]: row-local RoPE positions
    max_sink: int  # host-side upper bounds over rows (no device sync needed)
    max_prompt: int
    max_decode_chunks: int
    max_buffer: int
    buffer_size: int  # n_b: tokens per decode chunk


def key_outlier_count(run: ChunkRunView) -> int:
    """Outlier slots per channel per chunk of a key run (2k), 0 when it has no sparse term."""
    if run is None or run.sparse_values.numel() == 0 or run.capacity == 0:
        return 0
    return run.extent("sparse_values")


def prepare_derived(run: ChunkRunView, chunks_used: int) -> dict[str, torch.Tensor]:
    """Key outliers of the first `chunks_used` chunks of a key run (axis="channel"), sorted by token within each
    chunk, so the kernel applies a block's outliers inside its main loop (no score buffer, no atomics).

    Returns {} when the run has no key outliers, else
      key_outlier_where  int32 [B, H, chunks_used * 2k * d]: token_in_chunk * d + channel, ascending per chunk;
                         entries whose value is 0 (unfilled slots of a short row) sort last and are never read
      key_outlier_value  [B, H, chunks_used * 2k * d] (sparse_values' dtype), in the same order
      key_outlier_tile   int32 [B, H, chunks_used, ceil(chunk_len/16) + 1]: entries of the chunk before token
                         16*u, i.e. tile u's entries are [tile[u], tile[u+1]) (offsets inside the chunk's segment)
    Cost: one sort of 2k*d entries per chunk, row and head (a few microseconds per decode chunk; the prompt
    chunk once at prefill). Chunks are independent: a caller may recompute only a new chunk (`chunks_used`
    counts from the run's start, so slicing the run's fields to one chunk works the same) and concatenate.
    """
    k2 = key_outlier_count(run)
    if k2 == 0 or chunks_used <= 0:
        return {}
    if run.spec.axis != "channel":
        raise ValueError(f"prepare_derived: key outliers must be stored per channel, got axis={run.spec.axis!r}")
    B, H = run.sparse_values.shape[:2]
    d = run.sparse_values.shape[3]
    n = run.chunk_len
    values = run.sparse_values[:, :, : chunks_used * k2].reshape(B, H, chunks_used, k2 * d)
    token = run.sparse_index[:, :, : chunks_used * k2].to(torch.int32).reshape(B, H, chunks_used, k2, d)
    channel = torch.arange(d, dtype=torch.int32, device=token.device)
    where = (token * d + channel).reshape(B, H, chunks_used, k2 * d)
    where = torch.where(values != 0, where, n * d)  # empty slots: past the chunk's last token
    where, order = torch.sort(where, dim=-1, stable=True)
    values = torch.gather(values, -1, order)
    tiles = -(-n // OUTLIER_TILE)
    bounds = torch.arange(tiles + 1, dtype=torch.int32, device=token.device) * (OUTLIER_TILE * d)
    bounds = bounds.clamp(max=n * d)
    offsets = torch.searchsorted(where, bounds.expand(B, H, chunks_used, tiles + 1).contiguous())
    return {"key_outlier_where": where.reshape(B, H, -1).contiguous(),
            "key_outlier_value": values.reshape(B, H, -1).contiguous(),
            "key_outlier_tile": offsets.to(torch.int32).contiguous()}
