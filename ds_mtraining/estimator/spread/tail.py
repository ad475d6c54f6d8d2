"""The spread strategy's tail repair: columns for the last queries, where a prompt's question sits.

One staggered row falls in the last segment, so what only the end of a sequence reads (a prompt's question
reading its needle) has no evidence, and the last rows' recall falls well below the target (SmolLM2, a NIAH
prompt at 2K: 0.62-0.97 per head for the last 32 rows against 0.98 for the others). The tail rows' exact attention
decides the repair: their mass outside the index's mask, per key, after the offsets and columns the greedy chose
(so a diagonal the greedy bought does not come back as columns).
"""

from __future__ import annotations

import torch

from ds_mtraining.sparse.backends import uses_triton
from ds_mtraining.sparse.index import PAD, VerticalSlashIndex

from ..kernels import estimator_kernels
from .geometry import tail_blocks, tile_chosen
from .settings import SpreadSettings

__all__ = ["tail_columns", "tail_residual"]


def tail_residual(
    index: VerticalSlashIndex, tail_sum: torch.Tensor, seqlen: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail rows' attention mass inside ``index``'s mask and outside it per key, from their per-block key sums.

    Rows of one query block share the mask at a key (the key's column, or the tile of the block's offset to it),
    so each group's sum (``SpreadEvidence.tail_sum``, ``[G, B, Hq, N]``) splits into inside and outside exactly.

    Returns:
        The covered mass, mean over the ``count`` rows, float64 ``[B, Hq]``; the mass outside the mask summed over
        the rows per key, float32 ``[B, Hq, seqlen]``. On CUDA one Triton pass (``estimator.triton.tail``).
    """
    bs = index.block_size
    first, groups = tail_blocks(seqlen, count, bs)
    offsets, columns = index.offset_mask(seqlen), index.column_mask(seqlen)
    if uses_triton(tail_sum.device):
        inside_sum, outside = estimator_kernels().tail.tail_residual(tail_sum, offsets, columns, first, bs)
        return inside_sum / count, outside
    # Each key's offset from query block first + g, and whether the index attends that tile.
    dev = tail_sum.device
    tile = (first + torch.arange(groups, device=dev))[:, None] - torch.arange(seqlen, device=dev) // bs  # [G, N]
    inside = tile_chosen(offsets, tile[None, None]) | columns[:, :, None, :]  # [B, Hq, G, N]
    sums = tail_sum.permute(1, 2, 0, 3)
    covered = torch.where(inside, sums, 0.0).sum((-2, -1), dtype=torch.float64) / count
    return covered, torch.where(inside, 0.0, sums).sum(-2)


def tail_columns(
    index: VerticalSlashIndex, tail_sum: torch.Tensor, seqlen: int, count: int, settings: SpreadSettings
) -> VerticalSlashIndex:
    """``index`` with at most ``tail_columns`` columns added for the ``count`` tail rows (step 5).

    Columns are added by the tail rows' residual mass (:func:`tail_residual`), largest first, while the tail rows'
    covered mass before the pick is below ``recall``.

    Args:
        tail_sum: float32 ``[G, B, Hq, seqlen]`` (``SpreadEvidence``, summed over shards).
    """
    covered, per_key = tail_residual(index, tail_sum, seqlen, count)
    # Ranked in fp32, the sums' own precision (half the radix passes of fp64), then summed up in fp64.
    top = per_key.topk(min(settings.tail_columns, seqlen), dim=-1)
    gain = top.values.double() / count
    before = gain.cumsum(-1) - gain
    keep = (covered[..., None] + before < settings.recall) & (gain > 0)
    added = torch.where(keep, top.indices, PAD)
    return index.with_columns(added)
