"""The simulator's all-gathered K/V (``Plan.kv_exchange="all_gather"``): its work is the ring's work model per grouped
call, each call priced once on its group's summed terms (one fixed cost, one launch of programs), the collectives
unoverlapped in the replay, the gathered K/V and fp32 dK/dV in the memory, and the ranked plans (``sim.rank_plans``)
consistent with ``simulate_step``, every plan kind first for some cluster."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_sim_cluster import SHAPE, TOPO

from ds_mtraining.memory import FILL, GiB
from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import (
    gathered_columns_work,
    pair_runs,
    ring_sources,
    ring_work,
    summed_steps,
    walked_columns,
    walked_offsets,
)
from ds_mtraining.sim import CALIBRATED, PRESETS, KernelCosts, StepCost, Topology, ring_timeline
from ds_mtraining.sim.cluster import ModelShape, Plan, simulate_attention, simulate_step
from ds_mtraining.sim.comm_cost import shard_bytes
from ds_mtraining.sim.memory import MemoryAssumptions, step_memory
from ds_mtraining.sim.patterns import planted_pattern_index
from ds_mtraining.sim.report import candidate_plans, rank_plans
from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex

# A small model whose attention dominates the step, so the plans' step times differ.
RANKED_SHAPE = ModelShape(heads=4, kv_heads=1, head_dim=128, layers=1000, params=1e6, optimizer_s=0.0)


def _links(gpus_per_node: int, nvlink_gbs: float, internode_gbs: float, latency_us: float) -> Topology:
    return Topology(gpus_per_node, nvlink_gbs, latency_us, internode_gbs, latency_us)


FIXED = KernelCosts(StepCost(1.0, 1e-6), StepCost(2.0, 2e-6), 64, 128, "a 1-2 ms fixed cost a call")
TILES = KernelCosts(StepCost(0.0, 1e-3), StepCost(0.0, 2e-3), 64, 128, "tiles only")


def _index(seqlen: int = 2048, heads: int = 4) -> VerticalSlashIndex:
    return planted_pattern_index(1, heads, seqlen, 64, density=0.2, seed=1)


@pytest.mark.parametrize(
    ("world", "layout", "ring", "inner"),
    [(4, "striped", "flat", None), (4, "zigzag", "hierarchical", 2), (8, "contiguous", "hierarchical", 2)],
)
@pytest.mark.parametrize("columns", ["gathered", "per_step"])
def test_work_is_the_rings_and_each_call_is_priced_once(world, layout, ring, inner, columns):
    n, index = 2048, _index()
    plan = Plan(layout, ring, columns=columns, kv_exchange="all_gather")
    sim = simulate_attention(index, n, world, plan, TOPO, CALIBRATED, SHAPE)
    lay = make_layout(layout, world, n, block_size=64)
    pattern, group = AttentionPattern(n, index), inner or world
    model = gathered_columns_work if columns == "gathered" else ring_work
    expected = model(pattern, lay, inner=inner, kv_exchange="all_gather")
    assert sim.work.tiles.shape == (world, world // group)
    assert torch.equal(sim.work.tiles, expected.tiles) and torch.equal(sim.work.columns, expected.columns)
    # The group's summed terms, and one fixed cost and one launch of programs per call (not per shard).
    sources = ring_sources(world, inner)
    chunks = 0.0 if columns == "gathered" else summed_steps(walked_columns(pattern, lay).gather(1, sources), group)
    offsets = summed_steps(walked_offsets(pattern, lay).gather(1, sources), group)
    runs = (summed_steps(pair_runs(lay).gather(1, sources), group) > 0).double()
    programs = index.heads * lay.local_len // 64
    for timeline, cost in ((sim.forward, CALIBRATED.forward), (sim.backward, CALIBRATED.backward)):
        gathered = cost.per_tile_ms * expected.columns if columns == "gathered" else 0.0
        want = runs * (cost.fixed_ms + cost.per_tile_ms * expected.tiles + cost.per_chunk_ms * chunks
                       + cost.per_offset_ms * offsets + cost.per_program_ms * programs) + gathered  # fmt: skip
        assert torch.allclose(timeline.compute, want, rtol=1e-12, atol=0)
    # The same work in fewer calls: the ring pays the fixed cost and the programs at every step that runs.
    ring = simulate_attention(index, n, world, Plan(layout, ring, columns=columns), TOPO, CALIBRATED, SHAPE)
    assert torch.allclose(ring.work.tiles.sum(1), sim.work.tiles.sum(1))
    saved = pair_runs(lay).sum() - runs.sum()
    b = CALIBRATED.backward
    assert saved > 0 and ring.backward.compute.sum() - sim.backward.compute.sum() == pytest.approx(
        float(saved) * (b.fixed_ms + b.per_program_ms * programs), rel=1e-9
    )


def test_ulysses_gathers_a_nodes_ring_ranks():
    """Ulysses 2 on 8 GPUs of 4 a node: a ring of 4 ranks, 2 a node, gathered in pairs; an outer ring of 2."""
    n, index = 2048, _index()
    topo = Topology(gpus_per_node=4, nvlink_gbs=100.0, internode_gbs=10.0)
    sim = simulate_attention(index, n, 8, Plan("striped", "ulysses", 2, kv_exchange="all_gather"), topo, CALIBRATED,
                             SHAPE)  # fmt: skip
    lay = make_layout("striped", 4, n, block_size=64)
    halves = [
        ring_work(AttentionPattern(n, VerticalSlashIndex(index.vertical[:, h : h + 2], index.slash[:, h : h + 2], 64)),
                  lay, inner=2, kv_exchange="all_gather")  # fmt: skip
        for h in (0, 2)
    ]
    assert any(torch.equal(sim.work.tiles, half.tiles) for half in halves) and sim.work.tiles.shape == (4, 2)
    assert sim.gathered_bytes == 2 * shard_bytes(lay.local_len, 1, 128)
    # Ulysses 4 on nodes of 4: one ring rank a node, nothing to gather.
    with pytest.raises(ValueError, match="all-gather group of one ring rank"):
        simulate_attention(index, n, 8, Plan("striped", "ulysses", 4, kv_exchange="all_gather"), topo, CALIBRATED,
                           SHAPE)  # fmt: skip


def test_collectives_by_hand():
    """W = 4, groups of 2 on nodes of 2: a part moves in 0.01 ms over NVLink, 0.1 ms across nodes (no latency)."""
    topo = Topology(gpus_per_node=2, nvlink_gbs=100.0, nvlink_latency_us=0.0, internode_gbs=10.0,
                    internode_latency_us=0.0)  # fmt: skip
    compute = torch.tensor([[1.0, 2.0], [3.0, 0.0], [1.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    kwargs = dict(shard_bytes=1e6, inner=2, kv_exchange="all_gather")
    fwd = ring_timeline(compute, topo, **kwargs)
    # Outer step 0: the gather (0.01) then each rank's call; step 1 waits for the group's last rank, then gathers.
    assert fwd.start.flatten().tolist() == pytest.approx([0.01, 3.02, 0.01, 3.02, 0.01, 2.02, 0.01, 2.02])
    assert fwd.finish.tolist() == pytest.approx([5.02, 3.02, 3.02, 4.02]) and fwd.total_ms == pytest.approx(5.02)
    bwd = ring_timeline(compute, topo, backward=True, **kwargs)
    # The fp32 dK/dV's reduce-scatter (0.02) after the group's last call, then the outer hop (0.1) carries it.
    assert bwd.end[:, 0].tolist() == pytest.approx([3.03, 3.03, 2.03, 2.03])
    assert bwd.start[:, 1].tolist() == pytest.approx([3.04, 3.04, 2.04, 2.04])
    assert bwd.finish.tolist() == pytest.approx([5.06, 5.06, 5.16, 5.16])
    # A flat group over both nodes gathers its 3 other shards over the inter-node link.
    flat = ring_timeline(compute[:, :1], topo, shard_bytes=1e6, kv_exchange="all_gather")
    assert flat.start[:, 0].tolist() == pytest.approx([0.3] * 4) and flat.total_ms == pytest.approx(3.3)
    with pytest.raises(ValueError, match=r"compute must be \[W, 2\]"):
        ring_timeline(compute[:, :1], topo, **kwargs)


def test_memory_adds_the_gathered_kv_and_fp32_dkv():
    n, world = 8192, 4
    topo = Topology(gpus_per_node=2)
    plans = [Plan("striped", ring, kv_exchange=x) for ring in ("flat", "hierarchical") for x in ("ring", "all_gather")]
    predicted, refused = rank_plans(world, n, topo, CALIBRATED, SHAPE, pattern=_index(n), plans=plans)
    assert not refused
    base = step_memory(SHAPE, n, world, MemoryAssumptions(), topo).estimate.total
    shard = shard_bytes(n // world, SHAPE.kv_heads, SHAPE.head_dim)
    extra = {p.plan: p.memory.estimate.total - base for p in predicted}
    # bf16 K/V of the group's shards and their fp32 dK/dV: 3 x 2 bytes an element of g shards; nothing for the ring.
    assert extra == {plans[0]: 0, plans[1]: 3 * world * shard, plans[2]: 0, plans[3]: 3 * 2 * shard}


def test_ranking_is_sorted_and_is_simulate_step():
    n, world, topo = 8192, 8, replace(PRESETS["h100"], gpus_per_node=4)
    index = planted_pattern_index(1, 4, n, 64, density=0.05, seed=0)
    predicted, refused = rank_plans(world, n, topo, CALIBRATED, RANKED_SHAPE, pattern=index)
    assert len(predicted) + len(refused) == len(candidate_plans(4)) == 3 * 4 * 2  # flat, hier., Ulysses 2 and 4
    assert [p.plan.name for p in predicted].count("striped, flat, K/V all-gathered") == 1
    steps = [p.step.step_s for p in predicted]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    for p in predicted[:3] + predicted[-2:]:
        att = simulate_attention(index, n, world, p.plan, topo, CALIBRATED, RANKED_SHAPE)
        assert p.attention.layer_ms == pytest.approx(att.layer_ms, rel=1e-12)
        assert p.step.step_s == pytest.approx(simulate_step(att, n, world, topo, RANKED_SHAPE).step_s, rel=1e-12)
    # The default pattern is the planted 5 % of the table; a preset by name.
    assert rank_plans(world, n, "h100", CALIBRATED, RANKED_SHAPE, gpus_per_node=4)[0][0].step == predicted[0].step


def test_a_plan_the_card_cannot_hold_ranks_last():
    n, world = 8192, 4
    shape = ModelShape(kv_heads=16, head_dim=4096)  # a gathered K/V of 2 GiB (bf16), 6 GiB with its fp32 dK/dV
    base = step_memory(shape, n, world, MemoryAssumptions(), PRESETS["h100"]).estimate.total / GiB
    topo = replace(PRESETS["h100"], gpus_per_node=4, memory_gib=(base + 3.0) / FILL)  # holds the ring only
    plans = [Plan("striped", "flat", kv_exchange="all_gather"), Plan("striped", "flat")]
    costs = KernelCosts(StepCost(10.0, 0.0), StepCost(20.0, 0.0), 64, 4096, "10-20 ms a call, no more")
    predicted, _ = rank_plans(world, n, topo, costs, shape, pattern=_index(n, 16), plans=plans)
    assert predicted[0].step.step_s > predicted[1].step.step_s  # faster, but it does not fit: ranked after
    assert [(p.plan.kv_exchange, p.fits) for p in predicted] == [("ring", True), ("all_gather", False)]


@pytest.mark.parametrize(
    ("world", "topo", "costs", "kv_heads", "winner"),
    [
        # Huge fixed costs, fast links: the fewest calls, one over the whole (small) K/V.
        (8, _links(2, 450.0, 50.0, 0.0), FIXED, 1, ("flat", "all_gather")),
        # The same with a slow inter-node link: gather inside nodes, the outer ring hides the slow hop.
        (4, _links(2, 450.0, 0.5, 0.0), FIXED, 1, ("hierarchical", "all_gather")),
        # Tiles only, fast links: calls cost nothing, the ring hides every transfer and the gather would not.
        (8, _links(4, 450.0, 50.0, 0.0), TILES, 1, ("flat", "ring")),
        # Tiles only, slow links: the ring's hops hide inside a node behind its steps' compute.
        (8, _links(4, 5.0, 0.5, 10.0), TILES, 1, ("hierarchical", "ring")),
        # Very slow links everywhere: Ulysses' shards of 1 KV head of 4 move in fewer, smaller hops.
        (4, _links(4, 0.05, 0.05, 10.0), CALIBRATED, 4, ("ulysses", "ring")),
        # The calibrated costs on 2 nodes of 8: Ulysses 4's ring gathered in node pairs, half the calls.
        (16, _links(8, 450.0, 50.0, 10.0), CALIBRATED, 1, ("ulysses", "all_gather")),
    ],
    ids=["flat-all-gather", "hierarchical-all-gather", "flat-ring", "hierarchical-ring", "ulysses-ring",
         "ulysses-all-gather"],  # fmt: skip
)
def test_each_plan_kind_wins_somewhere(world, topo, costs, kv_heads, winner):
    shape = ModelShape(heads=4, kv_heads=kv_heads, head_dim=128, layers=1000, params=1e6, optimizer_s=0.0)
    predicted, _ = rank_plans(world, 8192, topo, costs, shape)
    best = predicted[0]
    assert (best.plan.ring, best.plan.kv_exchange) == winner, [(p.plan.name, p.step.step_s) for p in predicted[:4]]
    others = [p for p in predicted if (p.plan.ring, p.plan.kv_exchange) != winner]
    assert others[0].step.step_s > 1.02 * best.step.step_s  # a real margin, not a tie
