"""Online index estimation on a sharded sequence: every ring rank ends with the same global index.

The observation rows' queries are gathered from whichever ranks hold them under the layout (one
``all_reduce`` of a small ``[B, m, Hq, D]`` buffer), each rank scores them against its local keys, and the
softmax normalisation and the strategy's scores (baseline: column and diagonal sums; spread: block mass,
column evidence and the candidates' attention) are combined with collectives. Row sums and the baseline's
scores are reduced in float64; the spread evidence is per key or key block, each held by one rank, so its
reductions add exact zeros. The order in which shards add up does not change any selection: the result equals
``estimate_index`` on the unsharded q/k, and the selection itself is the single-device code. A collective of
the estimate that passes the ring group's timeout raises ``comm.CommTimeoutError`` ("all-reduce in the index
estimator with rank ...").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..sparse.estimate import EstimateReport, baseline_select, check_inputs
from ..sparse.index import VerticalSlashIndex
from ..sparse.observe import (
    Observation,
    last_rows,
    normalise,
    observation_logits,
    observed_recall,
    reduce_row_statistics,
    row_statistics,
)
from ..sparse.spread import observation_rows, observe_rows, spread_index
from .comm import RingGroups, current_layer, deadline
from .layout import Layout

if TYPE_CHECKING:
    from ..config import SparseAttentionConfig


def _gather_rows(q: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, padded_len: int, group) -> torch.Tensor:
    """The queries at global ``rows`` from whichever rank holds each: fp32 ``[B, m, Hq, D]`` on every rank
    (``positions``: this rank's, all below ``padded_len``)."""
    local = torch.full((padded_len,), -1, dtype=torch.long, device=q.device)
    local[positions] = torch.arange(positions.numel(), device=q.device)
    where = local[rows]
    mine = where >= 0
    q_obs = torch.zeros(q.shape[0], rows.numel(), *q.shape[2:], dtype=torch.float32, device=q.device)
    q_obs[:, mine] = q[:, where[mine]].float()
    dist.all_reduce(q_obs, group=group)  # each row is held by exactly one rank: the sum is a copy
    return q_obs


def _attention(
    q_obs: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, scale: float, group
) -> torch.Tensor:
    """This shard's part of the rows' attention, normalised over all keys: float32 ``[B, Hq, m, n]``."""
    logits = observation_logits(q_obs, k, rows, positions, scale)
    row_max, row_sum = row_statistics(logits)
    reduce_row_statistics(row_max, row_sum, group)
    return normalise(logits, row_max, row_sum)


def _slash_partial(attn: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, seqlen: int) -> torch.Tensor:
    """This shard's part of ``Σ_i A[i, p_i - d]``: float64 ``[B, Hq, seqlen]``."""
    d = rows[:, None] - keys[None, :]  # [m, n]
    valid = (d >= 0) & (keys[None, :] < seqlen)
    weights = torch.where(valid, attn, 0.0).double().flatten(2)
    out = torch.zeros(*attn.shape[:2], seqlen, dtype=torch.float64, device=attn.device)
    return out.scatter_add_(-1, d.clamp(min=0).flatten().expand_as(weights), weights)


def _baseline(
    attn: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    seqlen: int,
    config: SparseAttentionConfig,
    group: dist.ProcessGroup,
) -> VerticalSlashIndex:
    """Column and token-diagonal scores summed over the shards, then the single-device selection."""
    real = positions < seqlen
    vertical = torch.zeros(*attn.shape[:2], seqlen, dtype=torch.float64, device=attn.device)
    vertical[..., positions[real]] = attn[..., real].sum(dim=-2, dtype=torch.float64)
    slash = _slash_partial(attn, rows, positions, seqlen)
    dist.all_reduce(vertical, group=group)
    dist.all_reduce(slash, group=group)
    return baseline_select(vertical, slash, rows.numel(), seqlen, config)


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
) -> VerticalSlashIndex | tuple[VerticalSlashIndex, EstimateReport]:
    """``estimate_index`` for a sequence sharded over a ring; collective over ``groups.ring``.

    Args:
        q: ``[B, n, Hq, D]``, this rank's layout shard of the queries (``n = layout.local_len``).
        k: ``[B, n, Hkv, D]``, the same shard of the keys.
        config: as for ``estimate_index`` (strategies ``"baseline"`` and ``"spread"``).
        groups, layout: the ring and the layout the shards were cut with; shard = ``groups.rank``.
        layer: the model layer, for a ``CommTimeoutError`` (default: ``comm.current_layer()``).

    Returns:
        The global index (identical on every rank), and the report if ``return_report``.
    """
    layer = current_layer(layer)
    # Every collective of the estimate (here and in sparse.observe / sparse.spread) is an all-reduce on the ring.
    with deadline("all-reduce in the index estimator", group=groups.ring, layer=layer):
        return _estimate(q, k, config, groups, layout, softmax_scale, return_report)


def _estimate(q, k, config, groups, layout, softmax_scale, return_report):
    check_inputs(q, k, config)
    if q.shape[1] != layout.local_len:
        raise ValueError(f"q must be this rank's shard of {layout.local_len} tokens; got {tuple(q.shape)}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number; got {softmax_scale!r}")
    seqlen, group = layout.seqlen, groups.ring
    positions = layout.positions_on(groups.rank, q.device)
    recall = None
    if config.estimator == "spread":
        rows, tail = observation_rows(seqlen, config.spread_rows, config.spread_tail_rows, config.block_size, q.device)
        observed = torch.cat([rows, tail])
        q_obs = _gather_rows(q, positions, observed, layout.padded_len, group)
        statistics = observe_rows(q_obs, k, observed, positions, scale, group)
        index, recall = spread_index(
            q_obs, k, rows, tail, positions, seqlen, config, scale, statistics, group, observe=return_report
        )
    else:
        rows = last_rows(seqlen, config.last_q, q.device)
        attn = _attention(_gather_rows(q, positions, rows, layout.padded_len, group), k, rows, positions, scale, group)
        index = _baseline(attn, rows, positions, seqlen, config, group)
        if return_report:
            recall = observed_recall(index, Observation(rows, attn, positions, seqlen))
            dist.all_reduce(recall, group=group)
    if not return_report:
        return index
    return index, EstimateReport(recall=recall, density=index.density(seqlen))
