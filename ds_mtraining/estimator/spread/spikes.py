"""A column's spikes: the largest row contributions its evidence drops (the evidence, candidates and greedy share
the rule, in PyTorch and in Triton).

A diagonal crosses a key in one row, and two diagonals can meet there in two; a column holds mass in every row.
So a column is judged by its mean over the rows with its :data:`SPIKES` largest entries dropped.
"""

from __future__ import annotations

import torch

__all__ = ["SPIKES", "spikes"]

SPIKES = 2
"""Largest row contributions a column's evidence drops (:func:`spikes`)."""


def spikes(entries: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of the two largest of the non-negative ``entries`` along ``dim`` (``SPIKES = 2``).

    Two max passes instead of ``topk``, which is an order of magnitude slower along a strided dim on GPU; an
    exact tie for the largest counts once (the second is then the next smaller value).
    """
    first = entries.amax(dim=dim, keepdim=True)
    second = torch.where(entries < first, entries, 0.0).amax(dim=dim)
    return first.squeeze(dim) + second
