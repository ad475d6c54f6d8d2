"""Block-sparse attention patterns (MoBA, XAttention style) and their exact work per (rank, ring step).

The cluster simulator (issue 43) prices the project's vertical-slash index on a context-parallel ring through
``parallel.work``. To compare it with the block-sparse patterns of other methods, this module gives such
patterns a carrier (:class:`BlockPattern`: the attended key blocks of every query block, per head), two
synthetic generators shaped like MoBA and XAttention, and their work per (rank, ring step) in the conventions
of ``parallel.work`` (module docstring there): tile units, the diagonal tile counted as one whole tile in
``tiles`` but as its causal triangle in ``entries``, query blocks made only of layout padding not counted.

It is written by hand because no library computes per-ring-step work of a block-sparse pattern: the methods'
own code (and flash-attention's block-sparse masks) run one device's attention, and the ring's split of that
work by (query rank, key shard, step) is this project's model. The patterns are synthetic on purpose: the
simulator needs their shape (how many blocks, how far back) at any length, not a model's real gate scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.layout import Layout
from ..parallel.work import RingWork, TileWork, ring_sources, work_on_schedule

# Elements of [heads, blocks, K] handled per counting batch: bounds the bin temporaries (~64 MB of int32).
_COUNT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class BlockPattern:
    """Which key blocks each query block attends, per head: a block-sparse causal pattern.

    Attributes:
        seqlen: real tokens ``N``; the last block may be partial.
        block_size: tokens per block ``bs`` (the kernels' tile size).
        blocks: LongTensor ``[H, nb, K]`` (``nb = ceil(N / bs)``): the key blocks query block ``i`` attends,
            strictly ascending then ``-1`` padded; every entry ``<= i`` and ``i`` itself (the diagonal block,
            attended causally) always present.
    """

    seqlen: int
    block_size: int
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        n, bs, blocks = self.seqlen, self.block_size, self.blocks
        if n < 1 or bs < 1:
            raise ValueError(f"BlockPattern needs seqlen >= 1 and block_size >= 1; got seqlen={n}, block_size={bs}")
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.long:
            got = blocks.dtype if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"BlockPattern.blocks must be a LongTensor (torch.int64); got {got}: pass blocks.long()")
        nb = -(-n // bs)
        if blocks.dim() != 3 or blocks.shape[0] < 1 or blocks.shape[1] != nb or blocks.shape[2] < 1:
            raise ValueError(
                f"BlockPattern.blocks must be [H, nb, K] with H >= 1, nb = ceil({n} / {bs}) = {nb} and K >= 1; "
                f"got shape {tuple(blocks.shape)}"
            )
        query = torch.arange(nb, device=blocks.device)[:, None]
        valid = blocks >= 0
        if (blocks < -1).any():
            raise ValueError(f"BlockPattern.blocks holds {int(blocks.min())}: use key blocks >= 0 and -1 as padding")
        late = blocks > query
        if late.any():
            h, i, k = (int(x) for x in late.nonzero()[0])
            raise ValueError(
                f"BlockPattern is not causal: head {h}, query block {i} attends key block {int(blocks[h, i, k])} "
                f"> {i}; drop key blocks after their query block"
            )
        # Strictly ascending with the padding at the end: each pair is (valid, valid and larger) or (any, pad).
        ordered = (valid[..., 1:] & (blocks[..., 1:] > blocks[..., :-1])) | ~valid[..., 1:]
        ordered &= valid[..., :-1] | ~valid[..., 1:]
        if not ordered.all():
            h, i, k = (int(x) for x in (~ordered).nonzero()[0])
            raise ValueError(
                f"BlockPattern.blocks[{h}, {i}] is not strictly ascending with -1 padding at the end (entries {k} and "
                f"{k + 1}: {int(blocks[h, i, k])}, {int(blocks[h, i, k + 1])}); sort each row, drop repeats and move "
                f"the -1 after the last block"
            )
        diagonal = (blocks == query).any(-1)
        if not diagonal.all():
            h, i = (int(x) for x in (~diagonal).nonzero()[0])
            raise ValueError(
                f"BlockPattern: head {h}, query block {i} does not attend its diagonal block {i}; "
                f"every query block must attend its own block (add it)"
            )

    @property
    def heads(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[1]

    def rows(self) -> torch.Tensor:
        """Real query rows of each block: float64 ``[nb]`` (``bs``, fewer in a partial last block)."""
        return _rows(self.seqlen, self.block_size)

    def density(self) -> torch.Tensor:
        """Fraction of the ``N (N + 1) / 2`` causal entries each head attends, exactly: float64 ``[H]``.

        A key block before the query block is always whole (only the last block can be partial), so it holds
        ``rows · bs`` entries; the diagonal block holds its causal triangle ``rows (rows + 1) / 2``.
        """
        rows, bs, n = self.rows(), self.block_size, self.seqlen
        tiles = (self.blocks.cpu() >= 0).sum(-1).double()  # [H, nb], diagonal included
        entries = (tiles - 1.0) * rows * bs + rows * (rows + 1) / 2
        return entries.sum(-1) / (n * (n + 1) / 2)


def _rows(seqlen: int, block_size: int) -> torch.Tensor:
    """Real rows of each of the ``ceil(seqlen / block_size)`` blocks: float64 ``[nb]``."""
    nb = -(-seqlen // block_size)
    rows = torch.full((nb,), float(block_size), dtype=torch.float64)
    rows[-1] = seqlen - (nb - 1) * block_size
    return rows


def _gumbel_order_keys(log_weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Keys (float64, shaped like ``log_weight``) whose descending order is a draw without replacement with
    probability ∝ ``exp(log_weight)``; ``-inf`` weights stay last.

    Gumbel-top-k (Efraimidis–Spirakis): the top ``k`` keys are a weighted sample of ``k`` distinct items.
    """
    u = torch.rand(log_weight.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    return log_weight - torch.log(-torch.log(u))


def moba_pattern(seqlen: int, heads: int, *, block_size: int, chunk: int, topk: int, seed: int = 0) -> BlockPattern:
    """A MoBA-style pattern (Lu et al. 2025, "Mixture of Block Attention"): own chunk plus top-k earlier chunks.

    Keys are split into chunks of ``chunk`` tokens (a multiple of ``block_size``). Query block ``i`` of chunk
    ``q`` attends every block of chunk ``q`` up to itself (causal) and every block of ``min(topk, q)`` earlier
    chunks. MoBA's gate scores each chunk by the query's affinity with the chunk's mean key; here the gate is
    synthetic, per (head, query chunk): the earlier chunks are a Gumbel-top-k draw with weight
    ``1 / (q - p)`` for chunk ``p`` (a recency bias, as real gates favour nearby chunks), deterministic in
    ``seed``. Every query block of a chunk therefore shares its selection, as a kernel working on whole query
    tiles would. (MoBA's paper counts the own chunk inside its top-k; here ``topk`` counts the earlier ones.)

    Returns:
        :class:`BlockPattern` with ``blocks`` LongTensor ``[heads, nb, (k + 1) · chunk / block_size]``,
        ``k = min(topk, chunks - 1)``.
    """
    if chunk < 1 or chunk % block_size or topk < 0 or heads < 1 or seqlen < 1:
        raise ValueError(
            f"moba_pattern needs chunk a positive multiple of block_size, topk >= 0, heads >= 1 and seqlen >= 1; "
            f"got chunk={chunk}, block_size={block_size}, topk={topk}, heads={heads}, seqlen={seqlen}"
        )
    gen = torch.Generator().manual_seed(seed)
    nb, per = -(-seqlen // block_size), chunk // block_size
    nq = -(-nb // per)
    k = min(topk, nq - 1)
    q, p = torch.arange(nq)[:, None], torch.arange(nq)[None, :]
    earlier = p < q
    log_weight = torch.where(earlier, -torch.log((q - p).clamp_min(1).double()), float("-inf"))
    chosen = torch.full((heads, nq, k), -1, dtype=torch.long)
    for h in range(heads if k > 0 else 0):  # one [nq, nq] score matrix at a time
        top = _gumbel_order_keys(log_weight, gen).topk(k, -1).indices
        # Query chunks with fewer than k earlier chunks take all of them (the -inf keys are not chunks); the
        # chosen chunks ascending first, then padding.
        top = torch.where(earlier.gather(1, top), top, nq).sort(-1).values
        chosen[h] = torch.where(top < nq, top, -1)

    width = (k + 1) * per
    block = torch.arange(nb)
    own_q = block // per
    # Earlier chunks' blocks at positions [0, n_earlier · per), then the own chunk's blocks up to i, then -1.
    earlier_blocks = (chosen[:, own_q, :, None] * per + torch.arange(per)).flatten(2)  # [H, nb, k · per]
    earlier_valid = (chosen[:, own_q, :, None] >= 0).expand(-1, -1, -1, per).flatten(2)
    n_earlier = earlier_valid.sum(-1, keepdim=True)  # [H, nb, 1]
    own = own_q[:, None] * per + torch.arange(per)  # [nb, per]
    own_valid = (own <= block[:, None]).expand(heads, -1, -1)
    values = torch.cat([earlier_blocks, own.expand(heads, -1, -1)], -1)
    valid = torch.cat([earlier_valid, own_valid], -1)
    slot = torch.cat([torch.arange(k * per).expand(heads, nb, -1), n_earlier + torch.arange(per)], -1)
    out = torch.full((heads, nb, width + 1), -1, dtype=torch.long)
    out.scatter_(-1, torch.where(valid, slot, width), torch.where(valid, values, -1))
    return BlockPattern(seqlen, block_size, out[..., :width].contiguous())


def _extra_counts(rows: torch.Tensor, block_size: int, seqlen: int, density: float) -> torch.Tensor:
    """Off-sink, off-diagonal blocks per query block so the density reaches ``density``: LongTensor ``[nb]``.

    Every query block keeps the same fraction ``f`` of its ``i - 1`` optional blocks (a block of query block
    ``i`` costs ``rows[i] · bs`` entries); the cumulative rounding of ``f · (i - 1)`` keeps the total within one
    block of the target.
    """
    nb = rows.numel()
    block = torch.arange(nb, dtype=torch.float64)
    optional = (block - 1).clamp_min(0)
    base = (rows * (rows + 1) / 2).sum() + (rows[1:] * block_size).sum()  # diagonals and the sink
    room = (optional * rows * block_size).sum()
    need = density * seqlen * (seqlen + 1) / 2 - base
    f = float((need / room).clamp(0.0, 1.0)) if room > 0 else 0.0
    total = (f * optional).cumsum(0).round()
    return torch.diff(total, prepend=total.new_zeros(1)).long().clamp(min=0).minimum(optional.long())


def xattention_pattern(seqlen: int, heads: int, *, block_size: int, density: float, seed: int = 0) -> BlockPattern:
    """An XAttention-style pattern (Xu et al. 2025, "XAttention: Block Sparse Attention with Antidiagonal Scoring").

    XAttention scores each (query block, key block) by the sum of its antidiagonal and keeps, per head and query
    block, the best blocks until their softmax mass reaches a threshold. Synthetic here: every query block ``i``
    keeps its diagonal block and the first (sink) block, then ``m_i`` of the blocks ``1 .. i - 1`` drawn with
    inclusion probability ``min(1, c_i / d)`` at distance ``d = i - j`` — decaying like ``1 / d``, the nearest
    blocks kept surely — by systematic sampling (one uniform offset per (head, query block), deterministic in
    ``seed``). ``m_i`` is the same fraction of the ``i - 1`` optional blocks for every query block, chosen so
    each head's :meth:`BlockPattern.density` is within one block of ``density`` (far below 1e-3 at 64 blocks
    and more); every head has the same counts, so the same density, and differs in which blocks it keeps.
    A target under the diagonal + sink floor (about ``2 / nb``) gives that floor.

    Returns:
        :class:`BlockPattern` with ``blocks`` LongTensor ``[heads, nb, 2 + max_i m_i]``.
    """
    if not 0.0 < density <= 1.0 or heads < 1 or seqlen < 1 or block_size < 1:
        raise ValueError(
            f"xattention_pattern needs 0 < density <= 1, heads >= 1, seqlen >= 1, block_size >= 1; got "
            f"density={density}, heads={heads}, seqlen={seqlen}, block_size={block_size}"
        )
    gen = torch.Generator().manual_seed(seed)
    rows = _rows(seqlen, block_size)
    nb = rows.numel()
    m = _extra_counts(rows, block_size, seqlen, density)  # [nb]
    n = (torch.arange(nb) - 1).clamp_min(0)  # optional blocks (distances 1 .. n)
    harmonic = torch.cat([torch.zeros(1, dtype=torch.float64), (1.0 / torch.arange(1, nb + 1).double()).cumsum(0)])

    # c_i with Σ_{d <= n} min(1, c / d) = m_i, by bisection: the sum is floor(c) + c (H_n - H_floor(c)).
    lo, hi = torch.zeros(nb, dtype=torch.float64), n.double()
    for _ in range(64):
        c = (lo + hi) / 2
        a = c.floor().long().minimum(n)
        below = a + c * (harmonic[n] - harmonic[a]) < m
        lo, hi = torch.where(below, c, lo), torch.where(below, hi, c)
    c = (lo + hi) / 2
    a = c.floor().long().minimum(n)

    # The picks of every query block, flattened (ragged): pick k of query block row[p] is point p.
    row = torch.repeat_interleave(torch.arange(nb), m)  # [P]
    k = torch.arange(row.numel()) - (m.cumsum(0) - m)[row]
    ca, cc, ha = a[row].double(), c[row].clamp_min(1e-300), harmonic[a][row]
    width = int(m.max()) + 2
    first = (torch.arange(nb) > 0).long()
    out = torch.full((heads, nb, width), -1, dtype=torch.long)
    out[:, 1:, 0] = 0  # the sink
    out[:, torch.arange(nb), first + m] = torch.arange(nb)  # the diagonal, last
    where = row * width + first[row] + m[row] - 1 - k  # the picks ascending in between: the farthest first
    # Rows kept apart so that one running maximum over all picks is a running maximum within each row.
    apart = row * (3 * nb)
    for h in range(heads):  # one [P] sample at a time bounds the float64 temporaries
        u = torch.rand(nb, generator=gen, dtype=torch.float64)[row] + k  # systematic points
        # Cumulative inclusion Π(d) = d for d <= a, a + c (H_d - H_a) beyond: invert it at each point.
        d = torch.where(u < ca, k + 1, torch.searchsorted(harmonic, ha + (u - ca) / cc, right=True))
        # Floating rounding must not repeat a block or pass the last one: force 1 <= d_0 < d_1 < ... <= n (the
        # repair is rarely needed; the minimum with the last value that leaves room keeps the picks increasing).
        if ((d[1:] <= d[:-1]) & (k[1:] > 0)).any():
            d = (d - k + apart).cummax(0).values - apart + k
        d = torch.minimum(d, n[row] - m[row] + 1 + k)
        out[h].view(-1)[where] = row - d
    return BlockPattern(seqlen, block_size, out)


def block_tile_work(pattern: BlockPattern, layout: Layout) -> TileWork:
    """``parallel.work.TileWork`` of ``pattern`` on ``layout``: per (head, query block, key rank), batch 1.

    ``slash`` holds the off-diagonal tiles (the diagonal is implied, one per (head, query block), as there);
    ``columns`` are zero. Usable wherever ``TileWork`` is, e.g. ``sim.balance.balance_tile_work``.
    """
    bs, n, w = pattern.block_size, pattern.seqlen, layout.world
    if layout.block_size != bs:
        raise ValueError(
            f"the layout keeps tiles of {layout.block_size} tokens whole but the pattern's block size is {bs}; "
            f"build the layout with block_size={bs}"
        )
    if layout.seqlen != n:
        raise ValueError(f"the pattern is for rows of {n} tokens but the layout's are {layout.seqlen}")
    heads, nb, width = pattern.blocks.shape
    owner = layout.block_owner()[:nb]
    rows = pattern.rows()
    # Padding (-1) indexes the last entry: a spare rank bin, cut off below. int32 halves the memory traffic of
    # the bins (at most heads · nb · (W + 1) of them per batch, far below 2**31).
    owner_bin = torch.cat([owner, owner.new_tensor([w])]).int()
    counts = torch.empty(heads, nb * (w + 1), dtype=torch.float64)
    step = max(1, _COUNT_ELEMENTS // (nb * width))
    for h0 in range(0, heads, step):
        h1 = min(heads, h0 + step)
        base = (torch.arange((h1 - h0) * nb, dtype=torch.int32) * (w + 1)).view(h1 - h0, nb, 1)
        where = owner_bin[pattern.blocks[h0:h1].cpu()]  # [h, nb, K]: the key's rank ...
        where += base  # ... in the bins of its (head, query block)
        counts[h0:h1] = torch.bincount(where.flatten(), minlength=(h1 - h0) * nb * (w + 1)).view(h1 - h0, -1)
    slash = counts.view(1, heads, nb, w + 1)[..., :w].clone()
    slash[0, :, torch.arange(nb), owner] -= 1.0  # the diagonal, counted apart
    zeros = torch.zeros_like(slash)
    diagonal = (rows * (rows + 1) / 2)[None]
    return TileWork(owner, rows, slash, zeros, slash * rows[:, None] * bs, zeros, diagonal, bs)


def block_ring_work(pattern: BlockPattern, layout: Layout, *, inner: int | None = None) -> RingWork:
    """Exact work per (rank, ring step) of ``pattern`` on a ring over ``layout``: float64 ``[W, W]`` each.

    ``tiles``: attended tiles (the diagonal counts as one); ``columns``: zeros (no vertical columns);
    ``entries``: attended (query, key) entries, the diagonal as its causal triangle, a partial last block
    exact. ``layout`` must have the pattern's block size and ``seqlen``; ``inner``: ranks per inner ring of a
    hierarchical ring (default: a flat ring), see ``parallel.work.ring_sources``.
    """
    return work_on_schedule(block_tile_work(pattern, layout), ring_sources(layout.world, inner))
