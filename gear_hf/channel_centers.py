"""`ChannelCenters`: each row's per-channel center and power-of-two scale of a per-token buffer
(`GearConfig.key_buffer_centered`).

Why: a per-token buffer format (`format.INT8_ROTATED_TOKENS`) takes one range per token over the whole head vector. Some
models' keys carry a per-channel offset, constant over tokens (Qwen2's key bias), and channels of very different
spreads: those few channels then set every token's step, and the others are coded coarsely. Coding each key as
(x - center) / 2^exponent per channel, the center and exponent taken from the row's first step (its prompt) and kept
with the row, leaves the range to what varies from token to token. Reading multiplies back and adds the center
(exact: the scale is a power of two), before RoPE, in the plain basis (results/tail/ "Keys centered in the buffer").

Why the square root of a channel's spread σ_c for its scale s_c: one range per rotated token spreads the token's
error evenly over the coded channels, so channel c errs by about s_c·|x/s| (x/s: the coded vector); the expected
logit error sum_c q_c² s_c² · sum_c σ_c² / s_c² is least at s_c ∝ sqrt(σ_c / |q_c|) (Cauchy–Schwarz), sqrt(σ_c)
where nothing is known of the queries. s_c = σ_c (every channel equalized) over-corrects (results/tail/ "Keys
centered in the buffer").

Stored per row, head and channel: the center in the 16-bit side dtype and the exponent as int8 (3 bytes; 12 / T
bits/element at T tokens), from the first row fitted on. A row whose first step buffers fewer than `MIN_FIT_TOKENS`
tokens is not centered: a spread from a handful of tokens says little about the next ones, and 3 bytes a channel would
cost a short row more than its 8-bit codes save (the cache would own more than dense: tests/test_footprint.py).
"""

from __future__ import annotations

import torch

from .compress import side_dtype

MIN_FIT_TOKENS = 16  # tokens a row's first step must buffer for the row to be centered
# a channel's scale is at least the head's widest spread / 2^SPREAD_RANGE: a channel that barely moved in the prompt
# (or never) is not scaled up without bound
SPREAD_RANGE = 8


class ChannelCenters:
    """Per row b, head h and channel c: center[b,h,c] and exponent[b,h,c]; a token x [.., d] is coded as
    (x - center) * 2^-exponent and read back as code * 2^exponent + center. Nothing is stored until a row is
    fitted; rows not fitted (not yet, or never: a first step of fewer than MIN_FIT_TOKENS tokens) read as identity
    (center 0, exponent 0)."""

    def __init__(self) -> None:
        self.center: torch.Tensor | None = None  # [B,H,d] side dtype, from the first fitted row on
        self.exponent: torch.Tensor | None = None  # [B,H,d] int8
        self.settled: list[bool] = []  # per row: its first step has been seen (fitted or not)

    def fit(self, exact: torch.Tensor, written: torch.Tensor) -> None:
        """Rows seen for the first time (with tokens in this step: written [B,cap] of exact [B,H,cap,d]) take their
        centers from those tokens when there are MIN_FIT_TOKENS or more (all of them: fitted to the newest 64 of a
        1,024-token prompt, the next tokens read worse, results/tail/): the mean per channel, and the power of two at
        or above the square root of each channel's largest deviation from it (that deviation floored at the head's
        widest / 2^SPREAD_RANGE)."""
        B, H, _, d = exact.shape
        if not self.settled:
            self.settled = [False] * B
        for b in range(B):
            if self.settled[b]:  # (every row after its first step: nothing to do)
                continue
            columns = written[b].nonzero().flatten()
            if not columns.numel():
                continue
            self.settled[b] = True
            if columns.numel() < MIN_FIT_TOKENS:
                continue
            if self.center is None:
                self.center = torch.zeros(B, H, d, dtype=side_dtype(exact.dtype), device=exact.device)
                self.exponent = torch.zeros(B, H, d, dtype=torch.int8, device=exact.device)
            x = exact[b][:, columns].float()  # [H,n,d]
            center = x.mean(dim=1).to(self.center.dtype)  # [H,d] (as stored: coding and reading use the same one)
            spread = (x - center.float()[:, None]).abs().amax(dim=1)  # [H,d]
            floor = spread.amax(dim=-1, keepdim=True) * 2.0 ** -SPREAD_RANGE
            spread = torch.maximum(spread, floor).clamp_min(torch.finfo(torch.float32).tiny)
            self.center[b] = center
            self.exponent[b] = torch.ceil(torch.log2(spread) / 2).clamp(-126, 127).to(torch.int8)  # (sqrt: above)

    def _rows(self, rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(center, scale) float32 [J,H,1,d] of rows (None: every row)."""
        center, exponent = (self.center, self.exponent) if rows is None else (self.center[rows], self.exponent[rows])
        return center.float()[:, :, None], torch.exp2(exponent.float())[:, :, None]

    def normalized(self, x: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """x [J,H,n,d] (rows' tokens; None: every row's) as coded: (x - center) / scale, in x's dtype."""
        if self.center is None:
            return x
        center, scale = self._rows(rows)
        return ((x.float() - center) / scale).to(x.dtype)

    def restored(self, decoded: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """decoded [J,H,n,d] (codes read back) as the tokens: decoded * scale + center, in decoded's dtype."""
        if self.center is None:
            return decoded
        center, scale = self._rows(rows)
        return (decoded.float() * scale + center).to(decoded.dtype)

    def kernel_affine(self) -> torch.Tensor | None:
        """float32 [B,H,2,d]: each head's scales (row 0) and centers (row 1), as the fused kernels read them (a
        per-call copy of B·H·2·d floats); None while no row is fitted."""
        if self.center is None:
            return None
        return torch.stack([torch.exp2(self.exponent.float()), self.center.float()], dim=2).contiguous()

    def select_rows(self, index: torch.Tensor) -> None:
        if self.settled:
            self.settled = [self.settled[i] for i in index.tolist()]
        if self.center is not None:
            self.center, self.exponent = self.center.index_select(0, index), self.exponent.index_select(0, index)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.center, self.exponent) if t is not None)
