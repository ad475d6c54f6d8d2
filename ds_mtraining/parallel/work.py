"""Sparse work of a ring schedule: exact tiles, columns and attended entries per (rank, ring step).

The ring's schedule ("recompute per step"): at step ``s`` rank ``r`` holds the KV shard of rank
``src[r, s]`` (flat ring: ``(r - s) mod W``) and computes, for every (batch, query head) and every local query
tile of global block ``i``:

- the slash tiles ``(i, i - o)`` for ``o`` in ``S[b, h]`` whose key block is in that shard; the diagonal tile
  (``o = 0``, a causal triangle) counts as one whole tile, as the kernels compute it (masked) at full cost —
  ``entries`` holds the exact triangle instead;
- the vertical columns ``c`` in that shard that tile ``i`` does not already hold in a chosen tile, i.e.
  ``i - c // bs`` not in ``S[b, h]`` (offset 0 is always chosen, so such a column is in an earlier block);
  a column costs ``bs`` rows by one key, ``1 / bs`` of a tile.

Query blocks made only of layout padding (past ``seqlen``) are not counted: a ring should skip them.

Packed documents (the pattern's, ``sparse.pattern.AttentionPattern``): the kernels skip a key tile that ends before
the document of a query tile's first row and a column before it (docs/design.md, "Packed documents"), so a tile
or column counts only when it holds a key at or after that start. Only the rows of the document carried into a
block from before it attend anything outside the block's diagonal tile, which gives the exact entries.

Counting: the number of slash tiles of query block ``i`` whose key block lies on rank ``r'`` is
``Σ_o M[o] · 1_{r'}[i - o]`` — a causal convolution of the head's chosen-offset indicator ``M`` with the
rank's block indicator; the columns of ``i`` on ``r'`` convolve the unchosen-offset indicator with the number
of columns per block held by ``r'``. Both are done with FFTs on integer-valued float64 data and rounded, so the
counts are exact and a 512K-token, 32-rank, 32-head index takes well under a second. With documents the
windows differ per query block, so the tiles and columns are enumerated instead (heads in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sparse.documents import Documents
from ..sparse.index import VerticalSlashIndex
from ..sparse.pattern import AttentionPattern
from .layout import Layout

# Heads per FFT batch: bounds the complex working set ([heads, W, 2 * blocks], ~64 MB at 8192 blocks, W = 32).
_FFT_ELEMENTS = 1 << 22
# Heads per enumeration batch under documents: bounds the [heads, blocks, entries] working set.
_ENUM_ELEMENTS = 1 << 24


def ring_sources(world: int, inner: int | None = None) -> torch.Tensor:
    """Which rank's KV shard each rank holds at each ring step: LongTensor ``[W, W]`` (rank, step).

    Flat ring (``inner`` None or ``world``): ``src[r, s] = (r - s) mod W``. Hierarchical ring with ``inner``
    ranks per node (``world % inner == 0``): step ``s = t · inner + u`` is inner step ``u`` of outer step
    ``t``; rank ``r = n · inner + g`` then holds rank ``((n - t) mod nodes) · inner + (g - u) mod inner``.
    """
    inner = world if inner is None else inner
    if inner < 1 or world % inner:
        raise ValueError(f"inner ring size {inner} must divide the world size {world} (e.g. GPUs per node)")
    rank, step = torch.arange(world)[:, None], torch.arange(world)[None, :]
    nodes = world // inner
    node = (rank // inner - step // inner) % nodes
    return node * inner + (rank % inner - step % inner) % inner


@dataclass(frozen=True)
class TileWork:
    """Work of every (batch, query head, query block), split by the rank that holds the keys.

    Attributes:
        owner: LongTensor ``[nb]``, ring rank holding each global block (``nb = ceil(seqlen / bs)``).
        rows: float64 ``[nb]``, real query rows of each block (``bs``, fewer in a partial last block).
        slash: float64 ``[B, Hq, nb, W]``, off-diagonal slash tiles (offset >= 1) of query block ``i`` whose
            key block is on rank ``r'``. Each (b, h, i) also has exactly one diagonal tile, on ``owner[i]``.
        columns: float64 ``[B, Hq, nb, W]``, vertical columns attended by query block ``i`` (outside its
            chosen tiles) that lie on rank ``r'``; integers, in columns (not tiles).
        slash_entries, column_entries: float64 ``[B, Hq, nb, W]``, the attended entries of those tiles and
            columns (``rows · bs`` per tile and ``rows`` per column without documents).
        diagonal: float64 ``[B, nb]``, attended entries of each block's diagonal tile (a causal triangle,
            cut further at document starts).
        block_size: tile size ``bs``.
    """

    owner: torch.Tensor
    rows: torch.Tensor
    slash: torch.Tensor
    columns: torch.Tensor
    slash_entries: torch.Tensor
    column_entries: torch.Tensor
    diagonal: torch.Tensor
    block_size: int

    @property
    def world(self) -> int:
        return self.slash.shape[-1]

    def slash_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Slash tiles (diagonal included) and their entries per (query rank, key rank): float64 ``[W, W]`` each."""
        w, heads = self.world, self.slash.shape[1]
        diagonal = torch.zeros(w, dtype=torch.float64).index_add_(0, self.owner, torch.ones_like(self.rows))
        triangles = torch.zeros(w, dtype=torch.float64).index_add_(0, self.owner, self.diagonal.sum(0))
        tiles = self._by_query_rank(self.slash.sum((0, 1))) + self.slash.shape[0] * heads * diagonal.diag()
        entries = self._by_query_rank(self.slash_entries.sum((0, 1))) + heads * triangles.diag()
        return tiles, entries

    def column_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Column work (tile units) and its entries per (query rank, key rank): float64 ``[W, W]`` each."""
        columns = self._by_query_rank(self.columns.sum((0, 1))) / self.block_size
        return columns, self._by_query_rank(self.column_entries.sum((0, 1)))

    def _by_query_rank(self, per_block: torch.Tensor) -> torch.Tensor:
        """Sum ``[nb, W]`` rows over the query blocks of each rank: ``[W, W]``."""
        return torch.zeros(self.world, self.world, dtype=torch.float64).index_add_(0, self.owner, per_block)


def _causal_conv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out[..., i] = Σ_{o <= i} b[..., o] · a[..., i - o]`` for integer-valued float64 ``a``, ``b`` ``[..., n]``.

    Broadcasts over leading dims; exact (FFT result rounded; the error is far below 0.5 at these sizes).
    """
    n = a.shape[-1]
    size = 2 * n
    out = torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)[..., :n]
    return out.round()


def tile_work(pattern: AttentionPattern, layout: Layout) -> TileWork:
    """Exact per-(b, h, query block, key rank) work of ``pattern`` on a ring over ``layout`` (see module doc).

    ``pattern`` covers the whole rows (``layout.seqlen`` tokens) with an index of the layout's block size, and
    the rows' packed documents if any.
    """
    index, documents = _sparse(pattern, layout, "tile_work")
    bs, n, w = index.block_size, layout.seqlen, layout.world
    if layout.block_size != bs:
        raise ValueError(
            f"the layout keeps tiles of {layout.block_size} tokens whole but the index's block size is {bs}; "
            f"build the layout with block_size={bs}"
        )
    index = VerticalSlashIndex(index.vertical.cpu(), index.slash.cpu(), bs)
    index.validate(n)
    nb = index.num_blocks(n)
    owner = layout.block_owner()[:nb]
    rows = torch.full((nb,), float(bs), dtype=torch.float64)
    rows[-1] = n - (nb - 1) * bs
    b, heads = index.batch, index.heads
    if documents is not None:
        slash, columns, slash_entries, column_entries, diagonal = _document_work(
            index, documents.starts.cpu(), owner, w
        )
        return TileWork(owner, rows, slash, columns, slash_entries, column_entries, diagonal, bs)

    ranks = torch.nn.functional.one_hot(owner, w).T.double()  # [W, nb], 1 where rank r' holds block j
    chosen = index.offset_mask(n).reshape(b * heads, nb).double()
    unchosen = 1.0 - chosen
    chosen[:, 0] = 0.0  # the diagonal is counted apart
    unchosen[:, 0] = 0.0  # a column in the query's own block is inside the diagonal tile
    # Columns per (head, block); padding (-1) lands in an extra bin that is cut off.
    vertical = index.vertical.reshape(b * heads, -1)
    col_block = torch.where(vertical >= 0, vertical // bs, nb)
    per_block = torch.zeros(b * heads, nb + 1, dtype=torch.float64)
    per_block.scatter_add_(1, col_block, torch.ones_like(col_block, dtype=torch.float64))
    per_block = per_block[:, :nb]

    slash = torch.empty(b * heads, nb, w, dtype=torch.float64)
    columns = torch.empty(b * heads, nb, w, dtype=torch.float64)
    step = max(1, _FFT_ELEMENTS // (w * 2 * nb))
    for h0 in range(0, b * heads, step):
        h1 = min(b * heads, h0 + step)
        slash[h0:h1] = _causal_conv(ranks[None], chosen[h0:h1, None]).transpose(1, 2)
        columns[h0:h1] = _causal_conv(ranks[None] * per_block[h0:h1, None], unchosen[h0:h1, None]).transpose(1, 2)
    slash, columns = slash.view(b, heads, nb, w), columns.view(b, heads, nb, w)
    diagonal = (rows * (rows + 1) / 2).expand(b, nb)
    per_row = rows[:, None]
    return TileWork(owner, rows, slash, columns, slash * per_row * bs, columns * per_row, diagonal, bs)


@dataclass(frozen=True)
class PairWork:
    """Work per (query rank, key rank), summed over batch, heads and query blocks: what a ring schedule needs.

    :class:`TileWork` keeps ``[B, Hq, nb, W]`` per query block, too large at a thousand ranks and millions of tokens;
    this keeps ``[W, W]`` (and the column work per query block, which the gathered-column schedule places).

    Attributes:
        owner: LongTensor ``[nb]``, the rank holding each block.
        tiles / slash_entries: float64 ``[W, W]``, slash tiles (the diagonal as one) and their entries.
        columns / column_entries: float64 ``[W, W]``, column work (tile units) and its entries.
        block_columns / block_column_entries: float64 ``[nb]``, columns attended by each query block (over every
            head and key rank) and their entries.
        block_size: tile size ``bs``.
    """

    owner: torch.Tensor
    tiles: torch.Tensor
    slash_entries: torch.Tensor
    columns: torch.Tensor
    column_entries: torch.Tensor
    block_columns: torch.Tensor
    block_column_entries: torch.Tensor
    block_size: int

    @property
    def world(self) -> int:
        return self.tiles.shape[0]

    def slash_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`TileWork.slash_pairs`."""
        return self.tiles, self.slash_entries

    def column_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`TileWork.column_pairs`."""
        return self.columns, self.column_entries

    @classmethod
    def from_tile_work(cls, tw: TileWork) -> PairWork:
        """The sums of a :class:`TileWork` (the path with documents)."""
        return cls(
            tw.owner,
            *tw.slash_pairs(),
            *tw.column_pairs(),
            tw.columns.sum((0, 1, 3)),
            tw.column_entries.sum((0, 1, 3)),
            tw.block_size,
        )


def pair_work(pattern: AttentionPattern, layout: Layout) -> PairWork:
    """:class:`PairWork` of ``pattern`` on ``layout`` (arguments as :func:`tile_work`).

    Without documents the counts are :func:`tile_work`'s convolutions, taken a chunk of heads and of key ranks at a
    time and summed into ``[W, W]`` at once, so memory stays bounded at any W and length (1024 ranks at 4M tokens);
    with documents, :func:`tile_work`'s enumeration, summed.
    """
    if pattern.documents is not None:
        return PairWork.from_tile_work(tile_work(pattern, layout))
    index, _ = _sparse(pattern, layout, "pair_work")
    bs, n, w = index.block_size, layout.seqlen, layout.world
    if layout.block_size != bs:
        raise ValueError(
            f"the layout keeps tiles of {layout.block_size} tokens whole but the index's block size is {bs}; "
            f"build the layout with block_size={bs}"
        )
    index = VerticalSlashIndex(index.vertical.cpu(), index.slash.cpu(), bs)
    index.validate(n)
    nb = index.num_blocks(n)
    owner = layout.block_owner()[:nb]
    rows = torch.full((nb,), float(bs), dtype=torch.float64)
    rows[-1] = n - (nb - 1) * bs
    b, heads = index.batch, index.heads
    ranks = torch.nn.functional.one_hot(owner, w).T.double()  # [W, nb]
    chosen = index.offset_mask(n).reshape(b * heads, nb).double()
    unchosen = 1.0 - chosen
    chosen[:, 0] = 0.0  # the diagonal is counted apart
    unchosen[:, 0] = 0.0  # a column in the query's own block is inside the diagonal tile
    vertical = index.vertical.reshape(b * heads, -1)
    col_block = torch.where(vertical >= 0, vertical // bs, nb)
    per_block = torch.zeros(b * heads, nb + 1, dtype=torch.float64)
    per_block.scatter_add_(1, col_block, torch.ones_like(col_block, dtype=torch.float64))
    per_block = per_block[:, :nb]

    tiles, slash_entries, columns, column_entries = (torch.zeros(w, w, dtype=torch.float64) for _ in range(4))
    block_columns = torch.zeros(nb, dtype=torch.float64)
    ranks_step = max(1, min(w, _FFT_ELEMENTS // (2 * nb)))

    def by_query_rank(per_block_rank: torch.Tensor) -> torch.Tensor:  # [wc, nb] -> [W, wc]
        return torch.zeros(w, per_block_rank.shape[0], dtype=torch.float64).index_add_(0, owner, per_block_rank.T)

    # The slash count is linear in the chosen offsets: one convolution of their sum over (batch, heads).
    chosen_sum = chosen.sum(0)
    for r0 in range(0, w, ranks_step):
        r1 = min(w, r0 + ranks_step)
        slash = _causal_conv(ranks[r0:r1], chosen_sum[None])  # [wc, nb]
        tiles[:, r0:r1] += by_query_rank(slash)
        slash_entries[:, r0:r1] += by_query_rank(slash * rows * bs)
    # The columns pair each head's columns with its own offsets: per head, and only heads that have columns.
    with_columns = per_block.sum(1).nonzero().flatten()
    heads_step = max(1, _FFT_ELEMENTS // (ranks_step * 2 * nb))
    for h0 in range(0, with_columns.numel(), heads_step):
        picked = with_columns[h0 : h0 + heads_step]
        for r0 in range(0, w, ranks_step):
            r1 = min(w, r0 + ranks_step)
            cols = _causal_conv(ranks[None, r0:r1] * per_block[picked, None], unchosen[picked, None]).sum(0)
            columns[:, r0:r1] += by_query_rank(cols) / bs
            column_entries[:, r0:r1] += by_query_rank(cols * rows)
            block_columns += cols.sum(0)
    blocks = torch.zeros(w, dtype=torch.float64).index_add_(0, owner, torch.ones_like(rows))
    triangles = torch.zeros(w, dtype=torch.float64).index_add_(0, owner, rows * (rows + 1) / 2)
    tiles += b * heads * blocks.diag()
    slash_entries += b * heads * triangles.diag()
    return PairWork(owner, tiles, slash_entries, columns, column_entries, block_columns, block_columns * rows, bs)


def _sparse(pattern: AttentionPattern, layout: Layout, caller: str) -> tuple[VerticalSlashIndex, Documents | None]:
    """The index and documents of a pattern over the layout's whole rows; ValueError naming the mismatch otherwise."""
    if not isinstance(pattern, AttentionPattern) or pattern.index is None:
        got = type(pattern).__name__ if not isinstance(pattern, AttentionPattern) else "a dense pattern"
        raise ValueError(f"{caller} needs an AttentionPattern with an index; got {got}")
    if pattern.seqlen != layout.seqlen:
        raise ValueError(
            f"{caller}: the pattern is for rows of {pattern.seqlen} tokens but the layout's are {layout.seqlen}"
        )
    return pattern.index, pattern.documents


def _document_work(index: VerticalSlashIndex, starts: torch.Tensor, owner: torch.Tensor, world: int):
    """``tile_work``'s counts under documents ``starts`` (LongTensor ``[B, N]``), by enumeration.

    Query block ``i``'s first row starts its document at ``s`` (the block's smallest start). Unless ``s`` lies
    before the block, every row's document starts inside it and only the diagonal tile has work. Otherwise a
    tile of key block ``j < i`` counts when ``(j + 1) · bs > s`` and a column ``c`` when ``c >= s``, and only the
    ``carried`` rows whose start is ``s`` attend them: ``carried · |[max(s, j · bs), (j + 1) · bs)|`` entries a
    tile, ``carried`` a column.
    """
    bs, n = index.block_size, starts.shape[1]
    b, heads = index.batch, index.heads
    nb = owner.numel()
    block = torch.arange(nb)
    # Per block: its first row's start, the carried rows and the diagonal tile's entries (row r: [max(start,
    # block start), r]), [B, nb] each; shared with VerticalSlashIndex.density.
    blocks = Documents(starts).blocks(bs)
    first, carried, diagonal = blocks.first, blocks.carried, blocks.diagonal

    chosen = index.offset_mask(n)  # [B, Hq, nb]
    shape = (b, heads, nb, world + 1)  # one spare rank bin for what does not count
    slash, slash_entries, columns, column_entries = (torch.zeros(shape, dtype=torch.float64) for _ in range(4))
    owner_bin = torch.cat([owner, owner.new_tensor([world])])
    step = max(1, _ENUM_ELEMENTS // (nb * max(index.slash.shape[-1], index.vertical.shape[-1])))
    for bi in range(b):
        s, weight = first[bi][:, None], carried[bi][:, None]  # [nb, 1]
        for h0 in range(0, heads, step):
            h1 = min(heads, h0 + step)
            offsets = index.slash[bi, h0:h1, None, :]  # [h, 1, Ks]
            key = block[:, None] - offsets  # [h, nb, Ks]
            ok = (offsets >= 1) & (key >= 0) & ((key + 1) * bs > s) & (weight > 0)
            keys_seen = ((key + 1) * bs - torch.maximum(s, key * bs)).clamp(0, bs).double()
            where = torch.where(ok, owner_bin[key.clamp(0, nb - 1)], world)
            slash[bi, h0:h1].scatter_add_(-1, where, ok.double())
            slash_entries[bi, h0:h1].scatter_add_(-1, where, ok * keys_seen * weight)

            vertical = index.vertical[bi, h0:h1, None, :]  # [h, 1, Kv]
            col_block = vertical.clamp(min=0) // bs
            offset = (block[:, None] - col_block).clamp(0, nb - 1)  # [h, nb, Kv]
            ok = (vertical >= 0) & (col_block < block[:, None]) & (vertical >= s) & (weight > 0)
            ok &= ~chosen[bi, h0:h1].gather(1, offset.flatten(1)).view(offset.shape)
            where = torch.where(ok, owner_bin[col_block.expand_as(ok)], world)
            columns[bi, h0:h1].scatter_add_(-1, where, ok.double())
            column_entries[bi, h0:h1].scatter_add_(-1, where, ok * weight)
    return (*(x[..., :world] for x in (slash, columns, slash_entries, column_entries)), diagonal)


class StepLoadMetrics:
    """Imbalance metrics of a load ``work`` (float64 ``[W, S]``, rank × ring step, any unit: tiles, ms)."""

    work: torch.Tensor

    @property
    def worker_imbalance(self) -> float:
        """max / mean over ranks of each rank's total work."""
        total = self.work.sum(1)
        return float(total.max() / total.mean())

    @property
    def step_worker_imbalance(self) -> float:
        """Per step max / mean over ranks, averaged over the steps that have any work."""
        work = self.work
        busy = work.sum(0) > 0
        return float((work.max(0).values[busy] / work.mean(0)[busy]).mean())

    @property
    def step_imbalance_per_rank(self) -> torch.Tensor:
        """For each rank, max / mean over its steps: float64 ``[W]`` (1 for a rank without work)."""
        work = self.work
        mean = work.mean(1)
        return torch.where(mean > 0, work.max(1).values / mean.clamp(min=1e-300), 1.0)

    @property
    def step_imbalance(self) -> float:
        """The worst rank's step-level imbalance (max over ranks of :attr:`step_imbalance_per_rank`)."""
        return float(self.step_imbalance_per_rank.max())

    @property
    def ring_efficiency(self) -> float:
        """Σ_steps mean_r(work) / Σ_steps max_r(work): 1 when no rank ever waits for another."""
        work = self.work
        return float(work.mean(0).sum() / work.max(0).values.sum())


@dataclass(frozen=True)
class StepLoad(StepLoadMetrics):
    """A measured load per (rank, step), e.g. the ring's compute times (``RingTrace`` gathered over ranks)."""

    work: torch.Tensor


@dataclass(frozen=True)
class RingWork(StepLoadMetrics):
    """Work per (rank, ring step) of one attention call; all float64 ``[W, W]`` indexed ``[rank, step]``.

    Attributes:
        tiles: slash tiles (the diagonal tile counts as one).
        columns: vertical-column work in tile units (columns × query tiles / ``bs``).
        entries: exact attended (query, key) entries (the diagonal as its causal triangle).
    """

    tiles: torch.Tensor
    columns: torch.Tensor
    entries: torch.Tensor

    @property
    def work(self) -> torch.Tensor:
        """Kernel work in tile units: ``tiles + columns``, float64 ``[W, W]``."""
        return self.tiles + self.columns

    def per_call(self, group: int) -> RingWork:
        """The work per kernel call when each ``group`` consecutive steps run as one (an all-gathered inner group):
        ``[W, W / group]``."""
        return RingWork(*(summed_steps(x, group) for x in (self.tiles, self.columns, self.entries)))


def ring_work(
    pattern: AttentionPattern, layout: Layout, *, inner: int | None = None, kv_exchange: str = "ring"
) -> RingWork:
    """Exact work per (rank, step) of ``pattern`` on a ring over ``layout`` (see the module docstring).

    Args:
        pattern: the whole rows' pattern (``layout.seqlen`` tokens) with its global index, whose block size is the
            kernels' tile size, and the rows' packed documents if any.
        layout: token layout over the ring's ``W`` ranks, built with the index's block size.
        inner: ranks per inner ring of a hierarchical ring (default: a flat ring); see :func:`ring_sources`.
        kv_exchange: ``"all_gather"``: each inner group's K/V is gathered and attended in one step, whose work is
            that of the ``inner`` ring steps it replaces (``[W, W / inner]``); ``"ring"``: ``[W, W]``.
    """
    work = work_on_schedule(pair_work(pattern, layout), ring_sources(layout.world, inner))
    return work if kv_exchange == "ring" else work.per_call(inner or layout.world)


def summed_steps(per_step: torch.Tensor, group: int) -> torch.Tensor:
    """``[W, W]`` per ring step -> ``[W, W / group]`` per all-gathered step (consecutive inner steps summed)."""
    return per_step.view(per_step.shape[0], -1, group).sum(-1)


def work_on_schedule(work: TileWork | PairWork, sources: torch.Tensor) -> RingWork:
    """:class:`RingWork` of ``work`` when rank ``r`` holds shard ``sources[r, s]`` at step ``s`` (``[W, W]``)."""
    tiles, slash_entries = work.slash_pairs()
    columns, column_entries = work.column_pairs()
    return RingWork(*(x.gather(1, sources) for x in (tiles, columns, slash_entries + column_entries)))


def local_slot(layout: Layout, rank: int, blocks: torch.Tensor) -> torch.Tensor:
    """Local tile index on ``rank`` of each global block in ``blocks``: LongTensor like ``blocks``."""
    ids = layout.block_ids(rank)
    slot = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
    slot[ids] = torch.arange(ids.numel())
    return slot[blocks]


COLUMN_CHUNK = 64
"""Columns the step kernels gather at a time (the forward's ``BLOCK_N`` at block 64): the unit of :func:`walked_columns`."""


def walked_columns(pattern: AttentionPattern, layout: Layout) -> torch.Tensor:
    """Column chunks a ring step's kernels walk: float64 ``[W, W]`` by (query rank, key rank).

    The kernels visit, for every (batch, head) and local query tile ``i``, every column of their index before the
    tile, in chunks of :data:`COLUMN_CHUNK`, loading and masking those they do not attend rather than skipping them
    (``sparse.triton.forward``): a cost apart from the attended work (the measured step costs,
    ``benchmarks/ring_steps.py``, need it). The ring gives the step over key rank ``s``'s shard only that shard's
    columns (``parallel.ring.shard_index``), so entry ``[r, s]`` counts, over rank ``r``'s query tiles, the
    chunks of shard ``s``'s columns before each; a row's sum is the walk of one call over the whole list. Without
    documents; a schedule that gathers the columns (``gathered_columns_work``) runs steps without columns, which walk
    none.

    Counting: a chunk starts at every ``COLUMN_CHUNK``-th column of a shard's sorted list, and the chunk starting at
    column ``c`` is walked by every query tile ``i`` with ``i * bs > c``; so per shard a histogram of the chunks'
    first tiles, summed cumulatively over the blocks and over each query rank's blocks (ranks in chunks: bounded
    memory at a thousand ranks).
    """
    index, _ = _sparse(pattern, layout, "walked_columns")
    n, bs, w = layout.seqlen, index.block_size, layout.world
    nb = index.num_blocks(n)
    owner = layout.block_owner()[:nb]
    chunks = torch.zeros(w, w, dtype=torch.float64)
    if index.vertical.shape[-1] == 0:
        return chunks
    vertical = index.vertical.cpu().flatten(0, 1)
    valid = vertical >= 0
    shard = torch.where(valid, owner[vertical.clamp(min=0) // bs], w)  # w: no column
    shard, order = shard.sort(dim=-1, stable=True)  # the columns stay ascending inside each shard's group
    column = vertical.gather(-1, order)
    position = torch.arange(shard.shape[-1]) - torch.searchsorted(shard, shard)  # place in its shard's list
    starts = (shard < w) & (position % COLUMN_CHUNK == 0)
    first_tile = column // bs + 1  # the first query tile that walks the chunk
    keep = starts & (first_tile < nb)
    flat = (shard[keep] * nb + first_tile[keep]).bincount(minlength=w * nb).double().view(w, nb)
    step = max(1, _FFT_ELEMENTS // nb)
    for s0 in range(0, w, step):
        walked = flat[s0 : s0 + step].cumsum(1)  # [shards, nb]: chunks of each shard walked by each query tile
        chunks[:, s0 : s0 + step] = torch.zeros(w, walked.shape[0], dtype=torch.float64).index_add_(0, owner, walked.T)
    return chunks


def offset_shards(layout: Layout, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The key ranks a slash offset can join ``rank``'s query tiles to: LongTensor ``[padded_len / bs, 2K]`` on
    ``device``, row ``o`` the ranks holding a key block ``i - o`` of a query block ``i`` of ``rank`` (``-1`` fills, no
    rank twice). A ring step over key rank ``s``'s shard walks only the offsets whose row holds ``s``
    (``parallel.ring.shard_index``); the dk/dv pass, from the key side, the same ones.

    Pieces (``Layout.unit`` tokens, ``p`` blocks): offset ``o = q p + c`` moves a query block of piece ``a`` to a key
    block of piece ``a - q``, or of ``a - q - 1`` when ``c > 0`` (the query block's place in its piece decides), so a
    row holds the owners of those pieces (those that exist) over ``rank``'s pieces. Striped (piece ``a`` on rank
    ``a mod W``): the ranks ``(rank - q) mod W`` and ``(rank - q - 1) mod W``, in closed form (``K = 1``: a rank
    holds a W-th of all pieces, whose enumeration would be quadratic in the length); with one block a stripe, one
    residue class of offsets a key rank, each offset reaching that rank from every query tile. Contiguous and zigzag
    hold ``K`` = 1 or 2 pieces, enumerated. A row may hold a rank that some query tiles cannot reach through it: the
    kernels still test each key tile. Device ops only (the layout's cached device copies), no host sync."""
    device = torch.device("cpu") if device is None else torch.device(device)
    p, w = layout.unit // layout.block_size, layout.world
    offsets = torch.arange(layout.padded_len // layout.block_size, device=device)
    q, c = (offsets // p)[:, None], (offsets % p)[:, None]
    if layout.kind == "striped":
        pieces = layout.padded_len // layout.unit
        last = pieces - 1 - (pieces - 1 - rank) % w  # rank's last piece: a - q >= 0 needs q <= last
        first_key = torch.where(q <= last, (rank - q) % w, -1)
        shards = torch.cat([first_key, torch.where((c > 0) & (q + 1 <= last), (rank - q - 1) % w, -1)], 1)
    else:
        pieces = layout.block_ids_on(rank, device)[::p] // p  # [K]
        piece_owner = layout.block_owner_on(device)[::p]
        key_pieces = torch.cat([pieces - q, torch.where(c > 0, pieces - q - 1, -1)], 1)  # [nb, 2K]
        shards = torch.where(key_pieces >= 0, piece_owner[key_pieces.clamp(min=0)], -1)
    shards = shards.sort(1).values
    repeated = torch.cat([torch.zeros_like(shards[:, :1], dtype=torch.bool), shards[:, 1:] == shards[:, :-1]], 1)
    return torch.where(repeated, -1, shards)


def offsets_reaching(layout: Layout, rank: int) -> list[int]:
    """How many slash offsets can join ``rank``'s query tiles to each key rank's, by key rank (the rows of
    :func:`offset_shards` holding it; host ints). A shard's list of the offsets that reach it is at most this long,
    plus the diagonal (``parallel.ring.shard_index``): on a striped ring about ``num_blocks / W``."""
    shards = offset_shards(layout, rank)
    return torch.bincount(shards[shards >= 0], minlength=layout.world).tolist()


def walked_offsets(pattern: AttentionPattern, layout: Layout) -> torch.Tensor:
    """Slash offsets a ring step's kernels walk: float64 ``[W, W]`` by (query rank, key rank).

    For every (batch, head) and local query tile ``i`` the kernels visit each chosen offset ``0 < o <= i`` of the step's
    index and load its key tile only where the shard in hand holds it (``sparse.triton.forward``): a per-offset cost
    apart from the attended work (the measured step costs, ``benchmarks/ring_steps.py``). The ring gives the step over
    key rank ``s``'s shard only the offsets that can reach it (:func:`offset_shards`, ``parallel.ring.shard_index``),
    so entry ``[r, s]`` counts those; a row's sum is one walk of the whole list per query tile. Query blocks of
    padding only are left out, as in :func:`pair_work`; documents are not (the kernels stop at a tile's document).

    Counting: an offset ``o`` is walked by every query tile ``i >= o`` of rank ``r``, once per head that chose it, at
    each key rank of its :func:`offset_shards` row.
    """
    index, _ = _sparse(pattern, layout, "walked_offsets")
    nb, w = index.num_blocks(layout.seqlen), layout.world
    chosen = index.offset_mask(layout.seqlen).cpu().flatten(0, 1).sum(0).double()  # [nb]: heads choosing o
    chosen[0] = 0.0  # the diagonal tile is not a walked offset
    owner = layout.block_owner()[:nb]
    walked = torch.zeros(w, w, dtype=torch.float64)
    for rank in range(w):
        later = (owner == rank).double().flip(0).cumsum(0).flip(0)  # [nb]: rank's query tiles i >= o
        shards = offset_shards(layout, rank)[:nb]
        visits = (chosen * later)[:, None].expand_as(shards)
        walked[rank].index_add_(0, shards[shards >= 0], visits[shards >= 0])
    return walked


def pair_runs(layout: Layout) -> torch.Tensor:
    """Whether the ring runs the kernels of query rank ``r`` on key rank ``s``'s shard: float64 ``[W, W]`` of 0 / 1.
    A pair runs unless every key of ``s`` comes after every query of ``r`` (``parallel.ring``'s ``has_work``)."""
    first = torch.tensor([float(layout.block_ids(r).min()) for r in range(layout.world)], dtype=torch.float64)
    last = torch.tensor([float(layout.block_ids(r).max()) for r in range(layout.world)], dtype=torch.float64)
    return (first[None, :] <= last[:, None]).double()


def gathered_columns_work(
    pattern: AttentionPattern, layout: Layout, *, inner: int | None = None, kv_exchange: str = "ring"
) -> RingWork:
    """:class:`RingWork` of the ring's ``columns="gathered"`` schedule (``sparse_ring_attention``).

    Slash tiles run with the shard that holds their keys; every query tile's column work runs at step
    ``(local tile index) mod steps`` on its own rank, the columns' K/V having been gathered once. ``pattern``,
    ``inner`` and ``kv_exchange`` as in :func:`ring_work`.
    """
    group = (inner or layout.world) if kv_exchange == "all_gather" else 1
    return gathered_on_schedule(pair_work(pattern, layout), layout, ring_sources(layout.world, inner), group=group)


def gathered_on_schedule(pw: PairWork, layout: Layout, sources: torch.Tensor, *, group: int = 1) -> RingWork:
    """:class:`RingWork` of the gathered-column schedule from ``pw`` (:func:`pair_work` on ``layout``) when rank ``r``
    holds shard ``sources[r, s]`` at step ``s``, each ``group`` consecutive steps run as one (an all-gathered inner
    group): :func:`gathered_columns_work` for a pair work already counted."""
    w, bs = pw.world, pw.block_size
    steps = w // group
    slash_tiles, slash_entries = pw.slash_pairs()
    columns = torch.zeros(w, steps, dtype=torch.float64)
    entries = summed_steps(slash_entries.gather(1, sources), group)
    for rank in range(w):
        mine = (pw.owner == rank).nonzero().flatten()
        step = local_slot(layout, rank, mine) % steps
        columns[rank].index_add_(0, step, pw.block_columns[mine] / bs)
        entries[rank].index_add_(0, step, pw.block_column_entries[mine])
    return RingWork(summed_steps(slash_tiles.gather(1, sources), group), columns, entries)
