"""The tail repair's split of the tail rows' attention into inside and outside an index
(``estimator.spread.tail.tail_residual`` on CUDA), in one pass over their per-key sums.

Rows of one query block share the mask at a key (its column, or the tile of the block's offset to it), so each
block's per-key sum splits exactly. In PyTorch that split is a chain over ``[B, Hq, G, N]`` (each key's offset, a
gather of the offset mask, two ``where``s and their sums): about 30 launches, 0.10 ms at 128K tokens on an H200
(16 heads, 4 query blocks of tail rows). Here one program per (b·hq, key chunk) reads each block's sums once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tail_residual"]

_KEYS = 1024  # keys per program


@triton.jit
def _residual_kernel(
    SUMS, OFFSETS, COLUMNS, OUTSIDE, INSIDE,
    n, nb, first, groups, bs,
    s_g, s_bh, s_off, s_col,
    BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    key = chunk * BLOCK + tl.arange(0, BLOCK)
    real = key < n
    column = tl.load(COLUMNS + bh * s_col + key, mask=real, other=0) != 0
    outside = tl.zeros([BLOCK], dtype=tl.float32)
    inside = tl.zeros([BLOCK], dtype=tl.float64)
    for g in range(groups):
        s = tl.load(SUMS + g * s_g + bh * s_bh + key, mask=real, other=0.0)
        offset = first + g - key // bs  # never past the last block: the tail's blocks are the last ones
        tiled = tl.load(OFFSETS + bh * s_off + offset, mask=real & (offset >= 0), other=0) != 0
        hit = tiled | column
        inside += tl.where(hit, s, 0.0).to(tl.float64)
        outside += tl.where(hit, 0.0, s)
    tl.store(OUTSIDE + bh * n + key, outside, mask=real)
    tl.store(INSIDE + bh * tl.num_programs(1) + chunk, tl.sum(inside, 0))


def tail_residual(
    tail_sum: torch.Tensor, offsets: torch.Tensor, columns: torch.Tensor, first: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail rows' attention inside and outside an index, from their per-key sums per query block.

    Args:
        tail_sum: float32 ``[G, B, Hq, N]``, each key's attention summed over the tail rows of query block
            ``first + g`` (``estimator.spread.evidence.SpreadEvidence``).
        offsets: bool ``[B, Hq, nb]``, the index's block offsets (``VerticalSlashIndex.offset_mask``); columns:
            bool ``[B, Hq, N]``, its columns (``column_mask``). Either may be a slice with a padded row stride.
        first: the tail's first query block; block_size: tokens per block.

    Returns:
        The mass inside the mask summed over all tail rows and keys, float64 ``[B, Hq]``; the mass outside it
        summed over the rows per key, float32 ``[B, Hq, N]``.
    """
    groups, batch, heads, n = tail_sum.shape
    nb = offsets.shape[-1]
    if offsets.shape[:2] != (batch, heads) or columns.shape != (batch, heads, n):
        raise ValueError(
            f"tail_residual: offsets [B, Hq, nb] and columns [B, Hq, N] must match tail_sum [G, B, Hq, N] = "
            f"{tuple(tail_sum.shape)}; got {tuple(offsets.shape)} and {tuple(columns.shape)}"
        )
    if first + groups > nb:
        raise ValueError(f"tail_residual: query blocks {first} .. {first + groups - 1} run past the {nb} blocks")
    count = batch * heads
    sums = tail_sum.float().reshape(groups, count, n)
    offsets, columns = offsets.reshape(count, nb), columns.reshape(count, n)
    if sums.stride(-1) != 1 or offsets.stride(-1) != 1 or columns.stride(-1) != 1:
        sums, offsets, columns = sums.contiguous(), offsets.contiguous(), columns.contiguous()
    chunks = triton.cdiv(n, _KEYS)
    outside = torch.empty(count, n, dtype=torch.float32, device=tail_sum.device)
    inside = torch.empty(count, chunks, dtype=torch.float64, device=tail_sum.device)
    if count and n:
        _residual_kernel[(count, chunks)](
            sums, offsets.view(torch.int8), columns.view(torch.int8), outside, inside,
            n, nb, first, groups, block_size,
            sums.stride(0), sums.stride(1), offsets.stride(0), columns.stride(0),
            BLOCK=_KEYS,
        )  # fmt: skip
    return inside.sum(-1).view(batch, heads), outside.view(batch, heads, n)
