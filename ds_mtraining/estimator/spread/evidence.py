"""The spread strategy's evidence: the rows' softmax statistics, then per-row key-block mass and column sums.

One sweep gives the statistics of every observation row (the staggered rows, the tail rows; the recall report
reuses them). The evidence is then their exact causal softmax ``A`` reduced to per-row key-block mass
``S[i, kb]``, per-column sums and spikes over the entries at least ``exclusion`` tokens behind their row (nearer
ones belong to the local band, not to a column), and the tail rows' attention summed per key and query block.
On CUDA two Triton sweeps over the keys produce the same without materialising ``A`` (``estimator.triton.evidence``);
elsewhere the fp32 attention is built (``estimator.observe``) and reduced here. Every part is per key or key block,
each held by one rank, so summing the parts over the ranks adds exact zeros. With packed documents every row's
attention is masked to its document (``row_starts``), in the statistics and in every part of the evidence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_mtraining.sparse.backends import uses_triton

from ..kernels import estimator_kernels
from ..observe import normalise, observation_logits, reduce_row_statistics, row_statistics
from ..reduce import Reducer
from ..strategy import Shard
from .geometry import tail_blocks
from .spikes import spikes

__all__ = ["RowStatistics", "SpreadEvidence", "observe_rows", "shard_evidence", "spread_evidence", "whole_blocks"]


@dataclass(frozen=True)
class RowStatistics:
    """The observation rows' softmax statistics over *all* keys (reduced over the ranks) and, off CUDA, their
    logits at this rank's keys (on CUDA the Triton kernels recompute the logits tile by tile).

    Attributes:
        row_max: float32 ``[B, Hq, m]``; row_sum: float64 ``[B, Hq, m]`` (:func:`estimator.observe.row_statistics`).
        logits: float32 ``[B, Hq, m, n]``, or ``None`` on CUDA.
    """

    row_max: torch.Tensor
    row_sum: torch.Tensor
    logits: torch.Tensor | None


@dataclass(frozen=True)
class SpreadEvidence:
    """What the greedy and the tail repair need from the observation rows' attention, reducible over key shards.

    Attributes:
        block_mass: float32 ``[B, Hq, m, nb]``, ``Σ_{j in key block kb} A[i, j]`` (sum over shards; each key
            block lives on one shard, so the reduction adds exact zeros).
        column_sum: float32 ``[B, Hq, N]``, ``Σ_i A[i, j]`` over rows with ``p_i - j >= exclusion`` (sum).
        column_top: float32 ``[B, Hq, N]``, the sum of the ``SPIKES`` largest of those entries (each key lives
            on one shard, so the shards' values add up to it).
        tail_sum: float32 ``[G, B, Hq, N]``, ``Σ A[t, j]`` over the tail rows ``t`` of query block ``first + g``
            (:func:`tail_blocks`; ``G = 0`` without tail rows): each group shares the index's mask at a key, so
            this is all the tail repair needs.
    """

    block_mass: torch.Tensor
    column_sum: torch.Tensor
    column_top: torch.Tensor
    tail_sum: torch.Tensor


def whole_blocks(shard: Shard, block_size: int) -> Shard:
    """``shard`` with its keys padded to whole blocks (the evidence reads whole blocks): zero keys at positions
    ``seqlen, seqlen + 1, ...``, past the end, so they read 0. A layout's shard is whole blocks already."""
    pad = (-shard.keys.numel()) % block_size
    if not pad:
        return shard
    extra = shard.seqlen + torch.arange(pad, device=shard.keys.device)
    return dataclasses.replace(shard, k=F.pad(shard.k, (0, 0, 0, 0, 0, pad)), keys=torch.cat([shard.keys, extra]))


def observe_rows(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    softmax_scale: float,
    reducer: Reducer,
    row_starts: torch.Tensor | None = None,
) -> RowStatistics:
    """The :class:`RowStatistics` of the queries ``q_rows [B, m, Hq, D]`` at ``rows [m]`` against ``k`` at
    ``keys`` (:class:`~ds_mtraining.estimator.strategy.Shard`), inside the rows' documents (``row_starts``
    LongTensor ``[B, m]``, or ``None``), reduced by ``reducer``. One sweep serves the greedy's rows, the tail rows
    and the recall report."""
    if uses_triton(q_rows.device):
        logits = None
        row_max, row_sum = estimator_kernels().evidence.row_statistics(
            q_rows.to(k.dtype), k, rows, keys, softmax_scale, row_starts
        )
    else:
        logits = observation_logits(q_rows, k, rows, keys, softmax_scale, row_starts)
        row_max, row_sum = row_statistics(logits)
    reduce_row_statistics(row_max, row_sum, reducer)
    return RowStatistics(row_max, row_sum, logits)


def spread_evidence(
    attn: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    seqlen: int,
    block_size: int,
    exclusion: int,
    tail: int = 0,
) -> SpreadEvidence:
    """This key shard's part of the evidence from the rows' attention (the whole evidence on one device).

    Args:
        attn: float32 ``[B, Hq, m + T, n]``, the observation rows' attention at ``keys``, the ``T = tail`` tail
            rows last.
        rows: LongTensor ``[m + T]``, row positions; the tail rows are the sequence's last ``T``
            (``spread.rows.tail_rows``).
        keys: LongTensor ``[n]``, global key positions, whole aligned blocks of ``block_size`` in any block
            order (every layout's shard is); positions ``>= seqlen`` are padding.
        exclusion: entries nearer than this to their row are not column evidence.
        tail: how many of the rows, the last ones, are tail rows (they feed only ``tail_sum``).
    """
    batch, heads, m_all, n = attn.shape
    if n % block_size:
        raise ValueError(f"spread_evidence needs keys in whole blocks of {block_size}; got {n} keys")
    m = m_all - tail
    first, groups = tail_blocks(seqlen, tail, block_size)
    attn, tail_attn, rows = attn[:, :, :m], attn[:, :, m:], rows[:m]
    nb = -(-seqlen // block_size)
    # Results are scattered to global positions, every padding key into one spare slot past the end that is cut
    # off: no boolean indexing (a copy of the whole attention) and no host sync. Sums of fp32 terms (a block's,
    # or a column's m rows) run in fp32.
    block = (keys[::block_size] // block_size).clamp(max=nb)
    per_block = torch.zeros(batch, heads, m, nb + 1, device=attn.device)
    per_block[..., block] = attn.view(batch, heads, m, n // block_size, block_size).sum(-1)
    block_mass = per_block[..., :nb].contiguous()

    real = keys < seqlen
    far = torch.where((rows[:, None] - keys[None, :] >= exclusion) & real, attn, 0.0)
    per_key = torch.zeros(2, batch, heads, seqlen + 1, device=attn.device)
    slot = torch.where(real, keys, seqlen)
    per_key[0, ..., slot] = far.sum(dim=-2)
    per_key[1, ..., slot] = spikes(far, dim=-2)
    column_sum = per_key[0, ..., :seqlen].contiguous()
    column_top = per_key[1, ..., :seqlen].contiguous()
    # Tail rows: per query block, their attention summed per key (a one-hot product over the rows).
    tail_block = torch.arange(seqlen - tail, seqlen, device=attn.device) // block_size - first
    member = (tail_block[:, None] == torch.arange(groups, device=attn.device)).float()  # [T, G]
    per_group = torch.zeros(groups, batch, heads, seqlen + 1, device=attn.device)
    per_group[..., slot] = torch.einsum("bhtn,tg->gbhn", torch.where(real, tail_attn, 0.0), member)
    return SpreadEvidence(block_mass, column_sum, column_top, per_group[..., :seqlen].contiguous())


def shard_evidence(
    shard: Shard, statistics: RowStatistics, block_size: int, exclusion: int, tail: int, reducer: Reducer
) -> SpreadEvidence:
    """The evidence over all keys: this rank's part (Triton sweeps on CUDA, :func:`spread_evidence` of the fp32
    attention elsewhere), summed over the ranks by ``reducer``.

    Args:
        shard: in whole blocks (:func:`whole_blocks`); its rows are the staggered rows, then ``tail`` tail rows;
            with documents each row sees only its document's keys (``shard.row_starts``).
        statistics: of all of ``shard.rows`` (:func:`observe_rows`, inside the same documents).
    """
    if statistics.logits is None:
        evidence = SpreadEvidence(
            *estimator_kernels().evidence.spread_evidence(
                shard.q_obs.to(shard.k.dtype), shard.k, shard.rows, shard.keys, statistics.row_max,
                statistics.row_sum, shard.softmax_scale, shard.seqlen, block_size, exclusion, tail,
                shard.row_starts,
            )
        )  # fmt: skip
    else:  # the logits are already -inf outside the rows' documents: their attention is 0 there
        attn = normalise(statistics.logits, statistics.row_max, statistics.row_sum)
        evidence = spread_evidence(attn, shard.rows, shard.keys, shard.seqlen, block_size, exclusion, tail)
    for part in (evidence.block_mass, evidence.column_sum, evidence.column_top, evidence.tail_sum):
        reducer.sum_(part)  # each key lives on one rank: the sums add its values to zeros
    return evidence
