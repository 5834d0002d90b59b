"""`DenseWindow`: a sliding layer that cannot save memory stores what transformers' sliding cache would.

A layer whose window is short next to the buffer (window <= 2 x buffer_size) never gains from compression: its
window holds at most one compressible chunk beside up to a buffer of full-precision tokens, so the compressed layer
would own at least what the dense window does, and no layer owns more than the dense cache would. Such a layer
keeps, like transformers'
`DynamicSlidingWindowLayer`, the last window-1 columns of HF's padded layout (keys before RoPE, values), in the
model's dtype, and nothing else: no chunk, no buffer, no per-token bookkeeping of its own (the positions the keys are
rotated with are the layout's, shared by every layer).

    keys, values  [B, H, n, d]   n <= window-1 columns between steps (+ the last step's own when speculative, so
                                 that `crop` can take them back), window-1 + q during a step of q tokens
"""

from __future__ import annotations

import torch


def dense_window_reason(window: int | None, buffer_size: int, compresses: bool) -> str | None:
    """Why a layer with this sliding window stores dense, or None when it compresses (full attention, or a window
    long enough for chunks to pay)."""
    if window is None:
        return None
    if not compresses:
        return f"sliding window {window}: nothing is compressed, the window is kept as transformers keeps it"
    if window <= 2 * buffer_size:
        return (f"sliding window {window} <= 2 x buffer_size {buffer_size}: a window holds at most one compressible "
                "chunk beside a full-precision buffer, so compression cannot save memory")
    return None


class DenseWindow:
    """The last columns of one sliding layer's keys (before RoPE) and values, in HF's padded layout."""

    def __init__(self, window: int, speculative: bool = False) -> None:
        self.window = window
        self.speculative = speculative
        self.keys: torch.Tensor | None = None  # [B, H, n, d]
        self.values: torch.Tensor | None = None
        self.last_query = 0  # columns the last step appended

    @property
    def columns(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This step's columns keys/values [B,H,q,d] (padding columns included, as transformers stores them)."""
        if self.keys is None:
            self.keys, self.values = keys.clone(), values.clone()
        else:
            self.keys, self.values = torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2)
        self.last_query = keys.shape[2]

    def read(self, columns: int, dtype: torch.dtype, out: tuple = (None, None),
             streams: tuple[int, ...] = (0, 1)) -> tuple[torch.Tensor, ...]:
        """The last `columns` columns [B,H,columns,d] of keys (0) and/or values (1), views unless `out` is given."""
        result = []
        for i in streams:
            data = (self.keys, self.values)[i][:, :, self.columns - columns :]
            target = out[i]
            result.append(data.to(dtype) if target is None else target.copy_(data))
        return tuple(result)

    def end_step(self) -> None:
        """Keep the window's last window-1 columns (and the step's own when speculative), owning exactly them."""
        keep = self.window - 1 + (self.last_query if self.speculative else 0)
        if self.keys is not None and self.columns > keep:
            self.keys = self.keys[:, :, -keep:].clone() if keep else self.keys[:, :, :0].clone()
            self.values = self.values[:, :, -keep:].clone() if keep else self.values[:, :, :0].clone()

    def crop(self, remove: int) -> None:
        """Take back the newest `remove` columns (speculative decoding: the last step's own)."""
        if remove and self.keys is not None:
            keep = self.columns - min(remove, self.columns)
            self.keys, self.values = self.keys[:, :, :keep].clone(), self.values[:, :, :keep].clone()

    def select_rows(self, index: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    def column_nbytes(self) -> int:
        """Bytes one column of one row holds (keys and values)."""
        return 0 if self.keys is None else 2 * self.keys.shape[1] * self.keys.shape[3] * self.keys.element_size()

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.keys, self.values) if t is not None)
