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
    """Mass per block offset: ``[nb, N]`` column sums -> float64 ``[nb]``."""
    nb = t.shape[0]
    tiles = t.view(nb, nb, block_size).sum(-1)  # [query block, key block]
    return torch.stack([tiles.diagonal(-o).sum() for o in range(nb)])


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


def oracle_path(stats: BlockStats, max_recall: float = 0.99) -> OraclePath:
    """Greedy mass-per-entry path from offset 0 until the all-rows recall reaches ``max_recall``."""
    t, tl, bs = stats.full, stats.last, stats.block_size
    nb, n = t.shape
    dev = t.device
    causal = n * (n + 1) / 2
    col_block = torch.arange(n, device=dev) // bs
    # Gains (uncovered mass, all rows and last rows) and costs (uncovered entries) of every candidate.
    h, hl = _offset_mass(t, bs), _offset_mass(tl, bs)
    o = torch.arange(nb, device=dev, dtype=torch.float64)
    u = (nb - o) * bs * bs
    u[0] = nb * bs * (bs + 1) / 2
    offsets = torch.zeros(nb, dtype=torch.bool, device=dev)
    columns = torch.zeros(n, dtype=torch.bool, device=dev)
    # Columns: offset 0 is chosen first, so a column's own block (where its cost has a partial triangle)
    # is always covered and a column costs bs entries per uncovered query block.
    g = t.sum(0)
    gl = tl.sum(0)
    w = (nb - col_block).double() * bs

    def add_offset(k: int) -> None:
        offsets[k] = True
        qb = col_block + k
        ok = qb < nb
        idx = qb.clamp(max=nb - 1)
        g.sub_(torch.where(ok, t[idx, torch.arange(n, device=dev)], 0.0))
        gl.sub_(torch.where(ok, tl[idx, torch.arange(n, device=dev)], 0.0))
        w.sub_(ok.double() * bs)

    def add_column(j: int) -> None:
        columns[j] = True
        cb = j // bs
        span = nb - cb  # offsets 0 .. nb - 1 - cb reach column j
        h[:span] -= t[cb:, j]
        hl[:span] -= tl[cb:, j]
        u[:span] -= bs

    mass, mass_last, cost = float(h[0]), float(hl[0]), float(u[0])
    add_offset(0)
    dens, rec, recl, kinds, choices = [cost / causal], [mass / n], [mass_last / stats.last_rows], [0], [0]
    while rec[-1] < max_recall:
        ratio_o = torch.where(offsets | (u <= 0), -1.0, h / u.clamp(min=1))
        ratio_c = torch.where(columns | (w <= 0), -1.0, g / w.clamp(min=1))
        best_o, best_c = int(ratio_o.argmax()), int(ratio_c.argmax())
        if max(float(ratio_o[best_o]), float(ratio_c[best_c])) < 0:
            break  # everything covered
        if float(ratio_o[best_o]) >= float(ratio_c[best_c]):
            mass, mass_last, cost = mass + float(h[best_o]), mass_last + float(hl[best_o]), cost + float(u[best_o])
            add_offset(best_o)
            kinds.append(0), choices.append(best_o)
        else:
            mass, mass_last, cost = mass + float(g[best_c]), mass_last + float(gl[best_c]), cost + float(w[best_c])
            add_column(best_c)
            kinds.append(1), choices.append(best_c)
        dens.append(cost / causal), rec.append(mass / n), recl.append(mass_last / stats.last_rows)
    f64 = torch.float64
    return OraclePath(
        density=torch.tensor(dens, dtype=f64),
        recall=torch.tensor(rec, dtype=f64),
        recall_last=torch.tensor(recl, dtype=f64),
        kind=torch.tensor(kinds, dtype=torch.int8),
        choice=torch.tensor(choices, dtype=torch.long),
    )


def oracle_index(path: OraclePath, step: int, block_size: int) -> VerticalSlashIndex:
    """The oracle's index after ``step`` (one head: batch 1, heads 1)."""
    kind, choice = path.kind[: step + 1], path.choice[: step + 1]
    vertical = choice[kind == 1].view(1, 1, -1)
    slash = choice[kind == 0].view(1, 1, -1)
    return VerticalSlashIndex.build(vertical, slash, block_size)
