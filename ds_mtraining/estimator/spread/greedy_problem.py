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
    # What a pick costs, inside documents (without documents, the whole row is one):
    span: torch.Tensor  # LongTensor [G, Kc]: a column's rows below its block lie at offsets 1 .. span
    last_rows: torch.Tensor  # LongTensor [G, Kc]: the column's rows at offset span (bs but at a document's end)
    off_rows: torch.Tensor  # LongTensor [G, nb]: rows whose tile at offset s is in their document
    off_scale: torch.Tensor  # float64 [G, nb]: sampled rows -> all rows an offset covers
    row_start: torch.Tensor  # LongTensor [G, m]: the sampled rows' document starts (0 without documents)
    documents: bool  # packed rows; without, the Triton rounds compile the closed forms of one document a row
    sinks: int
    forced_off: int
    chosen_off: torch.Tensor  # bool [G, nb]
    chosen_col: torch.Tensor  # bool [G, Kc]
