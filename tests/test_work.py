import pytest
import torch

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import RingWork, ring_sources, ring_work
from ds_mtraining.sparse import AttentionPattern
from ds_mtraining.sparse.documents import Documents
from ds_mtraining.sparse.index import VerticalSlashIndex, index_to_dense_mask


def _random_index(batch: int, heads: int, seqlen: int, bs: int, seed: int) -> VerticalSlashIndex:
    """Random columns (with sinks and one near the end) and random offsets, -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-seqlen // bs)
    vertical = torch.randint(-1, seqlen, (batch, heads, 9), generator=gen)
    vertical[..., 0], vertical[..., 1] = 0, seqlen - 1
    slash = torch.randint(-1, nb, (batch, heads, 4), generator=gen)
    return VerticalSlashIndex.build(vertical, slash, bs)


def _brute_force(index: VerticalSlashIndex, layout, sources: torch.Tensor, documents=None) -> RingWork:
    """Counts from the dense mask: every attended entry (and tile, and column-by-tile) goes to (rank of q, step).
    A tile or column counts when some row of the query tile attends a key in it (with documents, that is the
    kernels' skip rule: keys at or after the tile's first row's document start)."""
    n, bs, w = layout.seqlen, index.block_size, layout.world
    mask = AttentionPattern(n, index, documents).dense_mask()  # [B, H, N, N]
    pos = torch.arange(n)
    rank_of = torch.empty(layout.padded_len, dtype=torch.long)
    for r in range(w):
        rank_of[layout.positions(r)] = r
    rank_of = rank_of[:n]
    step_of = torch.empty(w, w, dtype=torch.long)  # step at which rank r holds rank r2's shard
    step_of.scatter_(1, sources, torch.arange(w).expand(w, w))
    offsets = index.offset_mask(n)
    off = (pos[:, None] // bs - pos[None, :] // bs).clamp(min=0)
    in_slash = offsets[:, :, off] & (pos[None, :] <= pos[:, None])  # [B, H, N, N]
    column_only = mask & ~in_slash
    if documents is not None:
        in_slash &= (pos[None, :] >= documents.starts[:, :, None])[:, None]

    entries = torch.zeros(w, w, dtype=torch.float64)
    tiles = torch.zeros(w, w, dtype=torch.float64)
    columns = torch.zeros(w, w, dtype=torch.float64)
    nb = -(-n // bs)
    for b in range(index.batch):
        for h in range(index.heads):
            for q, k in mask[b, h].nonzero().tolist():
                entries[rank_of[q], step_of[rank_of[q], rank_of[k]]] += 1
            for i in range(nb):
                rows = slice(i * bs, min(n, (i + 1) * bs))
                rq = rank_of[i * bs]
                for j in range(i + 1):
                    keys = slice(j * bs, (j + 1) * bs)
                    if in_slash[b, h, rows, keys].any():
                        tiles[rq, step_of[rq, rank_of[j * bs]]] += 1
                for c in column_only[b, h, rows].any(0).nonzero().flatten().tolist():
                    columns[rq, step_of[rq, rank_of[c]]] += 1 / bs
    return RingWork(tiles, columns, entries)


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize(
    "world,seqlen,bs,stripe",
    [
        pytest.param(2, 64, 8, None, id="w2-even"),
        pytest.param(3, 100, 8, None, id="w3-padded-partial-block"),
        pytest.param(4, 90, 8, 16, id="w4-stripe16-padded"),
    ],
)
def test_ring_work_matches_brute_force(kind, world, seqlen, bs, stripe):
    index = _random_index(2, 2, seqlen, bs, seed=world * 1000 + seqlen)
    layout = make_layout(kind, world, seqlen, block_size=bs, stripe=stripe if kind == "striped" else None)
    got = ring_work(AttentionPattern(seqlen, index), layout)
    want = _brute_force(index, layout, ring_sources(world))
    torch.testing.assert_close(got.entries, want.entries, rtol=0, atol=0)
    torch.testing.assert_close(got.tiles, want.tiles, rtol=0, atol=0)
    torch.testing.assert_close(got.columns, want.columns, rtol=0, atol=1e-12)
    assert got.entries.sum() == index_to_dense_mask(index, seqlen).sum()


def test_hierarchical_ring_matches_brute_force():
    index = _random_index(1, 3, 96, 8, seed=7)
    layout = make_layout("striped", 4, 96, block_size=8)
    got = ring_work(AttentionPattern(96, index), layout, inner=2)
    want = _brute_force(index, layout, ring_sources(4, inner=2))
    torch.testing.assert_close(got.entries, want.entries, rtol=0, atol=0)
    torch.testing.assert_close(got.tiles, want.tiles, rtol=0, atol=0)
    torch.testing.assert_close(got.columns, want.columns, rtol=0, atol=1e-12)


def _documents(lengths_per_row: list[list[int]]) -> Documents:
    return Documents.from_document_ids(
        torch.stack([torch.repeat_interleave(torch.arange(len(x)), torch.tensor(x)) for x in lengths_per_row])
    )


@pytest.mark.parametrize(
    "kind,world,inner,lengths",
    [
        # Documents of 1, bs - 1, bs, bs + 1 tokens and longer ones, starting mid-block and on block starts.
        pytest.param("striped", 4, None, [[1, 7, 8, 9, 23, 48], [40, 56]], id="striped-w4-mixed"),
        pytest.param("zigzag", 2, None, [[33, 1, 62], [96]], id="zigzag-w2"),
        pytest.param("contiguous", 3, None, [[5, 20, 3, 50, 18], [17, 17, 17, 17, 28]], id="contiguous-w3"),
        pytest.param("striped", 4, 2, [[30, 30, 36], [8] * 12], id="striped-hierarchical-2x2"),
    ],
)
def test_ring_work_with_documents_matches_brute_force(kind, world, inner, lengths):
    """Per (rank, step): entries of the document-masked index exactly, and the tiles and columns the kernels
    compute (those holding a key of the query tile's first row's document); one document a row is the FFT path."""
    seqlen, bs = 96, 8
    index = _random_index(2, 3, seqlen, bs, seed=len(lengths[0]) * 7 + world)
    documents = _documents(lengths)
    layout = make_layout(kind, world, seqlen, block_size=bs)
    pattern = AttentionPattern(seqlen, index, documents)
    got = ring_work(pattern, layout, inner=inner)
    want = _brute_force(index, layout, ring_sources(world, inner), documents)
    torch.testing.assert_close(got.entries, want.entries, rtol=0, atol=0)
    torch.testing.assert_close(got.tiles, want.tiles, rtol=0, atol=0)
    torch.testing.assert_close(got.columns, want.columns, rtol=0, atol=1e-12)
    assert got.entries.sum() == pattern.dense_mask().sum()
    # The density inside documents counts the same entries (over the in-document causal entries).
    density = pattern.density() * documents.causal_entries()[:, None]
    assert float(got.entries.sum()) == pytest.approx(float(density.sum()), rel=1e-12)
    whole = ring_work(AttentionPattern(seqlen, index, _documents([[seqlen], [seqlen]])), layout, inner=inner)
    plain = ring_work(AttentionPattern(seqlen, index), layout, inner=inner)
    for name in ("tiles", "columns", "entries"):
        torch.testing.assert_close(getattr(whole, name), getattr(plain, name), rtol=0, atol=1e-12)


def test_ring_work_rejects_documents_of_other_rows():
    """Documents of other rows are refused when the pattern is built; a pattern of other rows (or without an
    index) by the work model."""
    index = VerticalSlashIndex.dense(2, 1, 64, 8)
    layout = make_layout("striped", 2, 64, block_size=8)
    with pytest.raises(ValueError, match=r"documents are \[B, N\] = \[1, 64\] but the pattern's index has batch=2"):
        ring_work(AttentionPattern(64, index, _documents([[64]])), layout)
    with pytest.raises(ValueError, match=r"documents are for rows of 32 tokens but the pattern's seqlen is 64"):
        ring_work(AttentionPattern(64, index, _documents([[32], [32]])), layout)
    shorter = VerticalSlashIndex.dense(2, 1, 32, 8)
    with pytest.raises(ValueError, match=r"tile_work: the pattern is for rows of 32 tokens but the layout's are 64"):
        ring_work(AttentionPattern(32, shorter, _documents([[32], [32]])), layout)
    with pytest.raises(ValueError, match=r"tile_work needs an AttentionPattern with an index; got a dense pattern"):
        ring_work(AttentionPattern(64, documents=_documents([[64], [64]])), layout)


def test_ring_sources():
    flat = ring_sources(4)
    assert flat[:, 0].tolist() == [0, 1, 2, 3]  # step 0: the own shard
    assert flat[0].tolist() == [0, 3, 2, 1]
    hier = ring_sources(4, inner=2)
    # Rank 0 (node 0): its own shard, its node peer, then node 1's two shards.
    assert hier[0].tolist() == [0, 1, 2, 3]
    assert hier[3].tolist() == [3, 2, 1, 0]
    for sources in (flat, hier):  # every step is a permutation: each shard is held by exactly one rank
        assert (sources.sort(0).values == torch.arange(4)[:, None]).all()
        assert (sources.sort(1).values == torch.arange(4)).all()
    with pytest.raises(ValueError, match="must divide the world size"):
        ring_sources(6, inner=4)


def test_dense_index_metrics():
    """Dense causal work: contiguous leaves rank 0 with one step of work, zigzag balances ranks, not steps."""
    n, bs, w = 1024, 16, 4
    index = VerticalSlashIndex.dense(1, 2, n, bs)
    pattern = AttentionPattern(n, index)
    contiguous = ring_work(pattern, make_layout("contiguous", w, n, block_size=bs))
    zigzag = ring_work(pattern, make_layout("zigzag", w, n, block_size=bs))
    nb = n // bs
    for work in (contiguous, zigzag):
        assert work.tiles.sum() == 2 * nb * (nb + 1) / 2
        assert work.entries.sum() == 2 * n * (n + 1) / 2
        assert work.columns.sum() == 0
    assert contiguous.work[0, 1:].sum() == 0  # rank 0 holds the first chunk: nothing before it
    assert contiguous.worker_imbalance > 1.5
    assert zigzag.worker_imbalance == pytest.approx(1.0)
    assert zigzag.ring_efficiency > contiguous.ring_efficiency
    assert zigzag.ring_efficiency == pytest.approx(float(zigzag.work.mean(0).sum() / zigzag.work.max(0).values.sum()))


def test_metrics_on_a_known_matrix():
    work = RingWork(torch.tensor([[4.0, 0.0], [2.0, 2.0]]), torch.zeros(2, 2), torch.zeros(2, 2))
    assert work.worker_imbalance == pytest.approx(1.0)
    assert work.step_worker_imbalance == pytest.approx((4 / 3 + 2 / 1) / 2)
    assert work.step_imbalance == pytest.approx(2.0)
    assert work.step_imbalance_per_rank.tolist() == pytest.approx([2.0, 1.0])
    assert work.ring_efficiency == pytest.approx((3 + 1) / (4 + 2))


def test_ring_work_rejects_mismatched_blocks():
    index = VerticalSlashIndex.dense(1, 1, 256, 32)
    with pytest.raises(ValueError, match="block_size=32"):
        ring_work(AttentionPattern(256, index), make_layout("striped", 2, 256, block_size=16))


def test_ring_work_is_fast_at_scale():
    """512K tokens, block 64, W = 32, 16 heads with ~400 offsets and ~1000 columns each: well under seconds."""
    import time

    n, bs, heads = 1 << 19, 64, 16
    nb = n // bs
    gen = torch.Generator().manual_seed(0)
    vertical = torch.cat(
        [torch.arange(64).expand(1, heads, 64), torch.randint(0, n, (1, heads, 960), generator=gen)], -1
    )
    slash = torch.cat(
        [torch.arange(32).expand(1, heads, 32), torch.randint(32, nb, (1, heads, 400), generator=gen)], -1
    )
    index = VerticalSlashIndex.build(vertical, slash, bs)
    start = time.perf_counter()
    work = ring_work(AttentionPattern(n, index), make_layout("striped", 32, n, block_size=bs))
    assert time.perf_counter() - start < 10
    assert work.entries.sum() == pytest.approx(float(index.density(n).sum() * n * (n + 1) / 2), rel=1e-12)


@pytest.mark.parametrize(("kind", "world"), [("striped", 4), ("zigzag", 2), ("contiguous", 3), ("striped", 1)])
def test_walked_columns_counts_each_tiles_columns_before_it(kind, world):
    """Per (query rank, key rank): over every head and the query rank's tiles, the key rank's columns before the tile
    in chunks of COLUMN_CHUNK (several chunks a shard: up to 600 columns a head)."""
    from ds_mtraining.parallel.work import COLUMN_CHUNK, walked_columns

    seqlen, bs = 4000, 64
    gen = torch.Generator().manual_seed(3)
    vertical = torch.randint(0, seqlen, (2, 3, 700), generator=gen)
    index = VerticalSlashIndex.build(vertical, torch.tensor([[[0, 2]] * 3] * 2), bs)
    layout = make_layout(kind, world, seqlen, block_size=bs)
    got = walked_columns(AttentionPattern(seqlen, index), layout)
    owner = {block: rank for rank in range(world) for block in layout.block_ids(rank).tolist()}
    expected = torch.zeros(world, world, dtype=torch.float64)
    for rank in range(world):
        for block in layout.block_ids(rank).tolist():
            if block * bs >= seqlen:
                continue
            for b in range(2):
                for h in range(3):
                    cols = [c for c in index.vertical[b, h].tolist() if 0 <= c < block * bs]
                    for key_rank in range(world):
                        before = sum(owner[c // bs] == key_rank for c in cols)
                        expected[rank, key_rank] += -(-before // COLUMN_CHUNK)
    assert expected.max() > 3 * index.heads
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("kind", "world", "seqlen"), [("striped", 4, 4096), ("zigzag", 3, 3000), ("contiguous", 5, 2500)]
)
def test_pair_work_is_tile_works_sums_in_small_chunks(kind, world, seqlen, monkeypatch):
    """The bounded-memory path (chunks of heads and key ranks, forced tiny here) gives TileWork's sums exactly."""
    from ds_mtraining.parallel import work as work_module
    from ds_mtraining.parallel.work import PairWork, pair_work, tile_work
    from ds_mtraining.sparse.planted import planted_index

    gen = torch.Generator().manual_seed(world)
    index = planted_index(2, 3, seqlen, 64, density=0.2, sinks=8, columns=40, local_tokens=256, band_tokens=128,
                          generator=gen)  # fmt: skip
    pattern, layout = AttentionPattern(seqlen, index), make_layout(kind, world, seqlen, block_size=64)
    expected = PairWork.from_tile_work(tile_work(pattern, layout))
    monkeypatch.setattr(work_module, "_FFT_ELEMENTS", 2 * 2 * index.num_blocks(seqlen))  # 2 ranks x 1 head a chunk
    got = pair_work(pattern, layout)
    for name in ("tiles", "slash_entries", "columns", "column_entries", "block_columns", "block_column_entries"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def _reached_by_pieces(layout, rank: int, offset: int) -> set[int]:
    """The ranks holding piece ``a - q`` (and ``a - q - 1`` if ``c > 0``) over ``rank``'s pieces ``a``, for ``offset
    = q p + c`` (``p`` blocks a piece): ``offset_shards``' definition, enumerated."""
    p = layout.unit // layout.block_size
    owner = layout.block_owner()
    pieces = {block // p for block in layout.block_ids(rank).tolist()}
    q, c = divmod(offset, p)
    keys = {a - q for a in pieces} | ({a - q - 1 for a in pieces} if c else set())
    return {int(owner[key * p]) for key in keys if key >= 0}


LAYOUTS = [
    ("striped", 1, 300, None),
    ("striped", 2, 500, None),
    ("striped", 3, 448, None),
    ("striped", 4, 1000, None),
    ("striped", 3, 1000, 128),
    ("striped", 2, 1100, 192),
    ("zigzag", 3, 1000, None),
    ("contiguous", 3, 900, None),
]


@pytest.mark.parametrize(("kind", "world", "seqlen", "stripe"), LAYOUTS)
def test_offset_shards_hold_every_key_rank_an_offset_reaches(kind, world, seqlen, stripe):
    """Per rank and offset: the pieces' definition exactly; every rank a key tile ``i - o`` of a query tile ``i`` of
    the rank lies on (never a missing one: that offset would be in the wrong step's list); with one block a stripe
    exactly those, one residue class ``o = r - s (mod W)`` a key rank."""
    from ds_mtraining.parallel.work import offset_shards

    bs = 64
    layout = make_layout(kind, world, seqlen, block_size=bs, stripe=stripe)
    owner = layout.block_owner()
    for rank in range(world):
        got = offset_shards(layout, rank)
        mine = layout.block_ids(rank).tolist()
        assert got.shape[0] == layout.padded_len // bs
        for o, row in enumerate(got.tolist()):
            ranks = [x for x in row if x >= 0]
            assert len(ranks) == len(set(ranks))
            assert set(ranks) == _reached_by_pieces(layout, rank, o), (rank, o)
            truth = {int(owner[i - o]) for i in mine if i >= o}
            assert truth <= set(ranks), (rank, o)
            if kind == "striped" and layout.unit == bs and o <= max(mine):
                assert set(ranks) == truth == {(rank - o) % world}, (rank, o)


@pytest.mark.parametrize(("kind", "world", "seqlen", "stripe"), LAYOUTS)
def test_walked_offsets_and_pair_runs_by_brute_force(kind, world, seqlen, stripe):
    """Offsets: per (query rank r, key rank s), over every (b, h) and real local query tile i of r, the chosen
    offsets 0 < o <= i whose pieces reach s (striped, one block a stripe: o = r - s mod W). Runs: a pair runs unless
    every key block of the key rank is after every query block of the query rank."""
    from ds_mtraining.parallel.work import pair_runs, walked_offsets

    bs = 64
    nb = -(-seqlen // bs)
    gen = torch.Generator().manual_seed(5)
    index = VerticalSlashIndex.build(torch.full((2, 3, 1), -1), torch.randint(0, nb, (2, 3, 9), generator=gen), bs)
    layout = make_layout(kind, world, seqlen, block_size=bs, stripe=stripe)
    reach = [[_reached_by_pieces(layout, r, o) for o in range(nb)] for r in range(world)]
    expected = torch.zeros(world, world, dtype=torch.float64)
    for rank in range(world):
        for block in layout.block_ids(rank).tolist():
            if block >= nb:
                continue
            for row in index.slash.flatten(0, 1).tolist():
                for o in row:
                    if 0 < o <= block:
                        for key_rank in reach[rank][o]:
                            expected[rank, key_rank] += 1
    got = walked_offsets(AttentionPattern(seqlen, index), layout)
    assert torch.equal(got, expected)
    if kind == "striped" and layout.unit == bs:  # a tile's offsets, each in one step's list: the old walk, split
        whole = sum(sum(0 < o <= i for o in row) for i in range(nb) for row in index.slash.flatten(0, 1).tolist())
        assert got.sum() == whole
    blocks = [layout.block_ids(r).tolist() for r in range(world)]
    runs = torch.tensor([[float(min(blocks[s]) <= max(blocks[r])) for s in range(world)] for r in range(world)],
                        dtype=torch.float64)  # fmt: skip
    assert torch.equal(pair_runs(layout), runs)
    assert (kind == "contiguous") == bool((runs == 0).any())
