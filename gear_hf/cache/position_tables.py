"""The position tables of `RowLayout` (gear_hf/cache/layout.py): int32, [B, ...], 8 bytes a token for the cache.

    positions      [B, cap+1]  each row-local token's position (+ a scratch column that padding writes to)
    rect_to_local  [B, cap]    the row-local index of each column of HF's padded layout (-1: padding)

A compact layout (every row one run of columns after its left padding, every position its row-local index) stores
neither: `compact_tables` builds them from the pads. Stored tables grow in bounded steps of POSITION_GRANULE.
"""

from __future__ import annotations

import torch

from .storage import grown_capacity

POSITION_GRANULE = 16  # columns the stored tables grow by (at least)


def compact_tables(pads: list[int], held: int, rect: int, device, capacity: tuple[int, int] = (0, 0)
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, max(held, capacity[0])+1], rect_to_local [B, max(rect, capacity[1])]) of a compact layout:
    positions are the row-local indices, column c of row b holds token c - pads[b]."""
    B = len(pads)
    positions = torch.zeros(B, max(capacity[0], held) + 1, dtype=torch.int32, device=device)
    positions[:, :held] = torch.arange(held, dtype=torch.int32, device=device)
    rect_to_local = torch.full((B, max(capacity[1], rect)), -1, dtype=torch.int32, device=device)
    if rect:
        pad = torch.tensor(pads, dtype=torch.int32, device=device)[:, None]
        columns = torch.arange(rect, dtype=torch.int32, device=device)[None]
        rect_to_local[:, :rect] = torch.where(columns >= pad, columns - pad, -1)
    return positions, rect_to_local


def grown_tables(tables: tuple[torch.Tensor, torch.Tensor], held: int, rect: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored tables with room for `held` row-local tokens and `rect` padded columns (bounded steps)."""
    positions, rect_to_local = tables
    if held > positions.shape[1] - 1:
        grown = positions.new_zeros(positions.shape[0], grown_capacity(positions.shape[1] - 1, held,
                                                                       POSITION_GRANULE) + 1)
        grown[:, : positions.shape[1] - 1] = positions[:, :-1]
        positions = grown
    if rect > rect_to_local.shape[1]:
        grown = rect_to_local.new_full((rect_to_local.shape[0], grown_capacity(rect_to_local.shape[1], rect,
                                                                              POSITION_GRANULE)), -1)
        grown[:, : rect_to_local.shape[1]] = rect_to_local
        rect_to_local = grown
    return positions, rect_to_local
