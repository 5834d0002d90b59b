"""`ChannelCenters`: each row's per-channel center and power-of-two scale of a per-token buffer
(`GearConfig.key_buffer_centered`).

Why: a per-token buffer format (`format.INT8_ROTATED_TOKENS`) takes one range per token over the whole head vector. Some
models' keys carry a per-channel offset, constant over tokens (Qwen2's key bias), and channels of very different
spreads: those few channels then set every token's step, and the others are coded coarsely. Coding each key as
(x - center) / 2^exponent per channel, the center and exponent taken from the row's first step (its prompt) and kept
with the row, leaves the range to what varies from token to token. Reading multiplies back and adds the center
(exact: the scale is a power of two), before RoPE, in the plain basis (results/tail/ "Keys centered in the buffer").

Stored per row, head and channel: the center in the 16-bit side dtype and the exponent as int8 (3 bytes; 12 / T
bits/element at T tokens). A row's first step with fewer than `MIN_SCALED_TOKENS` tokens sets its center only
(exponent 0): a spread from a handful of tokens says little about the next ones.
"""

from __future__ import annotations

import torch

from .compress import side_dtype

MIN_SCALED_TOKENS = 16  # tokens a row's first step needs for its channels' spreads to set their scales
# a channel's scale is at least the head's widest spread / 2^SPREAD_RANGE: a channel that barely moved in the prompt
# (or never) is not scaled up without bound
SPREAD_RANGE = 8


class ChannelCenters:
    """Per row b, head h and channel c: center[b,h,c] and exponent[b,h,c]; a token x [.., d] is coded as
    (x - center) * 2^-exponent and read back as code * 2^exponent + center. Rows not yet fitted read as identity
    (center 0, exponent 0)."""

    def __init__(self) -> None:
        self.center: torch.Tensor | None = None  # [B,H,d] side dtype
        self.exponent: torch.Tensor | None = None  # [B,H,d] int8
        self.fitted: list[bool] = []

    def reserve(self, like: torch.Tensor) -> None:
        """Room for like's rows ([B,H,*,d], the model's dtype), identity until fitted."""
        B, H, _, d = like.shape
        self.center = torch.zeros(B, H, d, dtype=side_dtype(like.dtype), device=like.device)
        self.exponent = torch.zeros(B, H, d, dtype=torch.int8, device=like.device)
        self.fitted = [False] * B

    def fit(self, exact: torch.Tensor, written: torch.Tensor) -> None:
        """Rows with tokens in this step (written [B,cap] of exact [B,H,cap,d]) and no center yet take theirs from
        those tokens: the mean per channel, and, from MIN_SCALED_TOKENS tokens on, the power of two at or above each
        channel's largest deviation from it (floored at the head's widest / 2^SPREAD_RANGE)."""
        for b in range(exact.shape[0]):
            if self.fitted[b]:
                continue
            columns = written[b].nonzero().flatten()
            if not columns.numel():
                continue
            x = exact[b][:, columns].float()  # [H,n,d]
            center = x.mean(dim=1).to(self.center.dtype)  # [H,d] (as stored: coding and reading use the same one)
            self.center[b] = center
            if columns.numel() >= MIN_SCALED_TOKENS:
                spread = (x - center.float()[:, None]).abs().amax(dim=1)  # [H,d]
                floor = spread.amax(dim=-1, keepdim=True) * 2.0 ** -SPREAD_RANGE
                spread = torch.maximum(spread, floor).clamp_min(torch.finfo(torch.float32).tiny)
                self.exponent[b] = torch.ceil(torch.log2(spread)).clamp(-126, 127).to(torch.int8)
            self.fitted[b] = True

    def _rows(self, rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(center, scale) float32 [J,H,1,d] of rows (None: every row)."""
        center, exponent = (self.center, self.exponent) if rows is None else (self.center[rows], self.exponent[rows])
        return center.float()[:, :, None], torch.exp2(exponent.float())[:, :, None]

    def normalized(self, x: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """x [J,H,n,d] (rows' tokens; None: every row's) as coded: (x - center) / scale, in x's dtype."""
        center, scale = self._rows(rows)
        return ((x.float() - center) / scale).to(x.dtype)

    def restored(self, decoded: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """decoded [J,H,n,d] (codes read back) as the tokens: decoded * scale + center, in decoded's dtype."""
        center, scale = self._rows(rows)
        return (decoded.float() * scale + center).to(decoded.dtype)

    def kernel_affine(self) -> torch.Tensor:
        """float32 [B,H,2,d]: each head's scales (row 0) and centers (row 1), as the fused kernels read them (a
        per-call copy of B·H·2·d floats)."""
        return torch.stack([torch.exp2(self.exponent.float()), self.center.float()], dim=2).contiguous()

    def select_rows(self, index: torch.Tensor) -> None:
        if self.center is not None:
            self.center, self.exponent = self.center.index_select(0, index), self.exponent.index_select(0, index)
            self.fitted = [self.fitted[i] for i in index.tolist()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.center, self.exponent) if t is not None)
