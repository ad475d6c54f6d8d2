"""Block geometry the spread steps share: where the tail rows fall (also the Triton evidence), and whether an
index's offsets attend a tile."""

from __future__ import annotations

import torch

__all__ = ["tail_blocks", "tile_chosen"]


def tail_blocks(seqlen: int, count: int, block_size: int) -> tuple[int, int]:
    """The query blocks the last ``count`` positions fall in: the first one and how many (0, 0 without a tail)."""
    count = min(count, seqlen)
    if count == 0:
        return 0, 0
    first = (seqlen - count) // block_size
    return first, (seqlen - 1) // block_size - first + 1


def tile_chosen(offsets: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
    """Whether the slash set attends each tile: ``offsets`` bool ``[B, Hq, nb]`` (``offset_mask``), ``tile``
    LongTensor ``[B or 1, Hq or 1, ...]``, each tile's query block minus its key block. Bool like ``tile``
    broadcast to ``[B, Hq, ...]``; False for negative offsets (keys after the query block)."""
    batch, heads, nb = offsets.shape
    tile = tile.expand(batch, heads, *tile.shape[2:])
    return offsets.gather(-1, tile.clamp(0, nb - 1).flatten(2)).view(tile.shape) & (tile >= 0)
