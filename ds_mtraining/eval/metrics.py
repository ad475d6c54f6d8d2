"""Attention fidelity metrics on a full attention matrix: true recall of an index, and the oracle index.

For one head with causal softmax probabilities ``P`` (``[N, N]``, rows sum to 1):

- *true recall* of a mask = mean over query rows of the probability mass inside the mask (over all rows,
  and over the last ``K`` rows — the estimator looks at the last rows, so both are reported);
- *density* = attended entries / causal entries ``N (N + 1) / 2`` (as :meth:`VerticalSlashIndex.density`).

Everything is computed from per-(query block, key) column sums ``T[qb, j] = Σ_{i in block qb} P[i, j]``, which
is all a vertical-slash index can distinguish: a slash offset ``o`` holds ``Σ_qb T[qb, (qb - o)-th block]``,
a column ``j`` holds ``T[qb, j]`` for every query block whose offset to ``j``'s block is not chosen.

The *oracle* index (:func:`oracle_path`) is built greedily from ``T``: starting from offset 0 (always in an
index), repeatedly add the candidate — a block offset or a key column — with the most not-yet-covered mass
per not-yet-covered entry, updating the overlaps exactly. Its path of (density, recall) points is the
density an index of the same family needs for a given recall, the yardstick for estimators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds_mtraining.sparse.index import VerticalSlashIndex

__all__ = [
    "BlockStats",
    "OraclePath",
    "block_stats",
    "causal_probs",
    "index_recall",
    "masked_recall",
    "oracle_index",
    "oracle_path",
    "oracle_paths",
    "relative_error",
]


def causal_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of one head: q ``[N, D]``, k ``[N, D]`` -> float32 ``[N, N]`` (zero above the diagonal)."""
    logits = (q.float() @ k.float().T) * scale
    n = q.shape[0]
    logits.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1)


def masked_recall(probs: torch.Tensor, mask: torch.Tensor, rows: int | None = None) -> float:
    """Mean mass inside ``mask`` over the last ``rows`` query rows (all rows if None): the definition, O(N²)."""
    rows = probs.shape[0] if rows is None else rows
    return float((probs[-rows:] * mask[-rows:]).sum(dtype=torch.float64) / rows)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per head ``‖out − ref‖ / ‖ref‖`` over rows and dims: ``[B, N, H, D]`` -> float64 ``[B, H]``."""
    diff = (out.double() - ref.double()).square().sum(dim=(1, 3)).sqrt()
    return diff / ref.double().square().sum(dim=(1, 3)).sqrt()


@dataclass(frozen=True)
class BlockStats:
    """Column sums of one head's probabilities per query block.

    Attributes:
        full: float64 ``[nb, N]``, ``Σ_{i in block qb} P[i, j]`` over all rows.
        last: float64 ``[nb, N]``, the same over the last ``last_rows`` rows only.
        last_rows: rows counted in ``last`` (a multiple of the block size).
        block_size: ``bs``.
    """

    full: torch.Tensor
    last: torch.Tensor
    last_rows: int
    block_size: int

    @property
    def seqlen(self) -> int:
        return self.full.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.full.shape[0]


def block_stats(probs: torch.Tensor, block_size: int, last_rows: int) -> BlockStats:
    """:class:`BlockStats` of ``probs`` ``[N, N]``; ``N`` and ``last_rows`` must be multiples of ``block_size``."""
    n = probs.shape[0]
    if n % block_size or last_rows % block_size or not 0 < last_rows <= n:
        raise ValueError(
            f"block_stats needs N={n} and last_rows={last_rows} to be multiples of block_size={block_size}, "
            f"0 < last_rows <= N"
        )
    nb = n // block_size
    full = probs.view(nb, block_size, n).sum(1).double()  # fp32 sums of bs terms; no N x N fp64 copy
    last = full.clone()
    last[: nb - last_rows // block_size] = 0
    return BlockStats(full, last, last_rows, block_size)


def _offset_mass(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mass per block offset: ``[..., nb, N]`` column sums -> float64 ``[..., nb]``."""
    nb = t.shape[-2]
    tiles = t.view(*t.shape[:-1], nb, block_size).sum(-1)  # [..., query block, key block]
    return torch.stack([tiles.diagonal(-o, dim1=-2, dim2=-1).sum(-1) for o in range(nb)], dim=-1)


def _column_mass(t: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per column, mass in query blocks whose offset to the column's block is NOT in ``offsets``: ``[N]``."""
    nb, n = t.shape
    cb = torch.arange(n, device=t.device) // block_size
    qb = torch.arange(nb, device=t.device)
    off = qb[:, None] - cb[None, :]  # [nb, N]
    uncovered = (off >= 0) & ~offsets[off.clamp(min=0)]
    return (t * uncovered).sum(0)


def index_recall(stats: BlockStats, index: VerticalSlashIndex, batch: int = 0, head: int = 0) -> tuple[float, float]:
    """True recall (all rows, last ``stats.last_rows`` rows) of one head of ``index``."""
    n, bs = stats.seqlen, stats.block_size
    if index.block_size != bs:
        raise ValueError(f"index block_size={index.block_size} differs from the stats' block_size={bs}")
    offsets = index.offset_mask(n)[batch, head]
    columns = index.column_mask(n)[batch, head]
    out = []
    for t, rows in ((stats.full, n), (stats.last, stats.last_rows)):
        slash = (_offset_mass(t, bs) * offsets).sum()
        vertical = (_column_mass(t, offsets, bs) * columns).sum()
        out.append(float((slash + vertical) / rows))
    return out[0], out[1]


@dataclass(frozen=True)
class OraclePath:
    """The greedy oracle's steps: after step ``s`` the index holds the first ``s + 1`` chosen candidates.

    Attributes:
        density, recall, recall_last: float64 ``[steps]``.
        kind: int8 ``[steps]``, 0 = block offset, 1 = key column; ``choice``: int64 ``[steps]``, which one.
    """

    density: torch.Tensor
    recall: torch.Tensor
    recall_last: torch.Tensor
    kind: torch.Tensor
    choice: torch.Tensor

    def density_at(self, recall: float) -> float:
        """Density the path needs for ``recall``, linear between its steps (its last density if never reached)."""
        hit = (self.recall >= recall).nonzero()
        if not hit.numel():
            return float(self.density[-1])
        s = int(hit[0])
        if s == 0:
            return float(self.density[0])
        r0, r1 = float(self.recall[s - 1]), float(self.recall[s])
        d0, d1 = float(self.density[s - 1]), float(self.density[s])
        return d0 + (d1 - d0) * (recall - r0) / max(r1 - r0, 1e-12)

    def first_reaching(self, target: float) -> int:
        """Step where ``recall >= target`` first holds (the last step if never)."""
        hit = (self.recall >= target).nonzero()
        return int(hit[0]) if hit.numel() else self.recall.numel() - 1


# The oracle loop synchronises with the host only every this many steps (a step past a head's end changes nothing).
SYNC_EVERY = 64


def oracle_path(stats: BlockStats, max_recall: float = 0.99) -> OraclePath:
    """Greedy mass-per-entry path from offset 0 until the all-rows recall reaches ``max_recall`` (one head)."""
    return oracle_paths([stats], [max_recall])[0]


def oracle_paths(stats: Sequence[BlockStats], max_recall: Sequence[float]) -> list[OraclePath]:
    """:func:`oracle_path` of several heads of one sequence at once, on their device: every step picks each head's
    next candidate in one batch of tensor operations, and the host checks for the end only every
    :data:`SYNC_EVERY` steps, so a GPU runs the long sequential loop without a synchronisation per step.

    ``stats``: one :class:`BlockStats` per head, all of the same ``N``, block size and ``last_rows``;
    ``max_recall``: each head's stopping recall. Returns one path per head, on the CPU.
    """
    bs, last_rows = stats[0].block_size, stats[0].last_rows
    heads, (nb, n) = len(stats), stats[0].full.shape
    dev, f64 = stats[0].full.device, torch.float64
    t = torch.empty(2, heads, nb, n, dtype=f64, device=dev)  # all rows, last rows
    for i, s in enumerate(stats):
        t[0, i], t[1, i] = s.full, s.last
    causal = n * (n + 1) / 2
    goal = torch.tensor(list(max_recall), dtype=f64, device=dev)
    col_block = torch.arange(n, device=dev) // bs
    o = torch.arange(nb, device=dev)
    # One axis of candidates, the nb offsets then the N columns (an offset wins a tie, as the first maximum), and
    # per candidate its uncovered mass over all rows and the last rows, and its uncovered entries: [3, H, nb + N].
    state = torch.empty(3, heads, nb + n, dtype=f64, device=dev)
    state[:2, :, :nb] = _offset_mass(t, bs)
    state[:2, :, nb:] = t.sum(2)
    state[2, :, :nb] = (nb - o) * bs * bs
    state[2, :, 0] = nb * bs * (bs + 1) / 2
    # Offset 0 is chosen first, so a column's own block (where its cost has a partial triangle) is always covered
    # and a column costs bs entries per uncovered query block.
    state[2, :, nb:] = (nb - col_block) * bs
    chosen = torch.zeros(heads, nb + n, dtype=torch.bool, device=dev)
    # Every step records one candidate per head: at most nb + N steps, plus the rounds after the last end.
    size = nb + n + SYNC_EVERY + 1
    path = torch.zeros(3, heads, size, dtype=f64, device=dev)  # density, recall, recall over the last rows
    kind = torch.zeros(heads, size, dtype=torch.int8, device=dev)
    choice = torch.zeros(heads, size, dtype=torch.long, device=dev)
    steps = torch.ones(heads, dtype=torch.long, device=dev)
    rows = torch.arange(heads, device=dev)
    per = torch.tensor([causal, n, last_rows], dtype=f64, device=dev)[:, None]  # density, recall, recall last
    # On the host a check is free, and skips the update no head needs; a GPU runs both, masked, without waiting.
    host = dev.type == "cpu"

    def add_offsets(k: torch.Tensor, pick: torch.Tensor) -> None:
        """Offset ``k[h]`` for the heads where ``pick``: the columns lose their entries in its tiles."""
        qb = col_block + k[:, None]  # [H, N]: the query block at offset k from each column's block
        ok = (qb < nb) & pick[:, None]
        lost = t.gather(2, qb.clamp(max=nb - 1)[None, :, None, :].expand(2, -1, 1, -1))[:, :, 0]  # [2, H, N]
        state[:2, :, nb:] -= torch.where(ok, lost, 0.0)
        state[2, :, nb:] -= ok * bs

    def add_columns(j: torch.Tensor, pick: torch.Tensor) -> None:
        """Column ``j[h]`` for the heads where ``pick``: the offsets 0 .. nb - 1 - j // bs that reach it lose it."""
        cb = j // bs
        reach = (o < nb - cb[:, None]) & pick[:, None]  # [H, nb]
        column = t.gather(3, j[None, :, None, None].expand(2, -1, nb, 1))[..., 0]  # [2, H, nb]
        at = (cb[:, None] + o).clamp(max=nb - 1)  # the query block where offset o meets column j
        state[:2, :, :nb] -= torch.where(reach, column.gather(2, at.expand(2, -1, -1)), 0.0)
        state[2, :, :nb] -= reach * bs

    every = torch.ones(heads, dtype=torch.bool, device=dev)
    totals = state[:, :, 0].clone()  # [3, H]: covered mass, covered mass over the last rows, entries
    chosen[:, 0] = True
    add_offsets(torch.zeros(heads, dtype=torch.long, device=dev), every)
    path[:, :, 0] = totals[[2, 0, 1]] / per
    active = path[1, :, 0] < goal
    step = 1
    while True:
        if step % SYNC_EVERY == 0 and not bool(active.any()):
            break
        ratio = torch.where(chosen | (state[2] <= 0), -1.0, state[0] / state[2].clamp(min=1))
        best = ratio.argmax(-1)  # [H]
        active &= ratio.gather(1, best[:, None])[:, 0] >= 0  # a head with everything covered ends
        totals += torch.where(active, state.gather(2, best[None, :, None].expand(3, -1, 1))[..., 0], 0.0)
        chosen[rows, best] |= active
        is_offset = best < nb
        pick_o, pick_c = active & is_offset, active & ~is_offset
        if not host or bool(pick_o.any()):
            add_offsets(best.clamp(max=nb - 1), pick_o)
        if not host or bool(pick_c.any()):
            add_columns((best - nb).clamp(min=0), pick_c)
        path[:, :, step] = totals[[2, 0, 1]] / per
        kind[:, step], choice[:, step] = (~is_offset).to(torch.int8), torch.where(is_offset, best, best - nb)
        steps += active
        active &= path[1, :, step] < goal
        step += 1
    counts = steps.tolist()
    (dens, rec, recl), kind, choice = path.cpu(), kind.cpu(), choice.cpu()
    return [OraclePath(dens[i, :c], rec[i, :c], recl[i, :c], kind[i, :c], choice[i, :c]) for i, c in enumerate(counts)]


def oracle_index(path: OraclePath, step: int, block_size: int) -> VerticalSlashIndex:
    """The oracle's index after ``step`` (one head: batch 1, heads 1)."""
    kind, choice = path.kind[: step + 1], path.choice[: step + 1]
    vertical = choice[kind == 1].view(1, 1, -1)
    slash = choice[kind == 0].view(1, 1, -1)
    return VerticalSlashIndex.build(vertical, slash, block_size)
