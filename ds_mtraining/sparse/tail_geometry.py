"""Where the ``"spread"`` estimator's tail rows fall: shared by ``sparse.spread`` and ``sparse.triton.evidence``."""

from __future__ import annotations


def tail_blocks(seqlen: int, count: int, block_size: int) -> tuple[int, int]:
    """The query blocks the last ``count`` positions fall in: the first one and how many (0, 0 without a tail)."""
    count = min(count, seqlen)
    if count == 0:
        return 0, 0
    first = (seqlen - count) // block_size
    return first, (seqlen - 1) // block_size - first + 1
