"""Online index estimation on a sharded sequence: every ring rank ends with the same global index.

The estimate is the single-device code path (``estimator.estimate.estimate``) with a :class:`RingReducer`: the
observation rows' queries are gathered from whichever ranks hold them under the layout (one ``all_reduce`` of a
small ``[B, m, Hq, D]`` buffer), each rank scores them against its local keys, and the strategy's evidence (the
softmax statistics, then the baseline's column and diagonal scores, or the spread's block mass, column evidence
and candidates' attention) is combined with all-reduces over the ring. Row sums and the baseline's diagonal
scores are reduced in float64; everything else is per key or key block, each held by one rank, so its reductions
add exact zeros. The order in which shards add up does not change any selection: the result equals
``estimate_index`` on the unsharded q/k. A collective of the estimate that passes the ring group's timeout raises
``comm.CommTimeoutError`` ("all-reduce in the index estimator with rank ...").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..estimator.estimate import EstimateReport, check_inputs, estimate
from .comm import RingGroups, current_layer, deadline
from .layout import Layout

if TYPE_CHECKING:
    from ..config import SparseAttentionConfig
    from ..estimator.graphs import GraphCache
    from ..sparse.index import VerticalSlashIndex
    from ..sparse.pattern import AttentionPattern

__all__ = ["RingReducer", "estimate_index_distributed"]


@dataclass(frozen=True)
class RingReducer:
    """The estimator's reducer (``estimator.reduce.Reducer``) for a layout shard: all-reduces over ``group``.

    Attributes:
        group: the ring's process group (every rank holds one shard of the keys).
        keys: LongTensor ``[n]``, the global positions this rank holds (``Layout.positions_on``), below
            ``padded_len``; those ``>= seqlen`` are padding.
        seqlen: tokens in the whole sequence; padded_len: after the layout's padding.
    """

    group: dist.ProcessGroup
    keys: torch.Tensor
    seqlen: int
    padded_len: int

    @property
    def sharded(self) -> bool:
        return True

    def gather_rows(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The queries at global ``rows [m]``: float32 ``[B, m, Hq, D]`` on every rank. Each rank fills the rows it
        holds and zeros elsewhere (a ``where``, no boolean indexing: no host sync); each row is held by exactly one
        rank, so the sum is a copy."""
        local = torch.full((self.padded_len,), -1, dtype=torch.long, device=q.device)
        local[self.keys] = torch.arange(self.keys.numel(), device=q.device)
        where = local[rows]
        mine = (where >= 0)[None, :, None, None]
        q_obs = torch.where(mine, q.index_select(1, where.clamp(min=0)).float(), 0.0)
        self.sum_(q_obs)
        return q_obs

    def sum_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)

    def max_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)


@torch.no_grad()
def estimate_index_distributed(
    q: torch.Tensor,
    k: torch.Tensor,
    config: SparseAttentionConfig,
    *,
    groups: RingGroups,
    layout: Layout,
    softmax_scale: float | None = None,
    return_report: bool = False,
    layer: int | None = None,
    graphs: GraphCache | None = None,
    pattern: AttentionPattern | None = None,
) -> VerticalSlashIndex | tuple[VerticalSlashIndex, EstimateReport]:
    """``estimate_index`` for a sequence sharded over a ring; collective over ``groups.ring``.

    Args:
        q: ``[B, n, Hq, D]``, this rank's layout shard of the queries (``n = layout.local_len``).
        k: ``[B, n, Hkv, D]``, the same shard of the keys.
        config: as for ``estimate_index`` (any strategy of ``estimator.ESTIMATORS``).
        groups, layout: the ring and the layout the shards were cut with; shard = ``groups.rank``.
        layer: the model layer, for a ``CommTimeoutError`` (default: ``comm.current_layer()``).
        graphs: where the parts of the estimate free of collectives (the spread greedy) replay a CUDA graph;
            ``None``: no replay.
        pattern: the whole rows' pattern without an index (``AttentionPattern(layout.seqlen, documents=...)``, the
            same on every rank, like the ring attention's): the estimate stays inside its documents; ``None``: one
            sequence a row.

    Returns:
        The global index (identical on every rank), and the report if ``return_report``.
    """
    layer = current_layer(layer)
    # Every collective of the estimate (the reducer's, called from the estimator) is an all-reduce on the ring.
    with deadline("all-reduce in the index estimator", group=groups.ring, layer=layer):
        documents = check_inputs(q, k, config, pattern, layout.seqlen)
        if q.shape[1] != layout.local_len:
            raise ValueError(f"q must be this rank's shard of {layout.local_len} tokens; got {tuple(q.shape)}")
        positions = layout.positions_on(groups.rank, q.device)
        reducer = RingReducer(groups.ring, positions, layout.seqlen, layout.padded_len)
        return estimate(
            q,
            k,
            config,
            reducer,
            softmax_scale=softmax_scale,
            return_report=return_report,
            graphs=graphs,
            documents=documents,
        )
