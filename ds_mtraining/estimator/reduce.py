"""How an estimate's parts on one rank's keys become the whole sequence's: the reducer a caller injects.

Every strategy computes its evidence on the keys this rank holds and combines the parts through a
:class:`Reducer`, so one code path serves one device and a ring: on one device (:class:`LocalReducer`) the keys are
the whole sequence and every reduction is the identity; on a ring (``parallel.estimate.RingReducer``) they are the
rank's layout shard and the reductions are all-reduces over the ring's process group. Each key lives on exactly one
rank, so a sum of per-key parts adds exact zeros and every rank ends with the same evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["LocalReducer", "Reducer"]


class Reducer(Protocol):
    """Where this rank's keys sit in the sequence, how the observation rows' queries reach it, how parts combine.

    Attributes:
        seqlen: tokens in the whole sequence.
        keys: LongTensor ``[n]``, global positions of the keys this rank holds, in the order of its ``k``
            (positions ``>= seqlen`` are padding).
        sharded: whether the reductions are collectives; a CUDA graph cannot capture those, so the estimate is
            replayed from one only when this is False.
    """

    seqlen: int
    keys: torch.Tensor

    @property
    def sharded(self) -> bool: ...

    def gather_rows(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The queries at global positions ``rows [m]`` from this rank's ``q [B, n, Hq, D]``: ``[B, m, Hq, D]`` on
        every rank (the queries' dtype, or float32)."""
        ...

    def sum_(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place."""
        ...

    def max_(self, x: torch.Tensor) -> None:
        """Maximum of ``x`` over the ranks, in place."""
        ...


@dataclass(frozen=True)
class LocalReducer:
    """One device holds the whole sequence: keys ``0 .. N-1``, the rows picked from ``q``, every reduction a no-op.

    Attributes:
        seqlen: ``N``; keys: LongTensor ``[N]``, ``arange(N)`` (:meth:`of`).
    """

    seqlen: int
    keys: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor) -> LocalReducer:
        """The reducer for the whole sequence ``q [B, N, Hq, D]`` on its device."""
        return cls(q.shape[1], torch.arange(q.shape[1], device=q.device))

    @property
    def sharded(self) -> bool:
        return False

    def gather_rows(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return q.index_select(1, rows)

    def sum_(self, x: torch.Tensor) -> None:
        pass

    def max_(self, x: torch.Tensor) -> None:
        pass
