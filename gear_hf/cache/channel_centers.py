"""`ChannelCenters`: each row's per-channel center (and, for keys, power-of-two scale) of a per-token buffer
(`GearConfig.key_buffer_centered`, `value_buffer_centered`).

Why: a per-token buffer format (`format.INT8_ROTATED_TOKENS`) takes one range per token over the whole head vector. Some
models' keys carry a per-channel offset, constant over tokens (Qwen2's key bias), and channels of very different
spreads: those few channels then set every token's step, and the others are coded coarsely. Coding each key as
(x - center) / 2^exponent per channel, the center and exponent taken from the row's first step (its prompt) and kept
with the row, leaves the range to what varies from token to token. Reading multiplies back and adds the center
(exact: the scale is a power of two), before RoPE, in the plain basis (results/tail/ "Keys centered in the buffer").

Why the square root of a channel's spread σ_c for its scale s_c: one range per rotated token spreads the token's
error evenly over the coded channels, so channel c errs by about s_c·|x/s| (x/s: the coded vector); the expected
logit error sum_c q_c² s_c² · sum_c σ_c² / s_c² is least at s_c ∝ sqrt(σ_c / |q_c|) (Cauchy–Schwarz), sqrt(σ_c)
where nothing is known of the queries. s_c = σ_c (every channel equalized) over-corrects, and weighting by the
prompt's query energy (sqrt(σ_c / |q_c|)) measured no better (results/tail/ "Keys centered in the buffer", "Where
Qwen2.5's KL still goes").

Values are centered only (a value bias is an offset like the keys'; their buffer is read in the rotated basis, where
a per-channel scale of the plain basis does not apply): each channel's mean, coded as int8 in steps of the head's
largest |mean| / 127 (one 16-bit step per head), which takes out all but 1/254 of the largest offset.

Stored per row and head: keys, each channel's center in the 16-bit side dtype and its exponent as 4 bits above the
head's (int8) lowest (the floor below keeps a head's exponents within 5 of each other): 2.5 bytes a channel + 1;
values, an int8 center a channel + the 16-bit step. From the first row fitted on. A row whose first step buffers
fewer than `MIN_FIT_TOKENS` tokens is not centered: a spread from a handful of tokens says little about the next ones,
and the centers would cost a short row more than its coded buffer saves (the cache would own more than dense:
tests/test_footprint.py).
"""

from __future__ import annotations

import functools

import torch

from ..compress import side_dtype

MIN_FIT_TOKENS = 16  # tokens a row's first step must buffer for the row to be centered
# a channel's scale is at least the head's widest spread / 2^SPREAD_RANGE: a channel that barely moved in the prompt
# (or never) is not scaled up without bound
SPREAD_RANGE = 8


class ChannelCenters:
    """Per row b, head h and channel c: a center and (scaled: keys) a power-of-two scale; a token x [.., d] is coded
    as (x - center) / scale and read back as code * scale + center. Nothing is stored until a row is fitted; rows not
    fitted (not yet, or never: a first step of fewer than MIN_FIT_TOKENS tokens) read as identity (center 0, scale 1).
    scaled=False (values): centers only, scale 1."""

    def __init__(self, scaled: bool = True) -> None:
        self.scaled = scaled
        # scaled: center [B,H,d] side dtype, low [B,H] int8 (the head's lowest exponent), above [B,H,ceil(d/2)]
        # uint8 (each channel's exponent - low, 4 bits, the even channel in the low nibble);
        # not scaled: center [B,H,d] int8 codes, step [B,H] side dtype. From the first fitted row on.
        self.fields: dict[str, torch.Tensor] = {}
        self.settled: list[bool] = []  # per row: its first step has been seen (fitted or not)
        # float32 [B,H,2,d] (scales, centers) as read, for the rest of the step: the kernels' read and the step's
        # encoding use it; dropped when the step ends (`end_step`), so nothing derived is kept between steps
        self._step_affine: torch.Tensor | None = None

    @property
    def fitted(self) -> bool:
        return bool(self.fields)

    def fit(self, exact: torch.Tensor, written: torch.Tensor) -> None:
        """Rows seen for the first time (with tokens in this step: written [B,cap] of exact [B,H,cap,d]) take their
        centers from those tokens when there are MIN_FIT_TOKENS or more (all of them: fitted to the newest 64 of a
        1,024-token prompt, the next tokens read worse, results/tail/): the mean per channel, and (scaled) the power
        of two at or above the square root of each channel's largest deviation from it (that deviation floored at
        the head's widest / 2^SPREAD_RANGE)."""
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
            self._step_affine = None
            if not self.fields:
                self.fields = self._empty(B, H, d, side_dtype(exact.dtype), exact.device)
            x = exact[b][:, columns].float()  # [H,n,d]
            if self.scaled:
                self._fit_scaled(b, x)
            else:
                center = x.mean(dim=1)  # [H,d]
                step = (center.abs().amax(dim=-1) / 127).to(self.fields["step"].dtype)  # [H] (as stored)
                self.fields["step"][b] = step
                self.fields["center"][b] = torch.round(center / step.float().clamp_min(_TINY)[:, None]) \
                    .clamp(-127, 127).to(torch.int8)

    def _fit_scaled(self, b: int, x: torch.Tensor) -> None:
        center = x.mean(dim=1).to(self.fields["center"].dtype)  # [H,d] (as stored: coding and reading use the same)
        spread = (x - center.float()[:, None]).abs().amax(dim=1)  # [H,d]
        floor = spread.amax(dim=-1, keepdim=True) * 2.0 ** -SPREAD_RANGE
        spread = torch.maximum(spread, floor).clamp_min(_TINY)
        exponent = torch.ceil(torch.log2(spread) / 2).clamp(-126, 127)  # [H,d] (sqrt: module docstring)
        low = exponent.amin(dim=-1, keepdim=True)  # (the floor keeps exponent - low within 0..4: 4 bits hold it)
        above = (exponent - low).to(torch.uint8)
        if above.shape[-1] % 2:
            above = torch.nn.functional.pad(above, (0, 1))
        self.fields["center"][b] = center
        self.fields["low"][b] = low[:, 0].to(torch.int8)
        self.fields["above"][b] = above[:, 0::2] | (above[:, 1::2] << 4)

    def _empty(self, B: int, H: int, d: int, side: torch.dtype, device) -> dict[str, torch.Tensor]:
        if self.scaled:
            return {"center": torch.zeros(B, H, d, dtype=side, device=device),
                    "low": torch.zeros(B, H, dtype=torch.int8, device=device),
                    "above": torch.zeros(B, H, (d + 1) // 2, dtype=torch.uint8, device=device)}
        return {"center": torch.zeros(B, H, d, dtype=torch.int8, device=device),
                "step": torch.zeros(B, H, dtype=side, device=device)}

    def _center_scale(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(center, scale) float32 [J,H,d] of rows (None: every row)."""
        if rows is None and self._step_affine is not None:  # (this step's kernel read made it)
            return self._step_affine[:, :, 1], self._step_affine[:, :, 0]
        return self._decoded(self.fields if rows is None else {name: t[rows] for name, t in self.fields.items()})

    def _decoded(self, f: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.scaled:
            center = f["center"].float() * f["step"].float()[..., None]
            return center, torch.ones_like(center)
        d = f["center"].shape[-1]
        # 2^(each channel's exponent above the head's lowest), the two channels of a byte at once: [J,H,d]
        above = _nibble_powers(f["above"].device)[f["above"].long()].flatten(-2)[..., :d]
        return f["center"].float(), above * torch.exp2(f["low"].float())[..., None]  # (powers of two: exact)

    def normalized(self, x: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """x [J,H,n,d] (rows' tokens; None: every row's) as coded: (x - center) / scale, in x's dtype."""
        if not self.fields:
            return x
        center, scale = self._center_scale(rows)
        if not self.scaled:  # (scales of 1: the division changes no bit)
            return (x.float() - center[:, :, None]).to(x.dtype)
        return ((x.float() - center[:, :, None]) / scale[:, :, None]).to(x.dtype)

    def restored(self, decoded: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """decoded [J,H,n,d] (codes read back) as the tokens: decoded * scale + center, in decoded's dtype."""
        if not self.fields:
            return decoded
        center, scale = self._center_scale(rows)
        return (decoded.float() * scale[:, :, None] + center[:, :, None]).to(decoded.dtype)

    def restore_(self, decoded: torch.Tensor) -> torch.Tensor:
        """`restored` of every row, in place: no float32 copy of a history-sized read (each element still computed in
        float32: an in-place op on decoded with float32 operands)."""
        if self.fields:
            center, scale = self._center_scale()
            if self.scaled:
                decoded.mul_(scale[:, :, None])  # (a power of two: exact)
            decoded.add_(center[:, :, None])
        return decoded

    def kernel_affine(self, backends=()) -> torch.Tensor | None:
        """float32 [B,H,2,d]: each head's scales (row 0) and centers (row 1) in the plain basis, as the fused kernels
        read them (B·H·2·d floats made once a step, by the first of backends that decodes them
        (`Backend.decode_centers`), else in torch; `views.affine_in_basis` for a kernel that reads rotated values);
        None while no row is fitted."""
        if not self.fields:
            return None
        if self._step_affine is None:
            for backend in backends:
                self._step_affine = backend.decode_centers(self.fields)
                if self._step_affine is not None:
                    return self._step_affine
            center, scale = self._decoded(self.fields)
            self._step_affine = torch.stack([scale, center], dim=2).contiguous()
        return self._step_affine

    def end_step(self) -> None:
        """The step ended: drop what was derived for it."""
        self._step_affine = None

    def select_rows(self, index: torch.Tensor) -> None:
        if self.settled:
            self.settled = [self.settled[i] for i in index.tolist()]
        self.fields = {name: t.index_select(0, index) for name, t in self.fields.items()}
        self._step_affine = None

    def nbytes(self) -> int:
        """The stored centers, and during a step what was derived from them (nothing between steps)."""
        derived = [self._step_affine] if self._step_affine is not None else []
        return sum(t.numel() * t.element_size() for t in (*self.fields.values(), *derived))


_TINY = torch.finfo(torch.float32).tiny


@functools.lru_cache(maxsize=8)
def _nibble_powers(device: torch.device) -> torch.Tensor:
    """float32 [256, 2] on device (made once per device, not copied at every step): a byte of `above` as the powers
    of two of its low and high nibble (the even channel, the odd one)."""
    byte = torch.arange(256)
    return torch.stack([byte & 15, byte >> 4], dim=-1).float().exp2().to(device)
