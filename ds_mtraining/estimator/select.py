"""Selection pieces the strategies share: recall-driven top-k, token diagonals to block offsets, assembly.

Forced entries (sink columns ``0..sink_tokens-1``, the tiles at offsets ``0..local_blocks-1``) are in the index
whatever the scores say, so they are not candidates (no budget is spent on them), and the mass they already cover
counts toward a recall target. Ranking uses a stable sort, so ties go to the lower candidate index.
"""

from __future__ import annotations

import torch

from ds_mtraining.sparse.index import PAD, VerticalSlashIndex

__all__ = ["assemble_index", "diagonals_to_offsets", "forced_diagonals", "select_by_recall"]


def select_by_recall(scores: torch.Tensor, forced: int, target: float, *, minimum: int, maximum: int) -> torch.Tensor:
    """The fewest top-scoring candidates whose mass, with the forced candidates', reaches ``target``.

    Args:
        scores: float ``[B, Hq, C]``, non-negative candidate scores (mass seen by the observation rows).
        forced: the first ``forced`` candidates are in the index anyway (sinks, diagonals inside the local
            tiles): never selected or counted against the budget, but their mass is credited toward ``target``.
        target: mass to reach (recall × number of observation rows, since each row sums to 1).
        minimum, maximum: the number of selected (non-forced) candidates is clipped into this range, then
            to the number of non-forced candidates.

    Returns:
        LongTensor ``[B, Hq, min(maximum, C - #forced)]``: candidate indices by descending score (ties: lower
        index first), padded with -1 past each head's count.
    """
    forced = min(max(forced, 0), scores.shape[-1])
    free = scores.shape[-1] - forced
    width = max(0, min(maximum, free))
    credit = scores[..., :forced].sum(dim=-1, dtype=torch.float64)  # [B, Hq]
    values, order = scores[..., forced:].sort(dim=-1, descending=True, stable=True)
    reached = credit[..., None] + values.cumsum(dim=-1, dtype=torch.float64)  # after n + 1 picks
    # Smallest n with credit + (sum of the top n) >= target; when never reached it exceeds `free` and the
    # clamp below takes every free candidate.
    need = (credit < target).long() + (reached < target).sum(dim=-1)
    need = need.clamp(min=minimum).clamp(max=min(maximum, free))
    keep = torch.arange(width, device=scores.device) < need[..., None]
    return torch.where(keep, order[..., :width] + forced, PAD)


def forced_diagonals(block_size: int, local_blocks: int) -> int:
    """Number of leading token diagonals whose every block offset is forced (``< max(local_blocks, 1)``).

    A diagonal ``d`` crosses offsets ``d // bs`` and, unless ``d % bs == 0``, ``d // bs + 1``, so the covered
    ones are ``d <= (local_blocks - 1) * bs``; offset 0 is always in the index, so ``d = 0`` always is.
    """
    return (max(local_blocks, 1) - 1) * block_size + 1


def diagonals_to_offsets(diagonals: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Block offsets crossed by token diagonals.

    ``diagonals``: LongTensor ``[B, Hq, K]``, -1 padded. Returns LongTensor ``[B, Hq, 2K]``, -1 padded (not
    canonical): ``d // bs`` and, when the line straddles two tiles (``d % bs != 0``), ``d // bs + 1``;
    offsets ``>= num_blocks`` do not exist and are dropped.
    """
    low = diagonals // block_size
    high = torch.where(diagonals % block_size != 0, low + 1, PAD)
    offsets = torch.cat([low, high], dim=-1)
    valid = (torch.cat([diagonals, diagonals], dim=-1) >= 0) & (offsets >= 0) & (offsets < num_blocks)
    return torch.where(valid, offsets, PAD)


def assemble_index(
    columns: torch.Tensor, diagonals: torch.Tensor, seqlen: int, block_size: int, sink_tokens: int, local_blocks: int
) -> VerticalSlashIndex:
    """Canonical index from selected columns and token diagonals plus the forced sinks and local tiles.

    ``columns``: LongTensor ``[B, Hq, Kv]`` key positions; ``diagonals``: LongTensor ``[B, Hq, Kd]`` token
    distances; both -1 padded. Sinks: keys ``0 .. sink_tokens - 1``; local tiles: offsets ``0 .. local_blocks - 1``.
    """
    batch, heads = columns.shape[:2]
    device = columns.device
    nblocks = -(-seqlen // block_size)
    sinks = torch.arange(min(sink_tokens, seqlen), device=device).expand(batch, heads, -1)
    local = torch.arange(min(local_blocks, nblocks), device=device).expand(batch, heads, -1)
    vertical = torch.cat([sinks, columns], dim=-1)
    slash = torch.cat([local, diagonals_to_offsets(diagonals, block_size, nblocks)], dim=-1)
    return VerticalSlashIndex.build(vertical, slash, block_size)
