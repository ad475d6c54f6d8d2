"""Adding columns to a canonical index row by merging, not sorting (``VerticalSlashIndex.with_columns`` on CUDA).

The index's rows are already canonical (ascending, distinct, -1 after), so each entry's place in the merged row is
its rank: a kept row entry moves right by the new columns below it, a new column lands after the row entries and
new columns below it. The row entries below a new column come from a binary search of the sorted row, so the work
splits into programs of one chunk of the row each (at 128K tokens on an H200, 16 rows of 2116 + 64: 0.012 ms, where
one program per row took 0.054). In PyTorch the same merge is a sort of the concatenation plus a compaction: about
a dozen launches (0.057 ms), where this is one.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["merge_columns"]

_CHUNK = 128  # row positions per program
_NEW = 256
"""Most new columns one launch merges: its duplicate test compares them pairwise (a ``[BLOCK_B, BLOCK_B]`` block,
past Triton's limit of 2**20 elements beyond 1024). More are merged in launches of this many: packed documents'
sinks add up to ``max_columns`` (2048) at once."""
_PAST = tl.constexpr(2**62)  # above every position: a search for it counts the row's entries


@triton.jit
def count_below(ROW, ka, x, steps):
    """Entries of the canonical row ``ROW[:ka]`` below each of ``x`` (binary search; the -1s after the entries
    compare as past every position)."""
    lo = tl.zeros_like(x)
    hi = lo + ka
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(ROW + mid, mask=active, other=-1)
        below = (v >= 0) & (v < x)
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    return lo


@triton.jit
def _merge_kernel(ROW, NEW, OUT, ka, kb, steps, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ROW += r * ka
    NEW += r * kb
    OUT += r * (ka + kb)
    j = tl.arange(0, BLOCK_B)
    new = tl.load(NEW + j, mask=j < kb, other=-1)
    # A new column counts once: not -1, not already in the row, not equal to an earlier new column.
    dup = tl.sum(((new[None, :] == new[:, None]) & (j[None, :] < j[:, None])).to(tl.int32), 1) > 0
    row_below = count_below(ROW, ka, new, steps)
    held = tl.load(ROW + row_below, mask=(new >= 0) & (row_below < ka), other=-1) == new
    keep = (new >= 0) & ~dup & ~held
    if chunk == 0:
        new_below = tl.sum((keep[None, :] & (new[None, :] < new[:, None])).to(tl.int32), 1)
        tl.store(OUT + row_below + new_below, new, mask=keep)
    i = chunk * BLOCK_A + tl.arange(0, BLOCK_A)
    a = tl.load(ROW + i, mask=i < ka, other=-1)
    shift = tl.sum((keep[None, :] & (new[None, :] < a[:, None])).to(tl.int32), 1)
    tl.store(OUT + i + shift, a, mask=a >= 0)
    # Entries and kept columns fill the first `total` places (written above, by whichever program holds them).
    entries = tl.sum(count_below(ROW, ka, tl.full([1], _PAST, tl.int64), steps), 0)
    total = entries + tl.sum(keep.to(tl.int32), 0)
    tl.store(OUT + i, tl.full([BLOCK_A], -1, tl.int64), mask=(i >= total) & (i < ka + kb))


def merge_columns(row: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Canonical rows of ``row`` plus ``new``: LongTensor ``[..., Ka + Kb]``, ascending, distinct, -1 after.

    Args:
        row: LongTensor ``[..., Ka]``, canonical rows (ascending, distinct, -1 after them): an index's ``vertical``.
        new: LongTensor ``[..., Kb]``, columns in any order, -1 for none; duplicates and columns already in
            ``row`` count once. One launch per 256 of them.
    """
    if row.dtype != torch.long or new.dtype != torch.long or row.shape[:-1] != new.shape[:-1]:
        raise ValueError(
            f"merge_columns: row [..., Ka] and new [..., Kb] must be LongTensors of the same leading shape; got "
            f"{row.dtype} {tuple(row.shape)} and {new.dtype} {tuple(new.shape)}"
        )
    if new.shape[-1] > _NEW:  # the merged rows stay canonical, so the next part merges into them
        for part in new.split(_NEW, dim=-1):
            row = merge_columns(row, part)
        return row
    ka, kb = row.shape[-1], new.shape[-1]
    count = math.prod(row.shape[:-1])
    out = torch.empty(count, ka + kb, dtype=torch.long, device=row.device)
    if out.numel():
        _merge_kernel[(count, triton.cdiv(ka + kb, _CHUNK))](
            row.reshape(count, ka).contiguous(),
            new.reshape(count, kb).contiguous(),
            out,
            ka,
            kb,
            ka.bit_length(),
            BLOCK_A=_CHUNK,
            BLOCK_B=triton.next_power_of_2(max(kb, 1)),
        )
    return out.view(*row.shape[:-1], ka + kb)
