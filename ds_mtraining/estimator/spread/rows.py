"""The spread strategy's observation rows: staggered rows over the whole sequence, then the tail rows."""

from __future__ import annotations

import torch

__all__ = ["observation_rows", "row_counts", "spread_rows", "tail_rows"]

_LANE_STEP = 37
"""In-block position of row ``i`` is ``i * 37 mod bs``: coprime with 64 and 128, so ``bs`` consecutive rows
take every in-block position once, and neighbouring rows sit far apart inside their blocks."""


def spread_rows(seqlen: int, count: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Observation row positions: LongTensor ``[m]``, ``m = min(count, seqlen)``, strictly increasing.

    Row ``i`` lies in segment ``[i N / m, (i + 1) N / m)``, at in-block position ``i * 37 mod bs`` (the last such
    position in its segment; the segment's end when the segment holds none); the last row is ``N - 1``, the end of
    the last segment. The segments are disjoint, ordered and (``m <= N``) never empty, so the rows are strictly
    increasing by construction: no sort, no ``unique`` (which synchronises with the host).
    """
    if count < 1 or seqlen < 1:
        raise ValueError(f"spread_rows needs count >= 1 and seqlen >= 1; got count={count}, seqlen={seqlen}")
    m = min(count, seqlen)
    i = torch.arange(m, device=device)
    start, end = i * seqlen // m, (i + 1) * seqlen // m - 1
    lane = i * _LANE_STEP % block_size
    row = end - (end - lane) % block_size  # the largest p <= end with p % bs == lane
    row = torch.where(row >= start, row, end)
    return torch.where(i == m - 1, seqlen - 1, row)


def tail_rows(seqlen: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """The last ``min(count, seqlen)`` positions: LongTensor ``[T]`` (empty when ``count`` is 0)."""
    return torch.arange(max(seqlen - count, 0), seqlen, device=device)


def row_counts(seqlen: int, count: int, tail: int) -> tuple[int, int]:
    """How many rows :func:`observation_rows` gives of each kind: staggered ``m`` and tail ``T``."""
    return min(count, seqlen), min(tail, seqlen)


def observation_rows(
    seqlen: int, count: int, tail: int, block_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """:func:`spread_rows` then :func:`tail_rows`: LongTensor ``[m + T]`` (:func:`row_counts`), each part
    ascending."""
    return torch.cat([spread_rows(seqlen, count, block_size, device), tail_rows(seqlen, tail, device)])
