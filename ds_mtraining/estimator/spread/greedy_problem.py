"""What the spread greedy's PyTorch rounds (``spread.greedy``) and Triton rounds (``estimator.triton.greedy``)
share: the problem every round reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GreedyProblem"]


@dataclass(frozen=True)
class GreedyProblem:
    """The greedy's inputs flattened over ``G = B·Hq`` and what every round reads; ``chosen_*`` are the forced
    entries (offsets ``< local_blocks``, the sinks), updated in place by the rounds."""

    cand: torch.Tensor  # LongTensor [G, Kc], ascending, padding = seqlen
    # fp32-exact values in the rounds' dtype: float64 for the PyTorch rounds, float32 for the Triton kernels
    # (which sum in fp64 themselves).
    attn: torch.Tensor  # [G, m, Kc]
    mass: torch.Tensor  # [G, m, nb]: row i's key-block mass at offset s
    bounds: tuple[torch.Tensor, torch.Tensor]  # [G, nb]: each key block's candidate range [lo, hi)
    off_scale: torch.Tensor  # float64 [nb]: sampled rows -> all rows an offset covers
    tail: int  # rows of the last (possibly partial) block
    sinks: int
    forced_off: int
    chosen_off: torch.Tensor  # bool [G, nb]
    chosen_col: torch.Tensor  # bool [G, Kc]
