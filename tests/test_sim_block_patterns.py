import pytest
import torch

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import RingWork, ring_sources
from ds_mtraining.sim.balance import balance_tile_work
from ds_mtraining.sim.block_patterns import (
    BlockPattern,
    block_ring_work,
    block_tile_work,
    moba_pattern,
    xattention_pattern,
)


def _from_block_mask(seqlen: int, bs: int, mask: torch.Tensor) -> BlockPattern:
    """A pattern from a block mask ``[H, nb, nb]`` (bool): each row's blocks ascending, then -1."""
    nb = mask.shape[-1]
    values = torch.where(mask, torch.arange(nb), nb).sort(-1).values
    width = int(mask.sum(-1).max())
    return BlockPattern(seqlen, bs, torch.where(values < nb, values, -1)[..., :width].contiguous())


def _random_pattern(heads: int, seqlen: int, bs: int, seed: int) -> BlockPattern:
    """Random causal blocks (about 40 % of the past) plus the diagonal."""
    nb = -(-seqlen // bs)
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(heads, nb, nb, generator=gen) < 0.4) & torch.ones(nb, nb, dtype=torch.bool).tril()
    return _from_block_mask(seqlen, bs, mask | torch.eye(nb, dtype=torch.bool))


def _dense_mask(pattern: BlockPattern) -> torch.Tensor:
    """Token-level mask ``[H, N, N]`` of the pattern, built from its block lists (causal inside the diagonal)."""
    n, bs, nb = pattern.seqlen, pattern.block_size, pattern.num_blocks
    blocks = torch.zeros(pattern.heads, nb, nb + 1, dtype=torch.bool)
    blocks.scatter_(-1, torch.where(pattern.blocks >= 0, pattern.blocks, nb), True)
    token_block = torch.arange(n) // bs
    pos = torch.arange(n)
    return blocks[:, token_block][:, :, token_block] & (pos[None, :] <= pos[:, None])


def _brute_force(pattern: BlockPattern, layout, sources: torch.Tensor) -> RingWork:
    """Every attended (head, query, key) entry, and every tile holding one, to (rank of the query, step at which
    that rank holds the key's shard)."""
    bs, w = pattern.block_size, layout.world
    rank_of = torch.empty(layout.padded_len, dtype=torch.long)
    for r in range(w):
        rank_of[layout.positions(r)] = r
    step_of = torch.empty(w, w, dtype=torch.long)  # step at which rank r holds rank r2's shard
    step_of.scatter_(1, sources, torch.arange(w).expand(w, w))
    mask = _dense_mask(pattern)
    entries = torch.zeros(w, w, dtype=torch.float64)
    _, q, k = mask.nonzero().T
    rq = rank_of[q]
    entries.index_put_((rq, step_of[rq, rank_of[k]]), torch.ones(q.numel(), dtype=torch.float64), accumulate=True)
    tiles = torch.zeros(w, w, dtype=torch.float64)
    nb = pattern.num_blocks
    for h in range(pattern.heads):
        for i in range(nb):
            for j in range(nb):
                if mask[h, i * bs : (i + 1) * bs, j * bs : (j + 1) * bs].any():
                    rq = rank_of[i * bs]
                    tiles[rq, step_of[rq, rank_of[j * bs]]] += 1
    return RingWork(tiles, torch.zeros(w, w, dtype=torch.float64), entries)


def _patterns(seqlen: int, bs: int, seed: int) -> list[BlockPattern]:
    return [
        _random_pattern(3, seqlen, bs, seed),
        moba_pattern(seqlen, 2, block_size=bs, chunk=2 * bs, topk=2, seed=seed),
        xattention_pattern(seqlen, 2, block_size=bs, density=0.3, seed=seed),
    ]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize(
    "world,seqlen,bs,stripe,inner",
    [
        pytest.param(2, 64, 8, None, None, id="w2-even"),
        pytest.param(3, 100, 8, None, None, id="w3-padded-partial-block"),
        pytest.param(4, 90, 8, 16, None, id="w4-stripe16-padded"),
        pytest.param(4, 96, 8, None, 2, id="w4-hierarchical-2x2"),
        pytest.param(4, 75, 8, None, 2, id="w4-hierarchical-padded"),
    ],
)
def test_block_ring_work_matches_brute_force(kind, world, seqlen, bs, stripe, inner):
    layout = make_layout(kind, world, seqlen, block_size=bs, stripe=stripe if kind == "striped" else None)
    sources = ring_sources(world, inner)
    for pattern in _patterns(seqlen, bs, seed=world * 100 + seqlen):
        got = block_ring_work(pattern, layout, inner=inner)
        want = _brute_force(pattern, layout, sources)
        assert torch.equal(got.tiles, want.tiles), (pattern.blocks, got.tiles, want.tiles)
        assert torch.equal(got.entries, want.entries), (got.entries, want.entries)
        assert torch.equal(got.columns, torch.zeros(world, world, dtype=torch.float64))
        assert got.tiles.dtype == got.entries.dtype == torch.float64
        assert float(got.entries.sum()) == float(_dense_mask(pattern).sum())


def test_hand_counted_ring_of_two():
    """4 blocks of 4 tokens, one head: block 0 -> {0}, 1 -> {0, 1}, 2 -> {0, 2}, 3 -> {1, 2, 3}. A full tile is
    16 entries, a diagonal one 10."""
    blocks = torch.tensor([[[0, -1, -1], [0, 1, -1], [0, 2, -1], [1, 2, 3]]])
    pattern = BlockPattern(16, 4, blocks)
    # Contiguous: rank 0 holds blocks 0, 1 and rank 1 blocks 2, 3. Step 1 brings rank 1 blocks 0, 1 (query 2
    # uses 0, query 3 uses 1) and rank 0 blocks 2, 3 (nothing to do).
    contiguous = block_ring_work(pattern, make_layout("contiguous", 2, 16, block_size=4))
    assert contiguous.tiles.tolist() == [[3.0, 0.0], [3.0, 2.0]]
    assert contiguous.entries.tolist() == [[36.0, 0.0], [36.0, 32.0]]
    # Zigzag: rank 0 holds blocks 0, 3 and rank 1 blocks 1, 2: two tiles at every (rank, step).
    zigzag = block_ring_work(pattern, make_layout("zigzag", 2, 16, block_size=4))
    assert zigzag.tiles.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert zigzag.entries.tolist() == [[20.0, 32.0], [20.0, 32.0]]
    assert zigzag.worker_imbalance == 1.0 and contiguous.worker_imbalance > 1.0
    # Striped (stripe = one block): rank 0 holds blocks 0, 2 and rank 1 blocks 1, 3.
    striped = block_ring_work(pattern, make_layout("striped", 2, 16, block_size=4))
    assert striped.tiles.tolist() == [[3.0, 0.0], [3.0, 2.0]]
    assert striped.entries.tolist() == [[36.0, 0.0], [36.0, 32.0]]


@pytest.mark.parametrize("seqlen", [64, 61, 1])
def test_density_matches_dense_mask(seqlen):
    for pattern in _patterns(seqlen, 8, seed=seqlen):
        dense = _dense_mask(pattern).sum((1, 2)).double() / (seqlen * (seqlen + 1) / 2)
        assert pattern.density().dtype == torch.float64
        assert torch.equal(pattern.density(), dense)


def test_generators_are_causal_deterministic_and_seeded():
    for make in (
        lambda seed: moba_pattern(1000, 4, block_size=16, chunk=64, topk=3, seed=seed),
        lambda seed: xattention_pattern(1000, 4, block_size=16, density=0.2, seed=seed),
    ):
        pattern = make(0)
        blocks, nb = pattern.blocks, pattern.num_blocks
        query = torch.arange(nb)[:, None]
        assert blocks.dtype == torch.long and blocks.shape[:2] == (4, nb)
        assert (blocks <= query).all()
        assert (blocks == query).any(-1).all()
        assert torch.equal(make(0).blocks, blocks)
        assert not torch.equal(make(1).blocks, blocks)
        assert not torch.equal(blocks[0], blocks[1])  # heads draw apart


@pytest.mark.parametrize("seqlen,chunk,topk", [(1024, 64, 3), (1000, 32, 5), (200, 64, 10), (100, 16, 0)])
def test_moba_attends_own_chunk_and_topk_chunks(seqlen, chunk, topk):
    bs, heads = 16, 3
    pattern = moba_pattern(seqlen, heads, block_size=bs, chunk=chunk, topk=topk, seed=5)
    per = chunk // bs
    for h in range(heads):
        for i in range(pattern.num_blocks):
            q = i // per
            row = pattern.blocks[h, i]
            row = row[row >= 0]
            own = torch.arange(q * per, i + 1)
            assert torch.equal(row[row >= q * per], own)  # the own chunk, causally
            earlier = row[row < q * per]
            assert earlier.numel() == min(topk, q) * per  # exactly top-k whole chunks
            chunks = earlier.view(-1, per)
            assert torch.equal(chunks, chunks[:, :1] + torch.arange(per))
            # Every query block of the chunk shares the gate's choice.
            first = pattern.blocks[h, q * per]
            assert torch.equal(earlier, first[(first >= 0) & (first < q * per)])


def test_moba_gate_prefers_recent_chunks():
    pattern = moba_pattern(64 * 64, 32, block_size=64, chunk=64, topk=4, seed=0)
    last = pattern.blocks[:, -1]  # query chunk 63: distance of each chosen chunk
    distance = 63 - last[(last >= 0) & (last < 63)]
    near, far = (distance <= 8).sum() / 8, (distance > 32).sum() / 31  # chosen chunks per distance
    assert near > 2 * far


@pytest.mark.parametrize("target", [0.05, 0.2, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("seqlen", [128 * 16, 128 * 16 - 7])
def test_xattention_density_near_target(target, seqlen):
    pattern = xattention_pattern(seqlen, 3, block_size=16, density=target, seed=2)
    assert pattern.num_blocks == 128
    assert (pattern.density() - target).abs().max() < 1e-3
    assert (pattern.blocks[:, 1:, 0] == 0).all()  # the sink block, past query block 0
    if target < 1.0:  # a nearby block is kept more often than a far one
        last = pattern.blocks[:, -1]
        distance = 127 - last[last > 0]
        near, far = ((distance >= 1) & (distance <= 8)).sum() / 8, (distance > 64).sum() / 62
        assert near > far


def test_xattention_floor_is_diagonal_and_sink():
    pattern = xattention_pattern(64 * 8, 2, block_size=8, density=0.001, seed=0)
    assert (pattern.blocks >= 0).sum(-1).tolist() == [[1] + [2] * 63] * 2


def test_pattern_validation():
    good = torch.tensor([[[0, -1], [0, 1]]])
    BlockPattern(16, 8, good)
    with pytest.raises(ValueError, match=r"not causal: head 0, query block 0 attends key block 1 > 0"):
        BlockPattern(16, 8, torch.tensor([[[0, 1], [0, 1]]]))
    with pytest.raises(ValueError, match=r"query block 1 does not attend its diagonal block 1"):
        BlockPattern(16, 8, torch.tensor([[[0, -1], [0, -1]]]))
    with pytest.raises(
        ValueError, match=r"must be a LongTensor \(torch.int64\); got torch.int32: pass blocks.long\(\)"
    ):
        BlockPattern(16, 8, good.int())
    with pytest.raises(ValueError, match=r"not strictly ascending with -1 padding at the end"):
        BlockPattern(16, 8, torch.tensor([[[0, -1], [1, 0]]]))
    with pytest.raises(ValueError, match=r"not strictly ascending with -1 padding at the end"):
        BlockPattern(16, 8, torch.tensor([[[0, -1, -1], [-1, 0, 1]]]))
    with pytest.raises(ValueError, match=r"must be \[H, nb, K\] with H >= 1, nb = ceil\(24 / 8\) = 3"):
        BlockPattern(24, 8, good)
    with pytest.raises(ValueError, match=r"holds -2: use key blocks >= 0 and -1 as padding"):
        BlockPattern(16, 8, torch.tensor([[[0, -2], [0, 1]]]))


def test_layout_must_match_the_pattern():
    pattern = moba_pattern(256, 1, block_size=32, chunk=64, topk=1)
    with pytest.raises(ValueError, match=r"pattern's block size is 32; build the layout with block_size=32"):
        block_ring_work(pattern, make_layout("striped", 2, 256, block_size=16))
    with pytest.raises(ValueError, match=r"the pattern is for rows of 256 tokens but the layout's are 512"):
        block_ring_work(pattern, make_layout("striped", 2, 512, block_size=32))
    with pytest.raises(ValueError, match=r"chunk a positive multiple of block_size"):
        moba_pattern(256, 1, block_size=32, chunk=48, topk=1)
    with pytest.raises(ValueError, match=r"0 < density <= 1"):
        xattention_pattern(256, 1, block_size=32, density=1.5)


def test_tile_work_feeds_the_balancer():
    """block_tile_work is a TileWork: the simulator's balancer moves its work around without losing any."""
    pattern = xattention_pattern(512, 4, block_size=16, density=0.3, seed=1)
    layout = make_layout("zigzag", 4, 512, block_size=16)
    plain = block_ring_work(pattern, layout)
    balanced = balance_tile_work(
        block_tile_work(pattern, layout), layout, ring_sources(4), gather_columns=True, move_local=True
    ).work
    assert float(balanced.tiles.sum()) == float(plain.tiles.sum())
    assert float(balanced.entries.sum()) == float(plain.entries.sum())
    assert balanced.ring_efficiency >= plain.ring_efficiency - 1e-12
