"""The spread strategy's recall report: the observation rows' mass inside the index, from what the estimate holds.

``estimator.observe.observed_recall`` would sweep the keys again with the index's mask; here the mass of the tiles
of the index's offsets is the evidence's key-block mass, and its columns add their attention in the rows whose
tile at that column is not one of those.
"""

from __future__ import annotations

import torch

from ds_mtraining.sparse.backends import uses_triton
from ds_mtraining.sparse.index import VerticalSlashIndex

from ..kernels import estimator_kernels
from .geometry import tile_chosen
from .greedy import shear

__all__ = ["index_recall"]


def index_recall(
    index: VerticalSlashIndex, block_mass: torch.Tensor, column_attn: torch.Tensor, rows: torch.Tensor, seqlen: int
) -> torch.Tensor:
    """The rows' attention mass inside ``index``'s mask / their number: float32 ``[B, Hq]``.

    Args:
        block_mass: float32 ``[B, Hq, m, nb]`` (``SpreadEvidence``, summed over shards).
        column_attn: float32 ``[B, Hq, m, Kv]``, the rows' attention at ``index.vertical``
            (``candidate_attention`` with its padding as ``seqlen``, summed over shards).
        rows: LongTensor ``[m]``.

    On CUDA one Triton launch (``estimator.triton.recall``).
    """
    offsets = index.offset_mask(seqlen)  # [B, Hq, nb]
    if uses_triton(block_mass.device):
        return estimator_kernels().recall.index_recall(
            index.vertical, offsets, block_mass, column_attn, rows, index.block_size
        )
    nb = block_mass.shape[-1]
    row_block = rows // index.block_size
    batch, heads = offsets.shape[:2]
    per_offset = shear(block_mass.flatten(0, 1), row_block).view(batch, heads, -1, nb)  # [B, Hq, m, nb]
    slash_mass = torch.where(offsets[:, :, None, :], per_offset, 0.0).sum(-1, dtype=torch.float64)
    col_block = index.vertical.clamp(min=0) // index.block_size  # [B, Hq, Kv]
    under = tile_chosen(offsets, row_block[None, None, :, None] - col_block[:, :, None, :])  # [B, Hq, m, Kv]
    real = (index.vertical >= 0)[:, :, None, :]
    column_mass = torch.where(real & ~under, column_attn, 0.0).sum(-1, dtype=torch.float64)  # non-causal: 0
    return (slash_mass + column_mass).mean(-1).float()
