"""The spread strategy's batched greedy (step 4 of ``estimator.spread``).

From the observation rows' key-block mass and the candidate columns' attention, choose block offsets and columns
by estimated mass gained per newly attended entry, in rounds of many picks per head (:func:`rounds`), until
the sampled rows' covered mass reaches ``recall`` (``estimator.spread``'s package docstring has the rules).
Batched over batch and heads, sync-free, deterministic (fp64 sums, stable sorts; the only scatter-adds add
integers, exact in any order). In PyTorch a round is ~30 kernels over ``[B·Hq, m, Kc]`` tensors (~7 ms at 128K
tokens on an H200, even replayed from a CUDA graph); on CUDA the rounds run as Triton kernels instead
(``estimator.triton.greedy``), the same rules and sums, and :func:`select` replays the whole greedy from a captured
CUDA graph when it is not inside one already. With packed documents every cost and column gain counts the rows of
the candidate's document only (the evidence is already masked to the rows' documents).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds_mtraining.sparse.backends import uses_triton
from ds_mtraining.sparse.index import PAD, VerticalSlashIndex

from ..documents import document_ends
from ..graphs import config_key
from ..kernels import estimator_kernels
from .greedy_problem import GreedyProblem
from .settings import SpreadSettings
from .spikes import SPIKES, spikes

if TYPE_CHECKING:
    from ..graphs import GraphCache

__all__ = ["GROWING", "rounds", "select", "shear", "spread_select"]

GROWING = (8, 32, 128, 512, 1536)
"""The growing rounds: most picks per head in each. Five growing rounds instead of the nine of (4, 8, ..., 1024):
0.9-1.2 % more density than the oracle's at equal recall on SmolLM2 and 0.13-0.45 ms less per estimate at 128K on an
H200 (docs/measurements.md, "The greedy's rounds")."""


def rounds(max_columns: int) -> tuple[int, ...]:
    """The default schedule for a column cap (its total bounds what one estimate can pick): :data:`GROWING`, then
    rounds of its last size until the rounds' total reaches ``max_columns``, then one more round of that size
    (``(8, 32, 128, 512, 1536, 1536)`` for any cap up to 2216, the growing rounds' total).

    Why the round after the cap: a diffuse head reaches the column cap during a round whose offsets ranked after
    its first column are dropped. Without a round after it, such heads stopped with their offsets unbought, at
    observed recall 0.66-0.81 against the target of 0.98 (SmolLM2 with YaRN x4, 8 of 261 heads under 0.8 true
    recall at 16K, lowest 0.64, and 0.56 at 32K; docs/measurements.md). With the columns
    capped, that round's picks are offsets. Their forecasts are exact, so the round reaches ``recall`` or
    ``max_offsets``, and a head that needs nothing more picks nothing. A cap past the growing rounds' total
    (``max_columns = 4096``) is reached only in a later round, so the rounds go on until they can reach it.
    """
    schedule = list(GROWING)
    while sum(schedule) < max_columns:
        schedule.append(GROWING[-1])
    return (*schedule, GROWING[-1])


def shear(per_block: torch.Tensor, row_block: torch.Tensor) -> torch.Tensor:
    """``[G, m, nb]`` per key block -> per offset: ``out[g, i, s] = x[g, i, b_i - s]`` (0 where ``s > b_i``)."""
    nb = per_block.shape[-1]
    key_block = row_block[:, None] - torch.arange(nb, device=row_block.device)  # [m, nb]
    out = per_block.gather(-1, key_block.clamp(min=0).expand(per_block.shape[0], -1, -1))
    return torch.where(key_block >= 0, out, 0.0)


def _per_key_block(values: torch.Tensor, cum_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Sum of ``values`` ``[G, ..., Kc]`` (candidates sorted by key) per key block: ``[G, ..., nb]``.

    Prefix sums read at the block boundaries (``cum_index`` from :func:`_block_bounds`): deterministic, unlike a
    scatter-add, and exact enough in fp64.
    """
    lo, hi = cum_index
    cum = F.pad(values.cumsum(-1), (1, 0))
    shape = (*values.shape[:-1], lo.shape[-1])
    lo = lo.view(lo.shape[0], *([1] * (values.dim() - 2)), -1).expand(shape)
    hi = hi.view(hi.shape[0], *([1] * (values.dim() - 2)), -1).expand(shape)
    return cum.gather(-1, hi) - cum.gather(-1, lo)


def _block_bounds(candidates: torch.Tensor, block_size: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head and key block, the candidate range ``[lo, hi)`` inside it: two LongTensors ``[G, nb]``."""
    edges = torch.arange(nb + 1, device=candidates.device).expand(candidates.shape[0], -1) * block_size
    bounds = torch.searchsorted(candidates.contiguous(), edges.contiguous())
    return bounds[:, :-1], bounds[:, 1:]


def _problem(
    block_mass: torch.Tensor,
    candidates: torch.Tensor,
    cand_attn: torch.Tensor,
    rows: torch.Tensor,
    seqlen: int,
    settings: SpreadSettings,
    dtype: torch.dtype,
    starts: torch.Tensor | None,
) -> GreedyProblem:
    batch, heads, m, nb = block_mass.shape
    g_count, kc = batch * heads, candidates.shape[-1]
    dev, bs = block_mass.device, settings.block_size
    cand = candidates.reshape(g_count, kc)
    real = cand < seqlen
    s = torch.arange(nb, device=dev)
    if starts is None:  # one document a row: what follows with every start 0, without the per-token work
        cand_end = torch.full_like(cand, seqlen)
        row_start = torch.zeros(g_count, m, dtype=torch.long, device=dev)
        off_rows = (seqlen - s * bs).expand(g_count, -1)
        reached = ((rows // bs)[:, None] >= s).sum(0).expand(g_count, -1)  # sampled rows that reach offset s
    else:
        per_head = functools.partial(torch.repeat_interleave, repeats=heads, dim=0)
        ends = document_ends(starts).gather(-1, cand.clamp(max=seqlen - 1).view(batch, heads * kc))  # G = b·Hq + h
        cand_end = torch.where(real, ends.view(g_count, kc), seqlen)
        row_start = per_head(starts.index_select(1, rows))
        # Token i's key block at offset s holds keys of its document while s <= its block's distance to the
        # document's first block.
        pos = torch.arange(seqlen, device=dev)
        distance = pos // bs - starts // bs  # [B, N], in 0 .. nb - 1
        counts = torch.zeros(batch, nb, dtype=torch.long, device=dev).scatter_add_(
            1, distance, torch.ones_like(distance)
        )
        off_rows = per_head(counts.flip(-1).cumsum(-1).flip(-1))  # rows at distance >= s
        reached = ((rows // bs - row_start // bs)[:, :, None] >= s).sum(1)  # [G, nb], as above inside documents
    # A column's rows below its block: offsets 1 .. span, all bs rows but in its document's last block.
    last_block = (cand_end - 1) // bs
    span = torch.where(real, last_block - cand // bs, 0).clamp(min=0)
    forced_off = min(max(settings.local_blocks, 1), nb)
    sinks = min(settings.sink_tokens, seqlen)
    return GreedyProblem(
        cand=cand,
        attn=cand_attn.reshape(g_count, m, kc).to(dtype),
        mass=shear(block_mass.reshape(g_count, m, nb).to(dtype), rows // bs),
        bounds=_block_bounds(cand, bs, nb),
        span=span,
        last_rows=cand_end - last_block * bs,
        off_rows=off_rows.contiguous(),
        off_scale=off_rows.double() / reached.clamp(min=1).double(),
        row_start=row_start,
        documents=starts is not None,
        sinks=sinks,
        forced_off=forced_off,
        chosen_off=(s < forced_off).expand(g_count, -1).clone(),
        chosen_col=(torch.arange(kc, device=dev) < sinks).expand(g_count, -1) & real,
    )


@dataclass(frozen=True)
class _Geometry:
    """Where the candidate columns sit relative to the observation rows: the same in every round."""

    row_block: torch.Tensor  # LongTensor [m]
    real: torch.Tensor  # bool [G, Kc]: not padding
    reach: torch.Tensor  # bool [G, m, Kc]: row i's block at or below the column's
    tile_of: torch.Tensor  # LongTensor [G, m * Kc]: the offset of (row i's block, the column's block), clamped
    far: torch.Tensor  # bool [G, m, Kc]: row i in the column's document, at least ``exclusion`` behind it


def _geometry(p: GreedyProblem, rows: torch.Tensor, seqlen: int, settings: SpreadSettings) -> _Geometry:
    nb = p.mass.shape[-1]
    real = p.cand < seqlen
    cand_block = torch.where(real, p.cand // settings.block_size, nb)  # padding: a block past the end
    row_block = rows // settings.block_size
    off_ic = row_block[None, :, None] - cand_block[:, None, :]  # [G, m, Kc]
    return _Geometry(
        row_block=row_block,
        real=real,
        reach=off_ic >= 0,
        tile_of=off_ic.clamp(min=0, max=nb - 1).flatten(1),
        far=(rows[None, :, None] - p.cand[:, None, :] >= settings.exclusion)
        & real[:, None, :]
        & (p.cand[:, None, :] >= p.row_start[:, :, None]),
    )


def _costs(p: GreedyProblem, settings: SpreadSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries each column and offset would newly attend, given the chosen ones, inside the documents.

    A column costs its document's rows below its own block in the tiles of unchosen offsets (its own block is
    offset 0, always chosen). An offset costs a tile row of ``bs`` entries for every row whose key block at that
    offset holds keys of the row's document (the kernels compute a boundary tile whole, masked inside), minus the
    chosen columns' entries in those tiles (a column's at offsets 1 .. span, counted by span: integers, exact in
    fp64). Offset 0's cost is not meaningful (it is always chosen).

    Returns:
        float64 ``[G, Kc]`` (columns) and ``[G, nb]`` (offsets).
    """
    g_count, nb = p.chosen_off.shape
    dev, f64, bs = p.cand.device, torch.float64, settings.block_size
    span, short = p.span, bs - p.last_rows  # short: rows the column's last tile lacks
    free_tile = (~p.chosen_off & (torch.arange(nb, device=dev) >= 1)).double()
    cum_free = F.pad(free_tile.cumsum(-1), (1, 0))  # cum_free[L] = free offsets among 1 .. L - 1
    col_cost = bs * cum_free.gather(-1, span + 1) - short * free_tile.gather(-1, span) * (span >= 1)
    chosen = p.chosen_col.double()
    by_span = torch.zeros(g_count, nb, dtype=f64, device=dev).scatter_add_(-1, span, chosen)
    short_at = torch.zeros(g_count, nb, dtype=f64, device=dev).scatter_add_(-1, span, chosen * short)
    inside = bs * by_span.flip(-1).cumsum(-1).flip(-1) - short_at  # at offset s: chosen columns with span >= s
    return col_cost, bs * p.off_rows.double() - inside


def _scores(
    p: GreedyProblem, geo: _Geometry, seqlen: int, settings: SpreadSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round's scores from the entries chosen so far (package docstring of ``estimator.spread``, step 4).

    Returns:
        ratio: float64 ``[G, nb + Kc]``, offsets then candidate columns; ``-inf`` where not eligible.
        forecast: float64 ``[G, nb + Kc]``, each entry's estimated gain of covered mass if picked.
        covered: float64 ``[G]``, the sampled rows' mean mass inside the chosen entries.
    """
    g_count, m, kc = p.attn.shape
    nb = p.mass.shape[-1]
    dev, f64 = p.attn.device, torch.float64
    a, mass = p.attn, p.mass
    chosen_off, chosen_col = p.chosen_off, p.chosen_col
    reach, tile_of, far, real = geo.reach, geo.tile_of, geo.far, geo.real
    s = torch.arange(nb, device=dev)
    neg = torch.full((), float("-inf"), dtype=f64, device=dev)

    uncovered = reach & ~chosen_off.gather(-1, tile_of).view(g_count, m, kc)
    col_resid = torch.where(uncovered, a, 0.0)  # [G, m, Kc]
    chosen_resid = torch.where(chosen_col[:, None, :], col_resid, 0.0)
    covered = (torch.where(chosen_off[:, None, :], mass, 0.0).sum(-1) + chosen_resid.sum(-1)).mean(-1)  # [G]

    # Columns: estimated mean probability of the entries a column adds = mean of its far residual entries
    # over the sampled rows of its document it would add, the spikes dropped.
    far_uncovered = far & uncovered
    far_resid = torch.where(far_uncovered, a, 0.0)
    far_rows = far_uncovered.sum(1)
    col_ratio = (far_resid.sum(1) - spikes(far_resid, dim=1)) / (far_rows - SPIKES).clamp(min=1)
    col_cost, off_cost = _costs(p, settings)
    col_ok = ~chosen_col & real & (col_cost > 0) & (far_rows > SPIKES)
    # Offsets: the sampled rows' mass in the offset's tile after the chosen columns, scaled to every row
    # the offset covers.
    off_resid = (mass - shear(_per_key_block(chosen_resid, p.bounds), geo.row_block)).clamp(min=0)
    off_resid = off_resid.sum(1)  # [G, nb]
    off_ok = ~chosen_off & (s >= p.forced_off) & (off_cost > 0)

    col_ok &= chosen_col.sum(-1, keepdim=True) - p.sinks < settings.max_columns
    off_ok &= chosen_off.sum(-1, keepdim=True) - p.forced_off < settings.max_offsets
    off_ratio = off_resid * p.off_scale / off_cost.clamp(min=1)
    ratio = torch.cat([torch.where(off_ok, off_ratio, neg), torch.where(col_ok, col_ratio, neg)], dim=-1)
    ratio = torch.where((ratio > 0) & (ratio >= settings.min_ratio), ratio, neg)
    forecast = torch.cat([off_resid, col_resid.sum(1)], dim=-1) / m
    return ratio, forecast, covered


def _rounds(
    p: GreedyProblem, rows: torch.Tensor, seqlen: int, settings: SpreadSettings, schedule: tuple[int, ...]
) -> None:
    """The rounds in PyTorch, updating ``p.chosen_*``: each scores every entry (:func:`_scores`), then picks."""
    g_count, nb, kc = p.attn.shape[0], p.mass.shape[-1], p.attn.shape[-1]
    dev = p.attn.device
    chosen_off, chosen_col = p.chosen_off, p.chosen_col
    family = torch.cat([torch.zeros(nb, dtype=torch.bool, device=dev), torch.ones(kc, dtype=torch.bool, device=dev)])
    geo = _geometry(p, rows, seqlen, settings)
    for picks in schedule:
        ratio, forecast, covered = _scores(p, geo, seqlen, settings)
        n_cols = chosen_col.sum(-1, keepdim=True) - p.sinks
        n_offs = chosen_off.sum(-1, keepdim=True) - p.forced_off
        # This round's picks: the best ratios in order while the forecast coverage is below the target, each
        # family within its cap. Offsets only ahead of the round's first column: an offset ranked after a
        # column would be paid for that column's mass twice (its ratio was computed without the column).
        order = ratio.sort(dim=-1, descending=True, stable=True).indices[:, :picks]
        is_col = family[order]
        keep = ratio.gather(-1, order) > float("-inf")
        keep &= is_col | ((keep & is_col).cumsum(-1) == 0)
        gains = torch.where(keep, forecast.gather(-1, order), 0.0)
        keep &= covered[:, None] + gains.cumsum(-1) - gains < settings.recall
        col_rank = n_cols + (keep & is_col).cumsum(-1)
        off_rank = n_offs + (keep & ~is_col).cumsum(-1)
        keep &= torch.where(is_col, col_rank <= settings.max_columns, off_rank <= settings.max_offsets)
        picked = torch.zeros(g_count, nb + kc, dtype=torch.bool, device=dev).scatter_(-1, order, keep)
        chosen_off |= picked[:, :nb]
        chosen_col |= picked[:, nb:]


def spread_select(
    block_mass: torch.Tensor,
    candidates: torch.Tensor,
    cand_attn: torch.Tensor,
    rows: torch.Tensor,
    seqlen: int,
    settings: SpreadSettings,
    schedule: tuple[int, ...] | None = None,
    backend: str = "auto",
    *,
    starts: torch.Tensor | None = None,
) -> VerticalSlashIndex:
    """The batched greedy (``estimator.spread`` package docstring, step 4).

    Args:
        block_mass: float32 ``[B, Hq, m, nb]`` (``SpreadEvidence``; any float dtype holding fp32 values).
        candidates: LongTensor ``[B, Hq, Kc]`` from ``candidate_columns`` (the first ``sink_tokens`` forced).
        cand_attn: float32 ``[B, Hq, m, Kc]`` from ``candidate_attention`` (summed over shards; likewise).
        rows: LongTensor ``[m]``, the observation rows.
        schedule: most picks per head in each round (``(1,) * n`` is the one-at-a-time greedy); None:
            ``rounds(settings.max_columns)``.
        backend: ``"triton"`` (``estimator.triton.greedy``; CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"torch"``, or ``"auto"``: Triton on CUDA.
        starts: LongTensor ``[B, seqlen]``, packed rows' document starts (``Documents.starts``; the evidence
            already masked to them), or ``None``: costs and column gains count rows of the candidate's document.

    Returns:
        The canonical index ``[B, Hq, ·]``.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"spread_select: backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend == "triton" and not uses_triton(block_mass.device) and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "spread_select: backend='triton' needs CUDA tensors (CPU tensors only under the Triton interpreter, "
            "TRITON_INTERPRET=1); use backend='torch' or 'auto' for CPU tensors"
        )
    schedule = rounds(settings.max_columns) if schedule is None else schedule
    batch, heads, _, nb = block_mass.shape
    kernels = backend == "triton" or (backend == "auto" and uses_triton(block_mass.device))
    dtype = torch.float32 if kernels else torch.float64
    p = _problem(block_mass, candidates, cand_attn, rows, seqlen, settings, dtype, starts)
    if kernels:
        vertical, slash, _, _ = estimator_kernels().greedy.greedy_rounds(p, rows, seqlen, settings, schedule)
        return VerticalSlashIndex(vertical.view(batch, heads, -1), slash.view(batch, heads, nb), settings.block_size)
    _rounds(p, rows, seqlen, settings, schedule)
    # Candidates ascend (padding, == seqlen, last and never chosen) and offset 0 is always chosen (forced).
    vertical = torch.where(p.chosen_col, p.cand, PAD).view(batch, heads, -1)
    slash = torch.where(p.chosen_off, torch.arange(nb, device=block_mass.device), PAD).view(batch, heads, nb)
    return VerticalSlashIndex.build(vertical, slash, settings.block_size, ascending=True)


def select(
    block_mass: torch.Tensor,
    candidates: torch.Tensor,
    cand_attn: torch.Tensor,
    rows: torch.Tensor,
    seqlen: int,
    settings: SpreadSettings,
    graphs: GraphCache | None,
    starts: torch.Tensor | None = None,
) -> VerticalSlashIndex:
    """:func:`spread_select` with the default schedule and backend; on CUDA replayed from a CUDA graph of
    ``graphs`` (the greedy is ~50 Triton launches and ~40 small PyTorch ops), unless ``graphs`` is ``None`` or a
    capture of the whole estimate is running (then its graph holds the greedy's kernels)."""
    inputs = (block_mass, candidates, cand_attn, rows, *(() if starts is None else (starts,)))
    if graphs is None:
        return spread_select(block_mass, candidates, cand_attn, rows, seqlen, settings, starts=starts)

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = spread_select(*inputs[:4], seqlen, settings, starts=inputs[4] if len(inputs) > 4 else None)
        return index.vertical, index.slash

    key = ("spread_select", seqlen, starts is not None, config_key(settings))
    vertical, slash = graphs.replay(run, key, inputs)
    return VerticalSlashIndex(vertical, slash, settings.block_size)
