"""The ``"baseline"`` strategy (the MTraining authors' online budget approximation).

The last ``last_q`` queries of the sequence attend to all keys (``estimator.observe``); every key column is scored
by ``Σ_i A[i, j]`` and every *token* diagonal ``d = p_i - j`` by ``Σ_i A[i, p_i - d]``, and each direction
independently keeps the fewest top candidates that reach its recall target, clipped to its ``[min, max]`` budget.
Chosen diagonals then become the block offsets their lines cross. Both traps described in docs/design.md are
avoided on purpose: the directions do not see each other's residual, and diagonals are selected at token level,
never pooled into ``bs``-wide bands first (a column seen by 64 rows spans 64 diagonals, which pooling would merge
into one band and mistake for a slash line).

The scores are computed on this rank's keys at their global positions and summed over the ranks: a key lives on
one rank, so the column scores add exact zeros; a diagonal meets each row at one key, so its score is the sum, in
fp64, of the rows' parts held by each rank. Both are read with ``gather`` (no atomics), and ranked with a stable
sort.

With packed documents the rows' attention is masked to their documents, so neither score counts a key of another
document, and every document's sinks are forced columns (``estimator.documents``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .documents import document_sinks
from .observe import Observation, key_lookup, observation_attention, observed_recall
from .select import assemble_index, forced_diagonals, select_by_recall
from .strategy import Shard, index_wide

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.sparse.index import VerticalSlashIndex

    from .graphs import GraphCache
    from .reduce import Reducer

__all__ = [
    "BaselineEvidence",
    "BaselineSettings",
    "BaselineStrategy",
    "baseline_select",
    "last_rows",
    "slash_scores",
    "vertical_scores",
]


@dataclass(frozen=True)
class BaselineSettings:
    """The baseline's settings: ``config.BaselineEstimator``'s fields and the index-wide ``block_size``, ``sink_tokens`` and
    ``local_blocks`` (:meth:`of`)."""

    block_size: int
    last_q: int
    column_recall: float
    min_columns: int
    max_columns: int
    diagonal_recall: float
    min_diagonals: int
    max_diagonals: int
    sink_tokens: int
    local_blocks: int

    @classmethod
    def of(cls, config: SparseAttentionConfig) -> BaselineSettings:
        return cls(**index_wide(config), **config.estimator.model_dump(exclude={"strategy"}))


@dataclass(frozen=True)
class BaselineEvidence:
    """The column and token-diagonal scores over all keys (float64 ``[B, Hq, N]``), the observation they come
    from (this rank's part, for the recall report), and the documents' sinks (LongTensor ``[B, K]``, -1 padded;
    ``None`` without documents)."""

    vertical: torch.Tensor
    slash: torch.Tensor
    observation: Observation
    sinks: torch.Tensor | None = None


def last_rows(seqlen: int, last_q: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the last ``m = min(last_q, seqlen)`` queries: LongTensor ``[m]``, ``N - m .. N - 1``."""
    m = min(last_q, seqlen)
    if m < 1:
        raise ValueError(f"need at least one observation row; got last_q={last_q}, seqlen={seqlen}")
    return torch.arange(seqlen - m, seqlen, device=device)


def vertical_scores(attn: torch.Tensor, keys: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Column score ``Σ_i A[i, j]`` of this rank's keys, at their global positions: float64 ``[B, Hq, seqlen]``,
    zero at keys held elsewhere.

    ``attn``: float ``[B, Hq, m, n]`` at the keys at global ``keys [n]`` (positions ``>= seqlen``: padding, which
    lands in a spare slot that is cut off: no boolean indexing, no host sync).
    """
    out = torch.zeros(*attn.shape[:2], seqlen + 1, dtype=torch.float64, device=attn.device)
    out[..., torch.where(keys < seqlen, keys, seqlen)] = attn.sum(dim=-2, dtype=torch.float64)
    return out[..., :seqlen].contiguous()  # contiguous: a collective reduces it


def slash_scores(attn: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Token-diagonal score ``Σ_i A[i, p_i - d]`` for ``d = 0 .. N-1`` over this rank's keys: float64
    ``[B, Hq, seqlen]``.

    ``attn`` is ``[B, Hq, m, n]`` over the observation rows at positions ``rows`` (``[m]``) and the keys at global
    ``keys [n]``. Each row is read backwards from its own position with one ``gather`` (deterministic, unlike an
    atomic ``scatter_add``); diagonals a row cannot reach (``d > p_i``) and keys held elsewhere contribute zero.
    """
    d = torch.arange(seqlen, device=attn.device)
    key = rows[:, None] - d[None, :]  # [m, N]: the global key row i meets on diagonal d
    local = key_lookup(keys, seqlen)[key.clamp(min=0)]  # its column here, -1 if held elsewhere
    sheared = attn.gather(-1, local.clamp(min=0).expand(*attn.shape[:2], -1, -1))
    return torch.where((key >= 0) & (local >= 0), sheared, 0.0).sum(dim=-2, dtype=torch.float64)


def baseline_select(
    vertical: torch.Tensor,
    slash: torch.Tensor,
    rows: int,
    seqlen: int,
    settings: BaselineSettings,
    sinks: torch.Tensor | None = None,
) -> VerticalSlashIndex:
    """The baseline's selection from its scores (float64 ``[B, Hq, N]`` column and token-diagonal scores).

    Columns: top scores until ``column_recall`` of the mass of the ``rows`` observation rows (sinks forced
    and credited), clipped to ``[min_columns, max_columns]``. Diagonals likewise with ``diagonal_recall``
    (diagonals inside the local tiles forced and credited), clipped to ``[min_diagonals, max_diagonals]``.
    ``sinks``: LongTensor ``[B, K]``, the documents' sink columns (-1 padded), added to every head.
    """
    s = settings
    mass = float(rows)  # each row sums to 1
    columns = select_by_recall(
        vertical, s.sink_tokens, s.column_recall * mass, minimum=s.min_columns, maximum=s.max_columns
    )
    diagonals = select_by_recall(
        slash,
        forced_diagonals(s.block_size, s.local_blocks),
        s.diagonal_recall * mass,
        minimum=s.min_diagonals,
        maximum=s.max_diagonals,
    )
    if sinks is not None:
        columns = torch.cat([columns, sinks[:, None].expand(-1, columns.shape[1], -1)], dim=-1)
    return assemble_index(columns, diagonals, seqlen, s.block_size, s.sink_tokens, s.local_blocks)


class BaselineStrategy:
    """The last ``last_q`` rows, each direction on its own (module docstring).

    Not ``graphed``: its evidence materialises the rows' attention ``[B, Hq, m, N]`` several times over (GBs at
    128K), which a graph's private memory pool would keep reserved between estimates.
    """

    graphed = False

    def settings(self, config: SparseAttentionConfig) -> BaselineSettings:
        return BaselineSettings.of(config)

    def rows(self, seqlen: int, settings: BaselineSettings, device: torch.device) -> torch.Tensor:
        return last_rows(seqlen, settings.last_q, device)

    def evidence(self, shard: Shard, settings: BaselineSettings, reducer: Reducer) -> BaselineEvidence:
        """Scores: column ``Σ_i A[i, j]`` and token diagonal ``Σ_i A[i, p_i - d]``, summed over the ranks."""
        rows, keys, seqlen = shard.rows, shard.keys, shard.seqlen
        attn = observation_attention(shard.q_obs, shard.k, rows, keys, shard.softmax_scale, reducer, shard.row_starts)
        vertical, slash = vertical_scores(attn, keys, seqlen), slash_scores(attn, rows, keys, seqlen)
        reducer.sum_(vertical)
        reducer.sum_(slash)
        s = settings
        sinks = None
        if shard.starts is not None:
            sinks = document_sinks(shard.starts, s.sink_tokens, s.block_size, s.local_blocks, s.max_columns)
        return BaselineEvidence(vertical, slash, Observation(rows, attn, keys, seqlen), sinks)

    def select(
        self,
        evidence: BaselineEvidence,
        settings: BaselineSettings,
        reducer: Reducer,
        report: bool,
        graphs: GraphCache | None,
    ) -> tuple[VerticalSlashIndex, torch.Tensor | None]:
        """:func:`baseline_select`; the recall from the rows' attention at every rank's keys (the parts add up)."""
        seen = evidence.observation
        index = baseline_select(
            evidence.vertical, evidence.slash, seen.rows.numel(), seen.seqlen, settings, evidence.sinks
        )
        if not report:
            return index, None
        recall = observed_recall(index, seen)
        reducer.sum_(recall)
        return index, recall
