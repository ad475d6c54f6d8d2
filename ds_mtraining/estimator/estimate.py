"""Online budget approximation: estimate a :class:`VerticalSlashIndex` from a few observation rows.

Every forward, per layer and head, a handful of query rows (the *observation rows*) attend to all keys and the
index that should hold for *all* rows is predicted from their attention alone. :func:`estimate` is the one code
path: the strategy picked by ``config.estimator.strategy`` (:data:`ESTIMATORS`) chooses the rows, the caller's reducer
brings their queries to this rank and combines the strategy's evidence over the ranks, and the strategy selects
the index. On one device (:func:`estimate_index`) the reducer is the identity; on a ring
(``parallel.estimate``) it all-reduces over the ring, and every rank ends with the same index.

Layout: q ``[B, n, Hq, D]``, k ``[B, n, Hkv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads kv head
``h // (Hq // Hkv)``. Everything here runs under ``torch.no_grad`` (the index is not differentiable) and is
deterministic: no atomics, stable sorts, fp64 where sums over shards meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_mtraining.sparse.documents import Documents
from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.pattern import AttentionPattern
from ds_mtraining.sparse.scale import resolve_softmax_scale

from .baseline import BaselineStrategy
from .graphs import GraphCache, config_key
from .reduce import LocalReducer, Reducer
from .spread.strategy import SpreadStrategy
from .strategy import Shard, Strategy

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig

__all__ = ["ESTIMATORS", "EstimateReport", "check_inputs", "estimate", "estimate_index"]


@dataclass(frozen=True)
class EstimateReport:
    """How well the estimated index covers what the estimator saw, and what it costs.

    Attributes:
        recall: float32 ``[B, Hq]``, observed-row softmax mass inside the index's mask / number of observed rows.
        density: float64 ``[B, Hq]``, attended fraction of the ``N (N + 1) / 2`` causal entries; with packed
            documents, of the in-document causal entries ``Σ_documents L (L + 1) / 2``, counting what the index
            attends inside the documents (:meth:`VerticalSlashIndex.density`), as the kernels compute it.
    """

    recall: torch.Tensor
    density: torch.Tensor


ESTIMATORS: dict[str, Strategy] = {"baseline": BaselineStrategy(), "spread": SpreadStrategy()}
"""Estimation strategies by ``SparseAttentionConfig.estimator``."""


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    config: SparseAttentionConfig,
    pattern: AttentionPattern | None = None,
    seqlen: int | None = None,
) -> Documents | None:
    """Shapes, dtypes, devices and config of an estimation call; raises with the problem and the fix. Returns the
    pattern's documents.

    ``pattern`` (no index: the estimate fills it) must cover the whole rows: ``seqlen`` tokens (q's length by
    default; a ring passes the global one)."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"estimate_index: {name} must be a 4-D tensor [B, N, H, D]; got {got}")
        if not t.is_floating_point():
            raise TypeError(f"estimate_index: {name} must have a floating dtype; got {t.dtype}")
    if q.device != k.device:
        raise ValueError(f"estimate_index: q is on {q.device} but k is on {k.device}; move them to one device")
    (bq, nq, hq, dq), (bk, nk, hkv, dk) = q.shape, k.shape
    if (bq, nq, dq) != (bk, nk, dk):
        raise ValueError(
            f"estimate_index: q [B, N, Hq, D] = {tuple(q.shape)} and k [B, N, Hkv, D] = {tuple(k.shape)} must agree "
            "on B, N and D"
        )
    if nq == 0:
        raise ValueError("estimate_index: the sequence is empty (N = 0)")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"estimate_index: query heads Hq={hq} must be a multiple of kv heads Hkv={hkv} (GQA: head h reads kv "
            "head h // (Hq // Hkv))"
        )
    if config.pattern == "dense":
        raise ValueError(
            "estimate_index: config.pattern is 'dense'; dense layers attend every causal entry and need no index "
            "(use VerticalSlashIndex.dense or skip estimation for this layer)"
        )
    if config.estimator.strategy not in ESTIMATORS:
        raise ValueError(
            f"estimate_index: unknown estimator {config.estimator.strategy!r}; registered: {sorted(ESTIMATORS)}"
        )
    if pattern is None:
        return None
    seqlen = nq if seqlen is None else seqlen
    if not isinstance(pattern, AttentionPattern) or pattern.index is not None:
        got = "a pattern with an index" if isinstance(pattern, AttentionPattern) else type(pattern).__name__
        raise ValueError(
            "estimate_index: pattern must be the rows' AttentionPattern without an index (its documents bound the "
            f"estimate, the index is what it returns); got {got}"
        )
    if pattern.seqlen != seqlen:
        raise ValueError(f"estimate_index: the pattern is for rows of {pattern.seqlen} tokens, the rows have {seqlen}")
    pattern.check(bq, hq, q.device, "estimate_index's q (the whole rows)")
    return pattern.documents


@torch.no_grad()
def estimate(
    q: torch.Tensor,
    k: torch.Tensor,
    config: SparseAttentionConfig,
    reducer: Reducer,
    *,
    softmax_scale: float | None,
    return_report: bool,
    graphs: GraphCache | None,
    documents: Documents | None = None,
) -> VerticalSlashIndex | tuple[VerticalSlashIndex, EstimateReport]:
    """The index of the whole sequence from this rank's queries and keys (:func:`estimate_index`'s contract).

    Args:
        q, k: this rank's ``[B, n, Hq, D]`` queries and ``[B, n, Hkv, D]`` keys at global positions
            ``reducer.keys`` (the whole sequence on one device), already checked (:func:`check_inputs`).
        reducer: where the keys sit, how the rows' queries are gathered and how the evidence is combined.
        graphs: with the identity reducer (``reducer.sharded`` False) and a ``graphed`` strategy, the strategy's
            steps after the rows' gather are replayed from one CUDA graph of this cache (collectives cannot be
            captured); otherwise a strategy may still replay a part free of collectives from it. ``None``: no
            replay.
        documents: the whole rows' packed documents (the same on every rank), or ``None``.
    """
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], "estimate_index")
    strategy = ESTIMATORS[config.estimator.strategy]
    settings = strategy.settings(config)
    seqlen = reducer.seqlen
    if graphs is None:
        rows = strategy.rows(seqlen, settings, q.device)
    else:
        key = ("rows", config.estimator.strategy, seqlen, config_key(settings), q.device)
        rows = graphs.constant(key, lambda: strategy.rows(seqlen, settings, q.device))
    q_obs = reducer.gather_rows(q, rows)

    def run(
        q_obs: torch.Tensor, k: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, *starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        shard = Shard(q_obs, k, keys, rows, seqlen, scale, starts[0] if starts else None)
        evidence = strategy.evidence(shard, settings, reducer)
        index, recall = strategy.select(evidence, settings, reducer, return_report, graphs)
        return index.vertical, index.slash, recall

    # The documents are a graph input like the keys (a tensor of this step), not part of the key.
    inputs = (q_obs, k, reducer.keys, rows) + (() if documents is None else (documents.starts,))
    if graphs is not None and strategy.graphed and not reducer.sharded:
        key = ("estimate", seqlen, scale, return_report, documents is not None, config_key(config))
        vertical, slash, recall = graphs.replay(run, key, inputs)
    else:
        vertical, slash, recall = run(*inputs)
    index = VerticalSlashIndex(vertical, slash, config.block_size)
    if not return_report:
        return index
    return index, EstimateReport(recall=recall, density=AttentionPattern(seqlen, index, documents).density())


def estimate_index(
    q: torch.Tensor,
    k: torch.Tensor,
    config: SparseAttentionConfig,
    *,
    softmax_scale: float | None = None,
    return_report: bool = False,
    graphs: GraphCache | None = None,
    pattern: AttentionPattern | None = None,
) -> VerticalSlashIndex | tuple[VerticalSlashIndex, EstimateReport]:
    """Estimate the vertical-slash index of a causal attention layer from a few observation rows.

    Args:
        q: ``[B, N, Hq, D]`` queries (global sequence order), any float dtype; computed in fp32.
        k: ``[B, N, Hkv, D]`` keys, ``Hq % Hkv == 0``; query head ``h`` uses kv head ``h // (Hq // Hkv)``.
        config: a ``SparseAttentionConfig`` with ``pattern="vertical_slash"``; ``config.estimator.strategy`` picks the
            strategy in :data:`ESTIMATORS`; budgets, recall targets, sinks and local tiles come from it.
        softmax_scale: logit scale; default ``D ** -0.5``.
        return_report: also return an :class:`EstimateReport` (observed recall and exact density per head, inside
            the pattern's documents).
        graphs: the caller's CUDA-graph cache; on CUDA the estimate is then replayed from a graph captured on its
            first call per shape and knob set (:class:`GraphCache`). ``None``: every kernel launched one by one.
        pattern: the rows' pattern without an index (``AttentionPattern(N, documents=...)``; docs/design.md,
            "Packed documents"): with documents, each observation row scores only the keys of its own document,
            and the first ``sink_tokens`` tokens of every document longer than the local band are forced columns
            (``estimator.documents``, bounded by ``max_columns``). ``None``: one sequence a row.
            ``pattern.with_index(index)`` is then what the attention takes.

    Returns:
        The canonical :class:`VerticalSlashIndex` (``[B, Hq, ·]``, ``block_size = config.block_size``), or
        ``(index, report)`` when ``return_report``.

    Raises:
        ValueError: mismatched shapes, ``Hq % Hkv != 0``, tensors on different devices, ``pattern="dense"``,
            an unknown estimator, a non-positive scale, or a pattern not over q's rows (or with an index).
        TypeError: q or k not floating point.
    """
    documents = check_inputs(q, k, config, pattern)
    return estimate(
        q,
        k,
        config,
        LocalReducer.of(q),
        softmax_scale=softmax_scale,
        return_report=return_report,
        graphs=graphs,
        documents=documents,
    )
