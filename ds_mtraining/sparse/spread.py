"""The ``"spread"`` estimator: observation rows over the whole sequence, a cost-aware greedy over both families.

The baseline looks at the last queries only, where recent columns and the local band cannot be told apart,
and fills each family to its own threshold; on real attention it lands at 2-3x the density of the best index
of the same family at equal recall. This strategy judges every candidate by *mass gained per entry paid*:

1. **Rows** (:func:`spread_rows`): ``spread_rows`` single query rows, one per equal segment of the sequence,
   each placed at a different position *inside its block* (a row at a block end sees offsets 0-1 as richer
   than they are for the block's other rows), the last one at ``N - 1``.
2. **Evidence** (:func:`spread_evidence`): their exact causal softmax ``A`` (``sparse.observe``; the softmax
   statistics of these rows, the tail rows and the recall report come from one sweep, :func:`observe_rows`) reduced to
   per-row key-block mass ``S[i, kb]`` and per-column sums and maxima over the entries at least
   ``spread_exclusion`` tokens behind their row (nearer ones belong to the local band, not to a column). On
   CUDA two Triton sweeps over the keys produce the same without materialising ``A``
   (``sparse.triton.evidence``).
3. **Candidates** (:func:`candidate_columns`): the sinks plus the ``2 * vertical_max`` columns with the best
   initial estimated mass per entry; their attention ``A[:, c]`` is recomputed from their keys (``[m, Kc]``,
   :func:`candidate_attention`), everything else about columns is forgotten, so the greedy works on small
   tensors.
4. **Greedy** (``sparse.greedy.spread_select``): from the forced entries (sinks, offsets ``< local_blocks``), in rounds
   of at most ``SCHEDULE[r]`` picks per head: score every unchosen offset and candidate column by

   - gain: residual mass of the sampled rows (mass not covered by the other family's chosen entries),
     scaled to all the rows the candidate covers — offsets: ``x (N - s·bs) / #rows that see offset s``;
     columns: drop the ``SPIKES`` largest rows' contributions (a diagonal crosses a key in one row, two
     diagonals can meet there in two; a column holds mass in every row), mean over the other
     rows, ``x (N - k)``;
   - cost: exact number of newly attended entries (a column's rows in tiles whose offset is chosen are
     free; an offset's tiles lose the entries of the chosen columns inside them);

   and take the best ratios in order while the sampled rows' covered mass (exact at the round's start, plus
   the picks' forecasts) is below ``spread_recall``, within the caps (``vertical_max`` columns and
   ``slash_max`` offsets beyond the forced ones) and above ``spread_min_ratio`` (estimated mean attention
   probability of the new entries). Picks of one round do not see each other; between rounds every score
   is recomputed exactly, and rounds grow geometrically (the first picks matter most).
5. **Tail** (:func:`tail_columns`): the last ``spread_tail_rows`` queries (where a prompt's question sits, seen
   by one staggered row only) get up to ``spread_tail_columns`` more columns for their exact attention mass
   outside the index, until they too keep ``spread_recall`` (:func:`tail_residual`, from their attention summed
   per key and query block in the evidence sweep).

Everything is batched over batch and heads (no Python loop over heads or picks), sync-free, deterministic
(fp64 sums, stable sorts, no atomics) and device-agnostic; on CUDA the greedy replays a captured CUDA graph.
The distributed version (``parallel.estimate``) runs the same :func:`spread_index` on its key shard with the
row statistics, :class:`SpreadEvidence` and the candidates' attention all-reduced over the ring, so every rank
ends with the same index.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_mtraining.sparse.backends import triton_kernels, uses_triton
from ds_mtraining.sparse.graphs import config_key, replay
from ds_mtraining.sparse.greedy import SPIKES, select, shear, spikes
from ds_mtraining.sparse.index import PAD, VerticalSlashIndex
from ds_mtraining.sparse.observe import (
    normalise,
    observation_logits,
    reduce_row_statistics,
    row_statistics,
)
from ds_mtraining.sparse.tail_geometry import tail_blocks

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig

__all__ = [
    "RowStatistics",
    "SpreadEvidence",
    "candidate_attention",
    "candidate_columns",
    "index_recall",
    "observation_rows",
    "observe_rows",
    "spread_estimator",
    "spread_evidence",
    "spread_index",
    "spread_rows",
    "tail_blocks",
    "tail_columns",
    "tail_residual",
    "tail_rows",
]

_LANE_STEP = 37
"""In-block position of row ``i`` is ``i * 37 mod bs``: coprime with 64 and 128, so ``bs`` consecutive rows
take every in-block position once, and neighbouring rows sit far apart inside their blocks."""


def spread_rows(seqlen: int, count: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Observation row positions: LongTensor ``[m]``, sorted, unique, ``m <= min(count, seqlen)``.

    Row ``i`` lies in segment ``[i N / count, (i + 1) N / count)``, at in-block position ``i * 37 mod bs``
    (the last such position in its segment; the segment's end when the segment is shorter than a block);
    the last row is ``N - 1``.
    """
    if count < 1 or seqlen < 1:
        raise ValueError(f"spread_rows needs count >= 1 and seqlen >= 1; got count={count}, seqlen={seqlen}")
    m = min(count, seqlen)
    i = torch.arange(m, device=device)
    start, end = i * seqlen // m, (i + 1) * seqlen // m - 1
    lane = i * _LANE_STEP % block_size
    row = end - (end - lane) % block_size  # the largest p <= end with p % bs == lane
    row = torch.where(row >= start, row, end)
    row[-1] = seqlen - 1
    return row.unique()


@dataclass(frozen=True)
class SpreadEvidence:
    """What the greedy needs from the observation rows' attention, reducible over key shards.

    Attributes:
        block_mass: float32 ``[B, Hq, m, nb]``, ``Σ_{j in key block kb} A[i, j]`` (sum over shards; each key
            block lives on one shard, so the reduction adds exact zeros).
        column_sum: float32 ``[B, Hq, N]``, ``Σ_i A[i, j]`` over rows with ``p_i - j >= exclusion`` (sum).
        column_top: float32 ``[B, Hq, N]``, the sum of the ``SPIKES`` largest of those entries (each key lives
            on one shard, so the shards' values add up to it).
        tail_sum: float32 ``[G, B, Hq, N]``, ``Σ A[t, j]`` over the tail rows ``t`` of query block ``first + g``
            (:func:`tail_blocks`; ``G = 0`` without tail rows): each group shares the index's mask at a key, so
            this is all :func:`tail_residual` needs.
    """

    block_mass: torch.Tensor
    column_sum: torch.Tensor
    column_top: torch.Tensor
    tail_sum: torch.Tensor


def spread_evidence(
    attn: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    seqlen: int,
    block_size: int,
    exclusion: int,
    tail: int = 0,
) -> SpreadEvidence:
    """This key shard's part of the evidence (the whole evidence on one device).

    Args:
        attn: float32 ``[B, Hq, m + T, n]``, the observation rows' attention at ``keys``, the ``T = tail`` tail
            rows last.
        rows: LongTensor ``[m + T]``, row positions; the tail rows are the sequence's last ``T``
            (:func:`tail_rows`).
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


def _far_rows(rows: torch.Tensor, keys: torch.Tensor, exclusion: int) -> torch.Tensor:
    """Per key ``k`` (any shape), how many rows are at least ``exclusion`` behind it: LongTensor like ``keys``."""
    return rows.numel() - torch.searchsorted(rows, (keys + exclusion).contiguous())


def candidate_columns(
    evidence: SpreadEvidence, rows: torch.Tensor, seqlen: int, config: SparseAttentionConfig
) -> torch.Tensor:
    """Columns the greedy may choose: LongTensor ``[B, Hq, Kc]``, ascending, sinks first, padded with ``seqlen``.

    ``Kc = sinks + min(2 * vertical_max, N - sinks)``: the free columns whose far entries have the largest
    mean with the ``SPIKES`` largest dropped — the greedy's column ratio before any offset is chosen. On CUDA the
    ratio is one Triton launch (``sparse.triton.candidates``).
    """
    sinks = min(config.sink_tokens, seqlen)
    # Ranked in fp32, like the fp32 sums it comes from: half the top-k's radix passes of fp64 (~0.1 ms at 128K).
    if uses_triton(evidence.column_sum.device):
        ratio = triton_kernels().candidates.column_ratio(
            evidence.column_sum, evidence.column_top, rows, sinks, config.spread_exclusion
        )
    else:
        seen = _far_rows(rows, torch.arange(seqlen, device=rows.device), config.spread_exclusion)
        ratio = (evidence.column_sum - evidence.column_top) / (seen - SPIKES).clamp(min=1)
        ratio = torch.where(seen > SPIKES, ratio, -1.0)[..., sinks:]
    width = min(2 * config.vertical_max, seqlen - sinks)
    top = ratio.topk(width, dim=-1, sorted=False).indices + sinks  # the set; sorted by position below
    forced = torch.arange(sinks, device=rows.device).expand(*top.shape[:-1], sinks)
    # Positions sort as int32 where they fit: half the radix passes (H200, [16, 2048]: 0.038 -> 0.033 ms).
    ordered = top.int().sort(dim=-1).values.long() if seqlen < 2**31 else top.sort(dim=-1).values
    return torch.cat([forced, ordered], dim=-1)


def candidate_attention(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    softmax_scale: float,
    seqlen: int,
) -> torch.Tensor:
    """The observation rows' attention at the candidate columns, recomputed from their keys: float32 ``[B, Hq, m, Kc]``.

    ``q_obs`` ``[B, m, Hq, D]`` and ``k`` ``[B, n, Hkv, D]`` at global ``keys`` ``[n]`` (a shard: candidates held
    elsewhere read 0, so the shards' results add up to the whole); ``row_max`` / ``row_sum`` ``[B, Hq, m]`` the
    rows' statistics over all keys (:func:`sparse.observe.row_statistics`, reduced); ``candidates`` from
    :func:`candidate_columns` (padding = ``seqlen``). Values are fp32-rounded like the evidence's attention. On CUDA
    one Triton pass (``sparse.triton.evidence.candidate_attention``) from the keys in their dtype, like the
    evidence; elsewhere an fp32 einsum.
    """
    batch, _, hq, _ = q_obs.shape
    # Local index of every global position (padding keys share one spare slot); -1 = held by another shard.
    lookup = torch.full((seqlen + 1,), -1, dtype=torch.long, device=k.device)
    lookup[keys.clamp(max=seqlen)] = torch.arange(keys.numel(), device=k.device)
    lookup[seqlen:].fill_(-1)  # not `lookup[seqlen] = -1`: a host-to-device copy, which a CUDA graph cannot capture
    where = lookup[candidates]  # [B, Hq, Kc]
    if uses_triton(q_obs.device):
        return triton_kernels().evidence.candidate_attention(
            q_obs.to(k.dtype), k, rows, candidates, where, row_max, row_sum, softmax_scale
        )
    kv_head = (torch.arange(hq, device=k.device) // (hq // k.shape[2]))[None, :, None]
    k_cand = k[torch.arange(batch, device=k.device)[:, None, None], where.clamp(min=0), kv_head]  # [B, Hq, Kc, D]
    logits = torch.einsum("bmhd,bhcd->bhmc", q_obs.float() * softmax_scale, k_cand.float())
    attn = normalise(logits, row_max, row_sum)
    held = (where >= 0)[:, :, None, :] & (candidates[:, :, None, :] <= rows[:, None])
    return torch.where(held, attn, 0.0)


def tail_rows(seqlen: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """The last ``min(count, seqlen)`` positions: LongTensor ``[T]`` (empty when ``count`` is 0)."""
    return torch.arange(max(seqlen - count, 0), seqlen, device=device)


@functools.lru_cache(maxsize=32)
def observation_rows(
    seqlen: int, count: int, tail: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`spread_rows` and :func:`tail_rows` on ``device``, built once per set of arguments and then shared
    (read-only): building the rows synchronises with the host (``unique``), which must not happen in every
    layer's forward."""
    return spread_rows(seqlen, count, block_size, device), tail_rows(seqlen, tail, device)


@dataclass(frozen=True)
class RowStatistics:
    """The observation rows' softmax statistics over *all* keys (reduced over the ring) and, off CUDA, their logits
    at this shard's keys (on CUDA the Triton kernels recompute the logits tile by tile).

    Attributes:
        row_max: float32 ``[B, Hq, m]``; row_sum: float64 ``[B, Hq, m]`` (:func:`sparse.observe.row_statistics`).
        logits: float32 ``[B, Hq, m, n]``, or ``None`` on CUDA.
    """

    row_max: torch.Tensor
    row_sum: torch.Tensor
    logits: torch.Tensor | None


def observe_rows(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    softmax_scale: float,
    group: dist.ProcessGroup | None = None,
) -> RowStatistics:
    """The :class:`RowStatistics` of the queries ``q_rows [B, m, Hq, D]`` at ``rows [m]`` against ``k`` at
    ``keys`` (as for :func:`spread_index`), reduced over ``group``. One sweep serves the greedy's rows, the tail
    rows and the recall report."""
    if uses_triton(q_rows.device):
        logits = None
        row_max, row_sum = triton_kernels().evidence.row_statistics(q_rows.to(k.dtype), k, rows, keys, softmax_scale)
    else:
        logits = observation_logits(q_rows, k, rows, keys, softmax_scale)
        row_max, row_sum = row_statistics(logits)
    if group is not None:
        reduce_row_statistics(row_max, row_sum, group)
    return RowStatistics(row_max, row_sum, logits)


def _tile_chosen(offsets: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
    """Whether the slash set attends each tile: ``offsets`` bool ``[B, Hq, nb]`` (``offset_mask``), ``tile``
    LongTensor ``[B or 1, Hq or 1, ...]``, each tile's query block minus its key block. Bool like ``tile``
    broadcast to ``[B, Hq, ...]``; False for negative offsets (keys after the query block)."""
    batch, heads, nb = offsets.shape
    tile = tile.expand(batch, heads, *tile.shape[2:])
    return offsets.gather(-1, tile.clamp(0, nb - 1).flatten(2)).view(tile.shape) & (tile >= 0)


def index_recall(
    index: VerticalSlashIndex, block_mass: torch.Tensor, column_attn: torch.Tensor, rows: torch.Tensor, seqlen: int
) -> torch.Tensor:
    """The rows' attention mass inside ``index``'s mask / their number: float32 ``[B, Hq]``
    (``sparse.observe.observed_recall``), from what the estimate already holds instead of another sweep over the
    keys: the mass of the tiles of its offsets is the evidence's key-block mass, and its columns add their
    attention in the rows whose tile at that column is not one of those.

    Args:
        block_mass: float32 ``[B, Hq, m, nb]`` (:class:`SpreadEvidence`, summed over shards).
        column_attn: float32 ``[B, Hq, m, Kv]``, the rows' attention at ``index.vertical``
            (:func:`candidate_attention` with its padding as ``seqlen``, summed over shards).
        rows: LongTensor ``[m]``.

    On CUDA one Triton launch (``sparse.triton.report``).
    """
    offsets = index.offset_mask(seqlen)  # [B, Hq, nb]
    if uses_triton(block_mass.device):
        return triton_kernels().report.index_recall(
            index.vertical, offsets, block_mass, column_attn, rows, index.block_size
        )
    nb = block_mass.shape[-1]
    row_block = rows // index.block_size
    batch, heads = offsets.shape[:2]
    per_offset = shear(block_mass.flatten(0, 1), row_block).view(batch, heads, -1, nb)  # [B, Hq, m, nb]
    slash_mass = torch.where(offsets[:, :, None, :], per_offset, 0.0).sum(-1, dtype=torch.float64)
    col_block = index.vertical.clamp(min=0) // index.block_size  # [B, Hq, Kv]
    under = _tile_chosen(offsets, row_block[None, None, :, None] - col_block[:, :, None, :])  # [B, Hq, m, Kv]
    real = (index.vertical >= 0)[:, :, None, :]
    column_mass = torch.where(real & ~under, column_attn, 0.0).sum(-1, dtype=torch.float64)  # non-causal: 0
    return (slash_mass + column_mass).mean(-1).float()


def tail_residual(
    index: VerticalSlashIndex, tail_sum: torch.Tensor, seqlen: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail rows' attention mass inside ``index``'s mask and outside it per key, from their per-block key sums.

    Rows of one query block share the mask at a key (the key's column, or the tile of the block's offset to it),
    so each group's sum (:class:`SpreadEvidence`'s ``tail_sum``, ``[G, B, Hq, N]``) splits into inside and
    outside exactly.

    Returns:
        The covered mass, mean over the ``count`` rows, float64 ``[B, Hq]``; the mass outside the mask summed over
        the rows per key, float32 ``[B, Hq, seqlen]``. On CUDA one Triton pass (``sparse.triton.tail``).
    """
    bs = index.block_size
    first, groups = tail_blocks(seqlen, count, bs)
    offsets, columns = index.offset_mask(seqlen), index.column_mask(seqlen)
    if uses_triton(tail_sum.device):
        inside_sum, outside = triton_kernels().tail.tail_residual(tail_sum, offsets, columns, first, bs)
        return inside_sum / count, outside
    # Each key's offset from query block first + g, and whether the index attends that tile.
    dev = tail_sum.device
    tile = (first + torch.arange(groups, device=dev))[:, None] - torch.arange(seqlen, device=dev) // bs  # [G, N]
    inside = _tile_chosen(offsets, tile[None, None]) | columns[:, :, None, :]  # [B, Hq, G, N]
    sums = tail_sum.permute(1, 2, 0, 3)
    covered = torch.where(inside, sums, 0.0).sum((-2, -1), dtype=torch.float64) / count
    return covered, torch.where(inside, 0.0, sums).sum(-2)


def tail_columns(
    index: VerticalSlashIndex, tail_sum: torch.Tensor, seqlen: int, count: int, config: SparseAttentionConfig
) -> VerticalSlashIndex:
    """``index`` with at most ``spread_tail_columns`` columns added for the ``count`` tail rows (step 5).

    One staggered row falls in the last segment, so what only the end of a sequence reads (a prompt's question
    reading its needle) has no evidence, and the last rows' recall falls well below the target (SmolLM2, a
    NIAH prompt at 2K: 0.62-0.97 per head for the last 32 rows against 0.98 for the others). The tail rows'
    exact attention decides the repair: their mass outside ``index``'s mask, per key, after the offsets and
    columns the greedy chose (so a diagonal the greedy bought does not come back as columns), from
    :func:`tail_residual`. Columns are added by that residual mass, largest first, while the tail rows' covered
    mass before the pick is below ``spread_recall``.

    Args:
        tail_sum: float32 ``[G, B, Hq, seqlen]`` (:class:`SpreadEvidence`, summed over shards).
    """
    covered, per_key = tail_residual(index, tail_sum, seqlen, count)
    # Ranked in fp32, the sums' own precision (half the radix passes of fp64), then summed up in fp64.
    top = per_key.topk(min(config.spread_tail_columns, seqlen), dim=-1)
    gain = top.values.double() / count
    before = gain.cumsum(-1) - gain
    keep = (covered[..., None] + before < config.spread_recall) & (gain > 0)
    added = torch.where(keep, top.indices, PAD)
    return index.with_columns(added)


def spread_index(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    tail: torch.Tensor,
    keys: torch.Tensor,
    seqlen: int,
    config: SparseAttentionConfig,
    softmax_scale: float,
    statistics: RowStatistics,
    group: dist.ProcessGroup | None = None,
    observe: bool = False,
) -> tuple[VerticalSlashIndex, torch.Tensor | None]:
    """Steps 2-5 from the observation rows' queries and statistics: evidence, candidates, greedy, tail columns.

    On CUDA the evidence comes from the Triton kernels of ``sparse.triton.evidence`` (a sweep over the keys, the
    rows' attention never materialised) and the greedy runs as Triton kernels (``sparse.triton.greedy``, replayed
    from a CUDA graph by :func:`sparse.greedy.select` when not already inside one); elsewhere from the fp32
    attention (``sparse.observe``).

    Args:
        q_obs: ``[B, m + T, Hq, D]``, the queries at ``rows`` then at ``tail``; k: ``[B, n, Hkv, D]`` (all keys,
            or one key shard).
        rows: LongTensor ``[m]`` (:func:`spread_rows`); tail: LongTensor ``[T]`` (:func:`tail_rows`; may be empty).
        keys: LongTensor ``[n]``, the keys' global positions, whole aligned blocks (:func:`spread_evidence`);
            positions ``>= seqlen`` pad.
        statistics: those of ``q_obs`` at ``rows`` then ``tail`` (:func:`observe_rows`, reduced over ``group``).
        group: the process group over which ``k`` is sharded (each key on one rank), ``None`` on one device.
            The statistics, evidence and candidates' attention are all-reduced over it, so every rank gets the
            same index.
        observe: also return the rows' recall of the index, float32 ``[B, Hq]`` (:func:`index_recall`), else
            ``None``.
    """
    bs, exclusion, m, count = config.block_size, config.spread_exclusion, rows.numel(), tail.numel()
    q_rows = q_obs[:, :m]
    row_max, row_sum = statistics.row_max[..., :m], statistics.row_sum[..., :m]  # the greedy's rows; the tail's follow
    observed = torch.cat([rows, tail])
    if statistics.logits is None:
        evidence = SpreadEvidence(
            *triton_kernels().evidence.spread_evidence(
                q_obs.to(k.dtype), k, observed, keys, statistics.row_max, statistics.row_sum, softmax_scale, seqlen,
                bs, exclusion, count,
            )
        )  # fmt: skip
    else:
        attn = normalise(statistics.logits, statistics.row_max, statistics.row_sum)
        evidence = spread_evidence(attn, observed, keys, seqlen, bs, exclusion, count)
    if group is not None:
        for part in (evidence.block_mass, evidence.column_sum, evidence.column_top, evidence.tail_sum):
            dist.all_reduce(part, group=group)  # each key lives on one rank: the sums add its values to zeros
    candidates = candidate_columns(evidence, rows, seqlen, config)
    cand_attn = candidate_attention(q_rows, k, rows, keys, candidates, row_max, row_sum, softmax_scale, seqlen)
    if group is not None:
        dist.all_reduce(cand_attn, group=group)
    index = select(evidence.block_mass, candidates, cand_attn, rows, seqlen, config)
    if count:
        index = tail_columns(index, evidence.tail_sum, seqlen, count, config)
    if not observe:
        return index, None
    columns = torch.where(index.vertical >= 0, index.vertical, seqlen)
    column_attn = candidate_attention(q_rows, k, rows, keys, columns, row_max, row_sum, softmax_scale, seqlen)
    if group is not None:
        dist.all_reduce(column_attn, group=group)
    return index, index_recall(index, evidence.block_mass, column_attn, rows, seqlen)


def spread_estimator(
    q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig, softmax_scale: float, observe: bool
) -> tuple[VerticalSlashIndex, torch.Tensor | None]:
    """Rows spread over the sequence, cost-aware greedy (module docstring); q ``[B, N, Hq, D]``, k ``[B, N, Hkv, D]``.

    With ``observe``, also the observation rows' recall: float32 ``[B, Hq]`` (:func:`index_recall`). On CUDA the
    whole estimate after the rows' gather is replayed from a CUDA graph (``sparse.graphs``).
    """
    seqlen, bs = q.shape[1], config.block_size
    rows, tail = observation_rows(seqlen, config.spread_rows, config.spread_tail_rows, bs, q.device)
    pad = (-seqlen) % bs  # the evidence reads whole blocks; the padding keys are past the end and read 0
    keys = torch.arange(seqlen + pad, device=q.device)
    q_obs = q.index_select(1, torch.cat([rows, tail]))
    if pad:
        k = F.pad(k, (0, 0, 0, 0, 0, pad))

    def run(q_obs, k, rows, tail, keys):
        statistics = observe_rows(q_obs, k, torch.cat([rows, tail]), keys, softmax_scale)
        index, recall = spread_index(
            q_obs, k, rows, tail, keys, seqlen, config, softmax_scale, statistics, None, observe
        )
        return index.vertical, index.slash, recall

    key = ("spread_estimator", seqlen, softmax_scale, observe, config_key(config))
    vertical, slash, recall = replay(run, key, (q_obs, k, rows, tail, keys))
    return VerticalSlashIndex(vertical, slash, bs), recall
