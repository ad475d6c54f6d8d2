import pytest
import torch

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.sparse import VerticalSlashIndex, index_to_dense_mask, merge_attention_, reference_attention
from ds_mtraining.sparse import torch_path

KINDS = ["contiguous", "zigzag", "striped"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "world,seqlen", [(1, 200), (2, 256), (3, 1000), (4, 130)], ids=["w1", "w2", "w3-pad", "w4-pad"]
)
def test_shard_unshard_round_trip(kind, world, seqlen):
    layout = make_layout(kind, world, seqlen, block_size=64)
    assert layout.padded_len % (world * 64) == 0 and layout.padded_len >= seqlen
    assert sorted(layout.order.tolist()) == list(range(layout.padded_len))  # a permutation
    x = torch.randn(2, seqlen, 3)
    shards = [layout.shard(x, r) for r in range(world)]
    assert all(s.shape == (2, layout.local_len, 3) for s in shards)
    torch.testing.assert_close(layout.unshard(shards), x, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_local_tiles_are_whole_global_blocks(kind):
    layout = make_layout(kind, 3, 1000, block_size=64)
    for r in range(3):
        pos = layout.positions(r).view(-1, 64)
        assert torch.equal(pos, pos[:, :1] + torch.arange(64))  # each local tile: 64 consecutive positions
        assert torch.equal(layout.block_ids(r), pos[:, 0] // 64)
        assert (layout.block_owner()[layout.block_ids(r)] == r).all()  # the owner map inverts block_ids
    assert layout.block_owner().shape == (layout.padded_len // 64,)
    assert layout.block_owner_on("cpu") is layout.block_owner_on(torch.device("cpu"))


def test_device_copies_are_made_once_and_match():
    """``positions_on`` / ``block_ids_on`` (what the ring reads every layer) equal the host tensors and are cached:
    the second call returns the same tensor, so no further host-to-device copy (each one syncs on a GPU)."""
    layout = make_layout("striped", 4, 1000, block_size=64, stripe=64)
    for rank in range(4):
        positions, blocks = layout.positions_on(rank, torch.device("cpu")), layout.block_ids_on(rank, "cpu")
        assert torch.equal(positions, layout.positions(rank)) and torch.equal(blocks, layout.block_ids(rank))
        assert layout.positions_on(rank, "cpu") is positions and layout.block_ids_on(rank, "cpu") is blocks
    assert layout.positions_on(0, "cpu") is not layout.positions_on(1, "cpu")


def test_layout_assignments():
    striped = make_layout("striped", 2, 512, block_size=64)
    assert striped.block_ids(0).tolist() == [0, 2, 4, 6] and striped.block_ids(1).tolist() == [1, 3, 5, 7]
    zigzag = make_layout("zigzag", 2, 512, block_size=64)
    assert zigzag.block_ids(0).tolist() == [0, 1, 6, 7] and zigzag.block_ids(1).tolist() == [2, 3, 4, 5]
    wide = make_layout("striped", 2, 1024, block_size=64, stripe=128)
    assert wide.block_ids(1).tolist() == [2, 3, 6, 7, 10, 11, 14, 15]


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="unknown layout 'ring'"):
        make_layout("ring", 2, 100, block_size=64)
    with pytest.raises(ValueError, match="stripe=96 must be a multiple of block_size=64"):
        make_layout("striped", 2, 1000, block_size=64, stripe=96)
    layout = make_layout("striped", 2, 100, block_size=64)
    with pytest.raises(ValueError, match="cannot shard a tensor of 99 tokens"):
        layout.shard(torch.zeros(1, 99), 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_shard_pairs_compose_to_the_whole(kind, world):
    """Every (query shard, kv shard) call merged over kv shards, gradients summed: the single-device result.

    This is the arithmetic of a ring step, without the communication.
    """
    b, n, hq, hkv, d, bs = 2, 300, 4, 2, 32, 64
    gen = torch.Generator().manual_seed(world)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    nb = -(-n // bs)
    index = VerticalSlashIndex.build(
        torch.randint(-1, n, (b, hq, 10), generator=gen), torch.randint(-1, nb, (b, hq, 3), generator=gen), bs
    )
    layout = make_layout(kind, world, n, block_size=bs)
    blocks = [layout.block_ids(r) for r in range(world)]
    qs, ks, vs, dos = ([layout.shard(x, r) for r in range(world)] for x in (q, k, v, dout))
    outs, lses = [], []
    for r in range(world):
        out = torch.zeros(b, layout.local_len, hq, d, dtype=torch.float64)
        lse = torch.full((b, hq, layout.local_len), float("-inf"), dtype=torch.float64)
        for s in range(world):
            block_out, block_lse = torch_path.vertical_slash_forward(
                qs[r], ks[s], vs[s], index, 0.2, q_blocks=blocks[r], kv_blocks=blocks[s]
            )
            merge_attention_(out, lse, block_out, block_lse)
        outs.append(out)
        lses.append(lse)
    dq = [torch.zeros_like(x) for x in qs]
    dk = [torch.zeros_like(x) for x in ks]
    dv = [torch.zeros_like(x) for x in vs]
    for r in range(world):
        for s in range(world):
            gq, gk, gv = torch_path.vertical_slash_backward(
                dos[r], qs[r], ks[s], vs[s], outs[r], lses[r], index, 0.2, q_blocks=blocks[r], kv_blocks=blocks[s]
            )
            dq[r] += gq
            dk[s] += gk
            dv[s] += gv

    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(q_, k_, v_, index_to_dense_mask(index, n), 0.2)
    ref_grads = torch.autograd.grad(ref_out, (q_, k_, v_), dout)
    torch.testing.assert_close(layout.unshard(outs), ref_out)
    torch.testing.assert_close(layout.unshard(lses, dim=2), ref_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        torch.testing.assert_close(layout.unshard(got), ref, msg=lambda m: f"{name}: {m}")
