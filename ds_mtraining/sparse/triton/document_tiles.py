"""Packed documents in the form the kernels read: per-row starts as int32, and the last query tile of every key block.

Plain PyTorch, no Triton, device ops only (no host sync). ``doc_start [B, N]`` holds, for each local query row, the
global position of the first token of its document (``Documents.starts`` on one device; a ring shard's rows' starts
on shards). The kernels read it two ways:

- per row, for the mask ``k >= doc_start[q]`` inside the tiles and columns they keep, and the start of a program's
  first row, which is the smallest of its rows (starts never decrease inside a tile), to bound the forward's and the
  dq pass's loops: key tiles before that start's block and columns before it are not visited;
- per key block ``g``, the last global query tile whose first row's document starts at or before the block's last
  key (``last_query_tiles``). Every later query tile starts its documents after the block, so the dk/dv pass and the
  column pass stop their loops over query tiles there instead of testing each one.
"""

from __future__ import annotations

import torch

from .kernel_index import TileMap


def document_rows(doc_start: torch.Tensor, q: torch.Tensor, caller: str) -> torch.Tensor:
    """``doc_start`` checked against q ``[B, N, Hq, D]`` and converted once: int32 ``[B, N]``, contiguous."""
    if (
        not isinstance(doc_start, torch.Tensor)
        or doc_start.shape != q.shape[:2]
        or doc_start.is_floating_point()
        or doc_start.device != q.device
    ):
        got = (
            f"{doc_start.dtype} {tuple(doc_start.shape)} on {doc_start.device}"
            if isinstance(doc_start, torch.Tensor)
            else type(doc_start).__name__
        )
        raise ValueError(
            f"{caller}: doc_start must be an integer tensor [B, N] = {list(q.shape[:2])} on {q.device} (the global "
            f"first position of each query row's document, Documents.starts); got {got}"
        )
    return doc_start.to(torch.int32).contiguous()


def last_query_tiles(starts: torch.Tensor, block_size: int, num_blocks: int, q_map: TileMap | None) -> torch.Tensor:
    """int32 ``[B, num_blocks]``: for each global key block ``g``, the last global query tile of q (its local tiles
    placed by ``q_map``; None: the identity) whose first row's start is ``<= (g + 1) * block_size - 1``, or -1 if
    there is none. ``starts`` is ``document_rows``' int32 ``[B, N]``.

    Query tiles up to that one are exactly those that may attend the block: a valid row's starts never decrease, so
    the first rows' starts, ordered by global tile, never decrease either.
    """
    b = starts.shape[0]
    tile_start = starts[:, ::block_size].long()  # [B, T]: the first row of each local query tile
    blocks = torch.arange(tile_start.shape[1], device=starts.device) if q_map is None else q_map.blocks.long()
    order = torch.argsort(blocks)  # the local tiles in global order (the identity on one device)
    key_end = ((torch.arange(num_blocks, device=starts.device) + 1) * block_size - 1).expand(b, num_blocks)
    count = torch.searchsorted(tile_start[:, order].contiguous(), key_end.contiguous(), right=True)
    last = blocks[order][(count - 1).clamp(min=0)]
    return torch.where(count > 0, last, -1).to(torch.int32).contiguous()
