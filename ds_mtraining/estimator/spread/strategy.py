"""The ``"spread"`` strategy's steps put together (the rules are in the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_mtraining.sparse.index import VerticalSlashIndex

from ..documents import document_sinks
from ..strategy import Shard
from .candidates import candidate_attention, candidate_columns
from .evidence import RowStatistics, SpreadEvidence, observe_rows, shard_evidence, whole_blocks
from .greedy import select
from .report import index_recall
from .rows import observation_rows, row_counts
from .settings import SpreadSettings
from .tail import tail_columns

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig

    from ..graphs import GraphCache
    from ..reduce import Reducer

__all__ = ["SpreadObservation", "SpreadStrategy"]


@dataclass(frozen=True)
class SpreadObservation:
    """What the spread selection reads: the shard in whole blocks (its rows: ``m`` staggered rows, then
    ``tail`` tail rows), the rows' statistics over all keys, and the evidence summed over the ranks."""

    shard: Shard
    tail: int
    statistics: RowStatistics
    evidence: SpreadEvidence


class SpreadStrategy:
    """Rows spread over the sequence, a cost-aware greedy over both families, a tail repair (package docstring).

    ``graphed``: every step is sync-free, and on CUDA the evidence never materialises the rows' attention.
    """

    graphed = True

    def settings(self, config: SparseAttentionConfig) -> SpreadSettings:
        return SpreadSettings.of(config)

    def rows(self, seqlen: int, settings: SpreadSettings, device: torch.device) -> torch.Tensor:
        """The staggered rows, then the tail rows (``spread.rows.observation_rows``)."""
        return observation_rows(seqlen, settings.rows, settings.tail_rows, settings.block_size, device)

    def evidence(self, shard: Shard, settings: SpreadSettings, reducer: Reducer) -> SpreadObservation:
        """Steps 1-2: every row's statistics in one sweep, then the evidence (``spread.evidence``)."""
        shard = whole_blocks(shard, settings.block_size)
        _, tail = row_counts(shard.seqlen, settings.rows, settings.tail_rows)
        statistics = observe_rows(
            shard.q_obs, shard.k, shard.rows, shard.keys, shard.softmax_scale, reducer, shard.row_starts
        )
        evidence = shard_evidence(shard, statistics, settings.block_size, settings.exclusion, tail, reducer)
        return SpreadObservation(shard, tail, statistics, evidence)

    def select(
        self,
        observation: SpreadObservation,
        settings: SpreadSettings,
        reducer: Reducer,
        report: bool,
        graphs: GraphCache | None,
    ) -> tuple[VerticalSlashIndex, torch.Tensor | None]:
        """Steps 3-5: candidates and their attention (summed over the ranks), the greedy, the documents' sinks
        (``estimator.documents``), the tail columns; with ``report`` the staggered rows' recall of the index
        (``spread.report.index_recall``)."""
        shard, evidence, tail = observation.shard, observation.evidence, observation.tail
        seqlen, scale, m = shard.seqlen, shard.softmax_scale, shard.rows.numel() - tail
        rows, q_rows, k, keys = shard.rows[:m], shard.q_obs[:, :m], shard.k, shard.keys
        row_max, row_sum = observation.statistics.row_max[..., :m], observation.statistics.row_sum[..., :m]
        row_starts = None if shard.starts is None else shard.row_starts[:, :m]

        candidates = candidate_columns(evidence, rows, seqlen, settings)
        cand_attn = candidate_attention(q_rows, k, rows, keys, candidates, row_max, row_sum, scale, seqlen, row_starts)
        reducer.sum_(cand_attn)
        index = select(evidence.block_mass, candidates, cand_attn, rows, seqlen, settings, graphs, shard.starts)
        if shard.starts is not None:
            s = settings
            sinks = document_sinks(shard.starts, s.sink_tokens, s.block_size, s.local_blocks, s.max_columns)
            index = index.with_columns(sinks[:, None].expand(-1, index.heads, -1))
        if tail:
            index = tail_columns(index, evidence.tail_sum, seqlen, tail, settings)
        if not report:
            return index, None
        columns = torch.where(index.vertical >= 0, index.vertical, seqlen)
        column_attn = candidate_attention(q_rows, k, rows, keys, columns, row_max, row_sum, scale, seqlen, row_starts)
        reducer.sum_(column_attn)
        return index, index_recall(index, evidence.block_mass, column_attn, rows, seqlen)
