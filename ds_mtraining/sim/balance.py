"""Step-level balancing of the sparse ring: place the movable work so the ring's critical path is shortest.

A ring step lasts as long as its busiest rank, so the ring takes ``Σ_s max_r work[r, s]``. Most work is pinned:
a slash tile ``(i, j)`` can only run at the step when ``j``'s shard is in hand. Two kinds of work are not:

- **own-shard work** (``LOCAL``): the slash tiles whose keys are the rank's own shard (the diagonal tile, and
  offsets that land back on the same rank) — that shard never leaves the rank, so this work can run at any
  step, in the backward too (its dK/dV accumulate locally and join the ring's dK/dV at the end);
- **gathered-column work** (``COLUMNS``): when each head's few vertical columns' K/V are all-gathered once
  before the ring, every query tile's column work needs no shard and can run at any step.

Placement, exact for divisible work: with ``F[r, s]`` the pinned work and ``T_r`` each rank's total, step
levels ``M_s = max(λ, max_r F[r, s])`` with the smallest ``λ`` such that ``Σ_s M_s >= max_r T_r`` leave every
rank room for its movable work (``Σ_s (M_s - F[r, s]) >= T_r - Σ_s F[r, s]``), and ``Σ_s M_s`` is the lower
bound ``max(Σ_s max_r F[r, s], max_r T_r)``: no schedule can do better. Each rank then pours its movable units
(one per (b, h, local query tile) and kind) in order into its room at the steps, a unit that straddles two
steps' room going to the step with the most room left. Where such a unit cannot fit anywhere, a step passes
its level by less than one unit (a tile's own-shard or column work, a few tiles). Should that make the ring
slower or its heaviest step heavier than the recompute-per-step ring (only on toy sizes, where one unit is a
large share of a step), the recompute schedule is returned instead: balancing never makes things worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.layout import Layout
from ..parallel.work import RingWork, TileWork, local_slot, ring_sources, tile_work
from ..sparse.pattern import AttentionPattern

LOCAL, COLUMNS = 0, 1  # the two planes of BalancedSchedule.assign


@dataclass(frozen=True)
class BalancedSchedule:
    """A ring schedule with its movable work placed, and the work per (rank, step) it gives.

    Attributes:
        assign: LongTensor ``[2, W, B, Hq, T]`` (``T`` = local query tiles per rank): the step at which rank
            ``r`` runs local query tile ``t`` of head ``(b, h)``'s own-shard slash tiles (``assign[LOCAL]``)
            and gathered-column work (``assign[COLUMNS]``). ``-1`` where that work is not moved: own-shard
            work then runs with the own shard (step 0), column work with the shard holding each column.
        sources: LongTensor ``[W, W]``, the shard each rank holds at each step (:func:`ring_sources`).
        work: the resulting :class:`RingWork`.
        level: float64 ``[W]``, the target step levels ``M_s`` (ring time bound ``level.sum()``).
    """

    assign: torch.Tensor
    sources: torch.Tensor
    work: RingWork
    level: torch.Tensor


def _levels(pinned: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Smallest step levels ``max(λ, max_r pinned[r, s])`` whose sum reaches ``max_r total[r]``: float64 ``[W]``.

    ``pinned``: float64 ``[W, W]`` (rank, step); ``total``: float64 ``[W]``, each rank's pinned + movable work.
    """
    floor = pinned.max(0).values
    need = float(total.max())
    if floor.sum() >= need:
        return floor
    # Raise λ through the sorted floors until the sum reaches the need: the first k sorted floors sit at λ.
    sorted_floor = floor.sort().values
    w = floor.numel()
    for k in range(1, w + 1):
        lam = (need - sorted_floor[k:].sum()) / k
        if k == w or lam <= sorted_floor[k]:
            return torch.maximum(floor, torch.full_like(floor, float(lam)))
    raise AssertionError("unreachable: k == w always returns")


def _pour(sizes: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """Step of each unit when ``sizes`` (float64 ``[U]``) are poured in order into ``room`` (float64 ``[W]``).

    Units that lie wholly inside one step's stretch of the cumulative room go there, so they never exceed
    it; the few that straddle a boundary (at most one per boundary, plus any past the end) then go one by one
    to the step with the most room left. Returns LongTensor ``[U]``.
    """
    room = room.clamp(min=0)
    ends = sizes.cumsum(0)
    bounds = room.cumsum(0)
    first = torch.searchsorted(bounds, ends - sizes, right=True)
    last = torch.searchsorted(bounds, ends)
    whole = (first == last) & (last < room.numel())
    step = torch.where(whole, first, 0)
    left = room - torch.zeros_like(room).index_add_(0, step[whole], sizes[whole])
    for unit in (~whole).nonzero().flatten().tolist():
        best = int(left.argmax())
        step[unit] = best
        left[best] -= sizes[unit]
    return step


def balance_ring(
    pattern: AttentionPattern,
    layout: Layout,
    *,
    inner: int | None = None,
    gather_columns: bool = True,
    move_local: bool = True,
) -> BalancedSchedule:
    """Balanced schedule of ``pattern`` on a ring over ``layout`` (see the module docstring).

    Args:
        pattern: the whole rows' pattern with its global index (and packed documents, if any), as in
            ``parallel.work.ring_work``.
        inner: ranks per inner ring of a hierarchical ring (default flat), as in :func:`ring_sources`.
        gather_columns: gather the columns' K/V once and place their work freely (else per step, pinned).
        move_local: place the own-shard slash work freely (else at the own shard's step, pinned).
    """
    tw = tile_work(pattern, layout)
    return balance_tile_work(
        tw, layout, ring_sources(layout.world, inner), gather_columns=gather_columns, move_local=move_local
    )


def balance_tile_work(
    tw: TileWork, layout: Layout, sources: torch.Tensor, *, gather_columns: bool, move_local: bool
) -> BalancedSchedule:
    """:func:`balance_ring` on precomputed :class:`TileWork` and ring ``sources`` ``[W, W]``."""
    w, bs = tw.world, tw.block_size
    b, heads, nb, _ = tw.slash.shape
    slash_tiles, slash_entries = tw.slash_pairs()
    column_tiles, column_entries = tw.column_pairs()
    own = torch.eye(w, dtype=torch.bool)

    # Movable units per (b, h, query block): work in tiles and entries.
    blocks = torch.arange(nb)
    own_slash = tw.slash[:, :, blocks, tw.owner]  # [B, H, nb]
    local_tiles = 1.0 + own_slash
    local_entries = tw.diagonal[:, None] + tw.slash_entries[:, :, blocks, tw.owner]
    col_tiles, col_entries = tw.columns.sum(-1) / bs, tw.column_entries.sum(-1)  # [B, H, nb]

    # Pinned work per (rank, key rank), then per (rank, step).
    pin_tiles = torch.where(own, 0.0, slash_tiles) if move_local else slash_tiles
    pin_entries = torch.where(own, 0.0, slash_entries) if move_local else slash_entries
    pin_cols = torch.zeros_like(column_tiles) if gather_columns else column_tiles
    pin_col_entries = torch.zeros_like(column_entries) if gather_columns else column_entries
    pinned = [x.gather(1, sources) for x in (pin_tiles, pin_cols, pin_entries + pin_col_entries)]
    pinned_work = pinned[0] + pinned[1]

    movable = []  # (kind, tile units [B, H, nb], column units [B, H, nb], entries [B, H, nb])
    if move_local:
        movable.append((LOCAL, local_tiles, torch.zeros_like(local_tiles), local_entries))
    if gather_columns:
        movable.append((COLUMNS, torch.zeros_like(col_tiles), col_tiles, col_entries))
    moved_total = torch.zeros(w, dtype=torch.float64)
    for _, t, c, _ in movable:
        moved_total.index_add_(0, tw.owner, (t + c).sum((0, 1)))
    level = _levels(pinned_work, pinned_work.sum(1) + moved_total)

    local_len = layout.local_len // bs
    assign = torch.full((2, w, b, heads, local_len), -1, dtype=torch.long)
    tiles, columns, entries = (x.clone() for x in pinned)
    for rank in range(w):
        mine = (tw.owner == rank).nonzero().flatten()  # its real query blocks, in global order
        slot = local_slot(layout, rank, mine)
        room = level - pinned_work[rank]
        for kind, t, c, e in movable:
            sizes = (t + c)[:, :, mine]  # [B, H, m]
            steps = _pour(sizes.flatten(), room).view(sizes.shape)
            room = room - torch.zeros(w, dtype=torch.float64).index_add_(0, steps.flatten(), sizes.flatten())
            assign[kind, rank][:, :, slot] = steps
            for acc, x in ((tiles, t), (columns, c), (entries, e)):
                acc[rank].index_add_(0, steps.flatten(), x[:, :, mine].flatten())
    balanced = RingWork(tiles, columns, entries)
    plain = [x.gather(1, sources) for x in (slash_tiles, column_tiles, slash_entries + column_entries)]
    if _worse(balanced.work, plain[0] + plain[1]):
        return BalancedSchedule(torch.full_like(assign, -1), sources, RingWork(*plain), level)
    return BalancedSchedule(assign, sources, balanced, level)


def _worse(work: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``work`` ``[W, W]`` has a longer ring time or a heavier step than ``reference``."""
    slack = 1e-9 * float(reference.max())
    ring_time, reference_time = work.max(0).values.sum(), reference.max(0).values.sum()
    return bool(ring_time > reference_time + slack or work.max() > reference.max() + slack)
