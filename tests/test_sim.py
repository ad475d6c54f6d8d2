import json

import pytest
import torch

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import ring_sources, ring_work, tile_work
from ds_mtraining.sim import (
    COLUMNS,
    LOCAL,
    Topology,
    balance_ring,
    column_bytes,
    gathered_columns_work,
    ring_timeline,
    shard_bytes,
)
from ds_mtraining.sparse import AttentionPattern
from ds_mtraining.sparse.planted import planted_index


def _pattern(seqlen: int, bs: int, density: float, seed: int = 0) -> AttentionPattern:
    """A planted index over rows of ``seqlen`` tokens, as the whole rows' pattern (no documents)."""
    gen = torch.Generator().manual_seed(seed)
    index = planted_index(
        1, 4, seqlen, bs, density=density, sinks=16, columns=48, local_tokens=4 * bs, band_tokens=2 * bs, generator=gen
    )
    return AttentionPattern(seqlen, index)


def _ring_time_of(work: torch.Tensor) -> float:
    return float(work.max(0).values.sum())


CASES = [
    pytest.param("striped", 8, None, id="striped-w8"),
    pytest.param("striped", 8, 4, id="striped-w8-hierarchical"),
    pytest.param("zigzag", 4, None, id="zigzag-w4"),
    pytest.param("contiguous", 3, None, id="contiguous-w3-padded"),
]


@pytest.mark.parametrize("kind,world,inner", CASES)
@pytest.mark.parametrize("gather_columns,move_local", [(True, True), (True, False), (False, True)])
def test_balanced_schedule_is_never_worse_and_conserves_work(kind, world, inner, gather_columns, move_local):
    n, bs = 8000, 16
    pattern = _pattern(n, bs, 0.1)
    layout = make_layout(kind, world, n, block_size=bs)
    plain = ring_work(pattern, layout, inner=inner)
    sched = balance_ring(pattern, layout, inner=inner, gather_columns=gather_columns, move_local=move_local)
    got = sched.work
    # Conservation: every tile, column and entry is computed once, by the rank that owns the query.
    for name in ("tiles", "columns", "entries"):
        torch.testing.assert_close(getattr(got, name).sum(1), getattr(plain, name).sum(1), rtol=1e-12, atol=1e-9)
    # Never worse than the recompute-per-step ring, in ring time and in the heaviest step.
    assert _ring_time_of(got.work) <= _ring_time_of(plain.work) + 1e-9
    assert float(got.work.max()) <= float(plain.work.max()) + 1e-9
    # The target levels are the lower bound max(Σ_s max_r pinned, max_r total), so within one unit of it.
    assert sched.level.sum() <= _ring_time_of(plain.work) + 1e-9
    assert float(sched.level.sum()) >= float(got.work.sum(1).max()) - 1e-9


@pytest.mark.parametrize("kind,world,inner", CASES)
def test_balanced_schedule_respects_data_availability(kind, world, inner):
    """Pinned work stays where its shard is in hand; the plan's moved units add up to the rest, step by step."""
    n, bs = 8000, 16
    pattern = _pattern(n, bs, 0.1, seed=1)
    layout = make_layout(kind, world, n, block_size=bs)
    sched = balance_ring(pattern, layout, inner=inner)
    tw = tile_work(pattern, layout)
    sources = ring_sources(world, inner)
    assert torch.equal(sched.sources, sources)
    slash_tiles, _ = tw.slash_pairs()
    remote = torch.where(torch.eye(world, dtype=torch.bool), 0.0, slash_tiles).gather(1, sources)

    # Rebuild the moved work per (rank, step) from the plan alone.
    moved_tiles = torch.zeros(world, world, dtype=torch.float64)
    moved_cols = torch.zeros(world, world, dtype=torch.float64)
    blocks = torch.arange(tw.owner.numel())
    for rank in range(world):
        ids = layout.block_ids(rank)
        real = ids < tw.owner.numel()
        steps = sched.assign[:, rank][..., real]  # [2, B, H, T_real]
        assert steps.min() >= 0 and steps.max() < world
        own = tw.slash[:, :, blocks, tw.owner][:, :, ids[real]]
        cols = tw.columns.sum(-1)[:, :, ids[real]] / bs
        moved_tiles[rank].index_add_(0, steps[LOCAL].flatten(), (1.0 + own).flatten())
        moved_cols[rank].index_add_(0, steps[COLUMNS].flatten(), cols.flatten())
        assert (sched.assign[:, rank][..., ~real] == -1).all()  # padding tiles carry no work
    torch.testing.assert_close(sched.work.tiles, remote + moved_tiles, rtol=0, atol=1e-9)
    torch.testing.assert_close(sched.work.columns, moved_cols, rtol=0, atol=1e-9)


def test_unmoved_levers_leave_the_plan_empty():
    n, bs = 4096, 16
    pattern = _pattern(n, bs, 0.1)
    layout = make_layout("striped", 4, n, block_size=bs)
    sched = balance_ring(pattern, layout, gather_columns=False, move_local=False)
    plain = ring_work(pattern, layout)
    assert (sched.assign == -1).all()
    torch.testing.assert_close(sched.work.work, plain.work, rtol=0, atol=1e-9)


def test_balancing_striped_ring_reaches_the_lower_bound():
    """With both levers the ring time is the bound max(Σ_s max_r pinned work, max_r total work)."""
    n, bs = 1 << 16, 64
    pattern = AttentionPattern(n, planted_index(1, 8, n, bs, density=0.05, generator=torch.Generator().manual_seed(0)))
    layout = make_layout("striped", 16, n, block_size=bs)
    plain = ring_work(pattern, layout)
    sched = balance_ring(pattern, layout)
    got = sched.work
    slash_tiles, _ = tile_work(pattern, layout).slash_pairs()
    pinned = torch.where(torch.eye(16, dtype=torch.bool), 0.0, slash_tiles).gather(1, ring_sources(16))
    bound = max(_ring_time_of(pinned), float(plain.work.sum(1).max()))
    assert float(sched.level.sum()) == pytest.approx(bound, rel=1e-12)
    assert _ring_time_of(got.work) <= bound * 1.005  # units are ~1 % of a step at this size: a little spill
    assert got.ring_efficiency > plain.ring_efficiency + 0.05
    assert got.step_imbalance < plain.step_imbalance


def test_shard_bytes():
    assert shard_bytes(4096, kv_heads=2, head_dim=128) == 2 * 4096 * 2 * 128 * 2


TWO_A_NODE = Topology(gpus_per_node=2, nvlink_gbs=100.0, nvlink_latency_us=0.0, internode_gbs=10.0,
                      internode_latency_us=0.0)  # fmt: skip
NV, IB = 1.0, 10.0  # ms for one 1e8-byte shard over each link


def test_two_rank_forward_by_hand():
    """Rank r posts its shard at its step's start; the successor starts its next step when both are done."""
    compute = torch.tensor([[3.0, 2.0], [0.5, 4.0]], dtype=torch.float64)
    t = ring_timeline(compute, TWO_A_NODE, shard_bytes=1e8)
    # rank 0: step 0 [0, 3]; rank 1's shard arrives at 0 + NV = 1 -> step 1 [3, 5].
    # rank 1: step 0 [0, 0.5]; rank 0's shard arrives at 1 -> step 1 [1, 5].
    assert torch.equal(t.start, torch.tensor([[0.0, 3.0], [0.0, 1.0]], dtype=torch.float64))
    assert torch.equal(t.end, torch.tensor([[3.0, 5.0], [0.5, 5.0]], dtype=torch.float64))
    assert t.total_ms == 5.0
    assert torch.equal(t.idle, torch.tensor([0.0, 0.5], dtype=torch.float64))
    assert t.efficiency == pytest.approx(9.5 / 10.0)


def test_two_rank_backward_by_hand():
    """The dK/dV accumulator follows one hop behind: a step ends once the predecessor's accumulator is in."""
    compute = torch.tensor([[3.0, 2.0], [0.5, 4.0]], dtype=torch.float64)
    t = ring_timeline(compute, TWO_A_NODE, shard_bytes=1e8, backward=True)
    # step 0 ends at 3 / 0.5 (no accumulator yet) and sends it: arrives at 0.5 + 1 = 1.5 at rank 0, 3 + 1 = 4 at rank 1.
    # step 1: rank 0 [3, 5] (accumulator in at 1.5), rank 1 [1, 5] but waits for 4 -> 5; each sends home: 6.
    assert torch.equal(t.end, torch.tensor([[3.0, 5.0], [0.5, 5.0]], dtype=torch.float64))
    assert torch.equal(t.finish, torch.tensor([6.0, 6.0], dtype=torch.float64))


def test_flat_ring_crosses_the_slow_link_at_node_boundaries():
    """No compute: the last step waits for the chain of hops, which crosses a node boundary."""
    zero = torch.zeros(4, 4, dtype=torch.float64)
    t = ring_timeline(zero, TWO_A_NODE, shard_bytes=1e8)
    # Rank 0's step 3 uses rank 1's shard: hops 1 -> 2 (IB), 2 -> 3 (NV), 3 -> 0 (IB).
    assert t.start[0, 3] == pytest.approx(IB + NV + IB)
    assert t.start[1, 1] == pytest.approx(NV)  # rank 0 -> 1 inside the node
    assert t.start[2, 1] == pytest.approx(IB)  # rank 1 -> 2 across


@pytest.mark.parametrize("backward", [False, True])
def test_enough_compute_hides_every_transfer(backward):
    heavy = torch.full((8, 8), 2 * IB, dtype=torch.float64)
    for inner in (None, 2):
        t = ring_timeline(heavy, TWO_A_NODE, shard_bytes=1e8, inner=inner, backward=backward)
        # Never hidden: the last dK/dV hop home, and in a hierarchical ring each inner ring's hop home before the
        # node's accumulator moves on.
        home = (IB + (4 * NV if inner else 0.0)) if backward else 0.0
        assert t.total_ms == pytest.approx(8 * 2 * IB + home)
        assert t.exposed_ms == pytest.approx(home)


def test_hierarchical_ring_waits_for_the_inter_node_link_once_per_node():
    light = torch.full((8, 8), 0.1 * NV, dtype=torch.float64)
    flat = ring_timeline(light, TWO_A_NODE, shard_bytes=1e8)
    hier = ring_timeline(light, TWO_A_NODE, shard_bytes=1e8, inner=2)
    # Flat: the last shard's chain of 7 hops crosses a node 4 times; hierarchical: 3 inter-node waits, one per outer
    # step, the inner rings on NVLink.
    assert flat.total_ms >= 4 * IB + 3 * NV
    assert 3 * IB < hier.total_ms < 3 * IB + 4 * (NV + 0.1)
    assert hier.compute.sum() == flat.compute.sum()
    with pytest.raises(ValueError, match="inner ring of 4 ranks spans nodes of 2"):
        ring_timeline(light, TWO_A_NODE, shard_bytes=1e8, inner=4)


def test_column_bytes_counts_the_union_per_kv_head():
    pattern = _pattern(1024, 16, 0.2)
    cols = pattern.index.column_mask(1024)  # [1, 4, N]
    union = cols.view(1, 2, 2, 1024).any(2).sum()
    assert column_bytes(pattern, kv_heads=2, head_dim=64) == 2 * int(union) * 64 * 2


@pytest.mark.parametrize("kind", ["striped", "zigzag"])
def test_gathered_columns_work_moves_only_column_work(kind):
    """The ring's gathered-column schedule: same slash work per step, each rank's column work kept on the rank
    and spread over its steps by local tile."""
    index = planted_index(
        1,
        3,
        4096,
        64,
        density=0.08,
        sinks=16,
        columns=40,
        local_tokens=128,
        band_tokens=128,
        generator=torch.Generator().manual_seed(0),
    )
    pattern = AttentionPattern(4096, index)
    layout = make_layout(kind, 4, 4096, block_size=64)
    plain, gathered = ring_work(pattern, layout), gathered_columns_work(pattern, layout)
    torch.testing.assert_close(gathered.tiles, plain.tiles, rtol=0, atol=0)
    torch.testing.assert_close(gathered.columns.sum(1), plain.columns.sum(1))
    torch.testing.assert_close(gathered.entries.sum(1), plain.entries.sum(1))
    # 16 local tiles per rank over 4 steps: 4 tiles per step, so every step of a rank gets column work.
    assert (gathered.columns > 0).all()
    assert gathered.ring_efficiency > plain.ring_efficiency


def test_kernel_costs_load_a_fit_clamp_and_scale(tmp_path):
    from ds_mtraining.sim import CALIBRATED, KernelCosts, StepCost, StepTerms

    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"model": {
        "forward": {"fixed_ms": 0.1, "per_tile_ms": 2e-5, "per_column_chunk_ms": -1e-6},
        "backward": {"fixed_ms": 0.3, "per_tile_ms": 5e-5, "per_column_chunk_ms": 4e-5, "per_offset_ms": 1e-6,
                     "per_program_ms": 1e-4},
    }, "steps": []}))  # fmt: skip
    costs = KernelCosts.from_fit(fit)
    assert costs.forward == StepCost(0.1, 2e-5, 0.0)  # a negative coefficient never prices work below free
    tiles = torch.tensor([[1000.0, 0.0]], dtype=torch.float64)
    terms = StepTerms(tiles, chunks=10.0, offsets=torch.tensor([[500.0], [0.0]])[:1], programs=20, runs=torch.tensor(
        [[1.0, 0.0]], dtype=torch.float64))  # fmt: skip
    # The second step does not run: it costs nothing.
    expected = torch.tensor([[0.3 + 0.05 + 4e-4 + 5e-4 + 2e-3, 0.0]], dtype=torch.float64)
    assert torch.allclose(costs.backward(terms), expected)
    half = costs.for_head_dim(64)
    assert half.backward == StepCost(0.3, 2.5e-5, 2e-5, 1e-6, 1e-4) and half.head_dim == 64
    with pytest.raises(ValueError, match="measured at block size 64, the pattern uses 128"):
        CALIBRATED.check_block_size(128)
