"""The interface every estimation strategy implements, and what its steps read.

A strategy turns a few observation rows into an index in three steps, each batched over batch and heads,
sync-free and deterministic:

1. :meth:`Strategy.rows`: which rows to observe for a sequence length (global positions);
2. :meth:`Strategy.evidence`: what those rows' exact attention says about the keys (the rows' queries gathered to
   every rank, scored against this rank's keys, the parts combined by the caller's reducer);
3. :meth:`Strategy.select`: the index from the evidence, and optionally the rows' recall of it.

The steps never ask where the keys are: one device and a ring run the same code, with a different
:class:`~ds_mtraining.estimator.reduce.Reducer`. A strategy reads its settings from the layer's config in one place
(:meth:`Strategy.settings`) and its steps take those settings only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.sparse.index import VerticalSlashIndex

    from .graphs import GraphCache
    from .reduce import Reducer

__all__ = ["Shard", "Strategy", "index_wide"]

Settings = TypeVar("Settings")
Evidence = TypeVar("Evidence")


@dataclass(frozen=True)
class Shard:
    """What one rank estimates from: every observation row's query against the keys it holds.

    Attributes:
        q_obs: ``[B, m, Hq, D]``, the queries at ``rows`` (gathered from every rank), any float dtype.
        k: ``[B, n, Hkv, D]``, this rank's keys (all keys on one device), ``Hq % Hkv == 0``.
        keys: LongTensor ``[n]``, their global positions (positions ``>= seqlen`` are padding).
        rows: LongTensor ``[m]``, the rows' global positions (:meth:`Strategy.rows`).
        seqlen: tokens in the whole sequence.
        softmax_scale: logit scale.
        starts: LongTensor ``[B, seqlen]``, the whole rows' document starts (``Documents.starts``, the same on
            every rank), or ``None`` for one sequence a row.
    """

    q_obs: torch.Tensor
    k: torch.Tensor
    keys: torch.Tensor
    rows: torch.Tensor
    seqlen: int
    softmax_scale: float
    starts: torch.Tensor | None = None

    @property
    def row_starts(self) -> torch.Tensor | None:
        """The rows' document starts: LongTensor ``[B, m]`` (``None`` without documents); a row sees only the keys
        ``row_starts <= j <= rows`` (``estimator.observe.visible``)."""
        return None if self.starts is None else self.starts.index_select(1, self.rows)


class Strategy(Protocol[Settings, Evidence]):
    """An estimation strategy (registered in ``estimator.estimate.ESTIMATORS`` under ``config.estimator.strategy``).

    Attributes:
        graphed: whether its evidence and selection may be replayed from one CUDA graph (with the identity
            reducer and a caller's ``GraphCache``): sync-free, and a working set small enough for a graph's
            private memory pool to keep.
    """

    graphed: bool

    def settings(self, config: SparseAttentionConfig) -> Settings:
        """The strategy's settings, read from the layer's config: the only place it reads the config."""
        ...

    def rows(self, seqlen: int, settings: Settings, device: torch.device) -> torch.Tensor:
        """Global positions of the observation rows of a ``seqlen``-token sequence: LongTensor ``[m]``."""
        ...

    def evidence(self, shard: Shard, settings: Settings, reducer: Reducer) -> Evidence:
        """What the rows' attention says about the keys, combined over the ranks by ``reducer`` (every rank ends
        with the same evidence)."""
        ...

    def select(
        self, evidence: Evidence, settings: Settings, reducer: Reducer, report: bool, graphs: GraphCache | None
    ) -> tuple[VerticalSlashIndex, torch.Tensor | None]:
        """The canonical index ``[B, Hq, ·]`` from ``evidence``, and with ``report`` the observation rows' mass inside
        it / their number, float32 ``[B, Hq]`` (else ``None``). ``graphs``: where a step that is not already inside
        a captured graph may replay one (``None``: no replay)."""
        ...


def index_wide(config: SparseAttentionConfig) -> dict[str, int]:
    """The settings every strategy reads from the top of ``sparse_attention`` rather than from its ``estimator``:
    ``block_size``, ``sink_tokens``, ``local_blocks`` (a strategy's settings are these plus its estimator's keys)."""
    return {"block_size": config.block_size, "sink_tokens": config.sink_tokens, "local_blocks": config.local_blocks}
