"""flash-attn-4's block lists of a vertical-slash index (``benchmarks.flash4.blocks``): the listed blocks, with the
mask rule on the mask blocks, cover every entry of the index's dense mask exactly once and nothing else, forward and
backward lists agree, and each list is packed left and ascending."""

from __future__ import annotations

import pytest
import torch

from benchmarks.flash4.blocks import (
    BLOCK,
    column_attended,
    column_blocks,
    joined_attended,
    joined_blocks,
    lists_to_dense,
    slash_lists,
)
from ds_mtraining.sparse.index import VerticalSlashIndex, index_to_dense_mask


def _random_index(batch: int, heads: int, seqlen: int, columns: int, offsets: int, seed: int) -> VerticalSlashIndex:
    gen = torch.Generator().manual_seed(seed)
    nb = -(-seqlen // BLOCK)
    vertical = torch.randint(0, seqlen, (batch, heads, columns), generator=gen)
    vertical[..., : columns // 4] = -1  # uneven rows: some heads get fewer columns
    vertical[0, 0, :3] = torch.arange(3)[: min(3, columns)]  # sinks, in the diagonal tile
    slash = torch.randint(0, nb, (batch, heads, offsets), generator=gen)
    slash[..., -1] = -1
    return VerticalSlashIndex.build(vertical, slash, BLOCK)


def _coverage(index: VerticalSlashIndex, seqlen: int) -> torch.Tensor:
    """How many times the lists (and the mask rule) attend each (b, h, q, k): int ``[B, Hq, N, N]``."""
    b, h, nb = index.batch, index.heads, index.num_blocks(seqlen)
    q = torch.arange(seqlen)
    cover = torch.zeros(b, h, seqlen, seqlen, dtype=torch.int32)
    fwd, _ = slash_lists(index, seqlen)
    mask, full = lists_to_dense(fwd, nb, nb)
    qb, kb = q[:, None] // BLOCK, q[None, :] // BLOCK
    causal = q[None, :] <= q[:, None]
    cover += (full[:, :, qb, kb] | (mask[:, :, qb, kb] & causal)).int()
    cols = column_blocks(index, seqlen)
    c = cols.positions.shape[-1]
    mask, full = lists_to_dense(cols.forward, nb, c // BLOCK)
    positions, blocked = cols.aux
    slot = torch.arange(c)
    for bi in range(b):
        for hi in range(h):
            rule = column_attended(q[:, None], slot[None, :], positions[bi, hi].long(), blocked[bi, hi].long())
            listed = full[bi, hi][qb, slot[None, :] // BLOCK] | (mask[bi, hi][qb, slot[None, :] // BLOCK] & rule)
            keys = cols.positions[bi, hi].clamp(max=seqlen - 1).expand(seqlen, c)
            cover[bi, hi].scatter_add_(1, keys, listed.int())
    return cover


@pytest.mark.parametrize(
    ("seqlen", "columns", "offsets", "seed"),
    [(1024, 200, 3, 0), (1000, 300, 5, 1), (640, 1, 1, 2), (2000, 700, 9, 3)],
)
def test_lists_cover_the_index_exactly_once(seqlen: int, columns: int, offsets: int, seed: int) -> None:
    index = _random_index(2, 3, seqlen, columns, offsets, seed)
    expected = index_to_dense_mask(index, seqlen).int()
    assert torch.equal(_coverage(index, seqlen), expected)


@pytest.mark.parametrize(("seqlen", "seed"), [(1000, 4), (1024, 5)])
def test_joined_lists_cover_the_index_exactly_once(seqlen: int, seed: int) -> None:
    """The one-call form: keys padded to whole blocks, then the gathered columns; nothing past the row is attended."""
    index = _random_index(2, 2, seqlen, 260, 4, seed)
    joined = joined_blocks(index, seqlen)
    positions, blocked = joined.aux
    nb, width = index.num_blocks(seqlen), positions.shape[-1]
    mask, full = lists_to_dense(joined.forward, nb, width // BLOCK)
    for a, b in zip((mask, full), lists_to_dense(joined.backward, width // BLOCK, nb)):
        assert torch.equal(a, b.transpose(-1, -2))
    q, slot = torch.arange(seqlen)[:, None], torch.arange(width)[None, :]
    cover = torch.zeros(2, 2, seqlen, seqlen, dtype=torch.int32)
    for bi in range(2):
        for hi in range(2):
            pos = positions[bi, hi].long()
            rule = joined_attended(q, slot, pos, blocked[bi, hi].long())
            listed = full[bi, hi][q // BLOCK, slot // BLOCK] | (mask[bi, hi][q // BLOCK, slot // BLOCK] & rule)
            assert not (listed & (pos >= seqlen)).any()
            cover[bi, hi].scatter_add_(1, pos.clamp(max=seqlen - 1).expand(seqlen, width), listed.int())
    assert torch.equal(cover, index_to_dense_mask(index, seqlen).int())


def test_full_blocks_need_no_mask() -> None:
    """Every entry of a full block is attended (full blocks skip the mask rule in the kernel)."""
    seqlen = 2048
    index = _random_index(1, 2, seqlen, 500, 4, 7)
    cols = column_blocks(index, seqlen)
    nb, c = index.num_blocks(seqlen), cols.positions.shape[-1]
    _, full = lists_to_dense(cols.forward, nb, c // BLOCK)
    assert full.any()
    q = torch.arange(seqlen)
    for h in range(2):
        rule = column_attended(q[:, None], torch.arange(c)[None, :], *(t[0, h].long() for t in cols.aux))
        qb, jb = torch.meshgrid(torch.arange(nb), torch.arange(c // BLOCK), indexing="ij")
        for i, j in zip(qb[full[0, h]].tolist(), jb[full[0, h]].tolist()):
            assert rule[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].all()


@pytest.mark.parametrize("seqlen", [1000, 1536])
def test_backward_lists_are_the_transpose(seqlen: int) -> None:
    index = _random_index(2, 2, seqlen, 150, 4, 5)
    nb = index.num_blocks(seqlen)
    fwd, bwd = slash_lists(index, seqlen)
    for a, b in zip(lists_to_dense(fwd, nb, nb), lists_to_dense(bwd, nb, nb)):
        assert torch.equal(a, b.transpose(-1, -2))
    cols = column_blocks(index, seqlen)
    cb = cols.positions.shape[-1] // BLOCK
    for a, b in zip(lists_to_dense(cols.forward, nb, cb), lists_to_dense(cols.backward, cb, nb)):
        assert torch.equal(a, b.transpose(-1, -2))
    for lists in (fwd, bwd, cols.forward, cols.backward):
        for cnt, idx in ((lists.mask_cnt, lists.mask_idx), (lists.full_cnt, lists.full_idx)):
            assert cnt.dtype == idx.dtype == torch.int32
            live = torch.arange(idx.shape[-1]) < cnt[..., None]
            step = idx[..., 1:] - idx[..., :-1]
            assert (step[live[..., 1:]] > 0).all()  # ascending, distinct


def test_other_block_sizes_are_refused() -> None:
    index = VerticalSlashIndex.build(torch.tensor([[[0]]]), torch.tensor([[[1]]]), 64)
    with pytest.raises(ValueError, match="128-token blocks; the index has block_size=64"):
        slash_lists(index, 256)
