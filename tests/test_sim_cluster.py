"""The cluster simulator (``sim.cluster``, ``python -m ds_mtraining.sim``): its work per (worker, step) is the ring's
work model on the same index, its step times are exactly the calibrated cost model of that work, Ulysses splits the
heads, and the training step adds up as documented."""

from __future__ import annotations

import pytest
import torch

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import (
    gathered_columns_work,
    pair_runs,
    ring_sources,
    ring_work,
    walked_columns,
    walked_offsets,
)
from ds_mtraining.sim import CALIBRATED, Topology
from ds_mtraining.sim.__main__ import main
from ds_mtraining.sim.cluster import ModelShape, Plan, simulate_attention, simulate_step
from ds_mtraining.sim.patterns import cycled_heads, load_saved_index, planted_pattern_index, stretched_index
from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex

SHAPE = ModelShape(heads=4, kv_heads=2, head_dim=128, layers=2)
TOPO = Topology(gpus_per_node=2, nvlink_gbs=100.0, nvlink_latency_us=0.0, internode_gbs=10.0, internode_latency_us=0.0)


def _index(seqlen: int = 2048) -> VerticalSlashIndex:
    return planted_pattern_index(1, 4, seqlen, 64, density=0.2, seed=1)


@pytest.mark.parametrize(("world", "layout", "ring"), [(2, "striped", "flat"), (4, "zigzag", "hierarchical")])
@pytest.mark.parametrize("columns", ["gathered", "per_step"])
def test_work_is_the_rings_and_times_follow_the_cost_model(world, layout, ring, columns):
    n, index = 2048, _index()
    sim = simulate_attention(index, n, world, Plan(layout, ring, columns=columns), TOPO, CALIBRATED, SHAPE)
    lay = make_layout(layout, world, n, block_size=64)
    inner = 2 if ring == "hierarchical" else None
    pattern = AttentionPattern(n, index)
    if columns == "gathered":
        expected = gathered_columns_work(pattern, lay, inner=inner)
        chunks = torch.zeros(world, world, dtype=torch.float64)
    else:
        expected = ring_work(pattern, lay, inner=inner)
        chunks = walked_columns(pattern, lay).gather(1, ring_sources(world, inner))
    assert torch.equal(sim.work.tiles, expected.tiles) and torch.equal(sim.work.columns, expected.columns)
    # Plans on one layout share its counted work: the other ring kind, then this one again, from the shared count.
    counted = {}
    other = "flat" if ring == "hierarchical" else "hierarchical"
    simulate_attention(index, n, world, Plan(layout, other, columns=columns), TOPO, CALIBRATED, SHAPE, counted=counted)
    again = simulate_attention(index, n, world, Plan(layout, ring, columns=columns), TOPO, CALIBRATED, SHAPE,
                               counted=counted)  # fmt: skip
    assert len(counted) == 1 and torch.equal(again.work.tiles, expected.tiles)
    assert torch.equal(again.forward.compute, sim.forward.compute)
    offsets = walked_offsets(pattern, lay).gather(1, ring_sources(world, inner))
    programs = index.heads * lay.local_len // 64
    runs = pair_runs(lay).gather(1, ring_sources(world, inner))
    for timeline, cost in ((sim.forward, CALIBRATED.forward), (sim.backward, CALIBRATED.backward)):
        gathered = cost.per_tile_ms * expected.columns if columns == "gathered" else 0.0
        want = runs * (cost.fixed_ms + cost.per_tile_ms * expected.tiles + cost.per_chunk_ms * chunks
                       + cost.per_offset_ms * offsets + cost.per_program_ms * programs) + gathered  # fmt: skip
        assert torch.allclose(timeline.compute, want, rtol=1e-12, atol=0)
        assert timeline.total_ms >= float(timeline.compute.sum(1).max())


def test_two_ranks_by_hand():
    """W = 2, one head, contiguous halves of 2 blocks each, offsets {0, 1}, no columns: counted by hand."""
    n = 256
    index = VerticalSlashIndex.build(torch.full((1, 1, 1), -1), torch.tensor([[[0, 1]]]), 64)
    shape = ModelShape(heads=1, kv_heads=1, head_dim=128, layers=1)
    sim = simulate_attention(index, n, 2, Plan("contiguous", "flat"), TOPO, CALIBRATED, shape)
    # Rank 0 holds blocks 0-1, rank 1 blocks 2-3. Step 0 (own shard): rank 0 tiles (0,0) (1,1) (1,0) = 3, rank 1
    # (2,2) (3,3) (3,2) = 3; step 1: rank 1 holds rank 0's shard: tile (2,1) = 1; rank 0 holds rank 1's: none.
    assert torch.equal(sim.work.tiles, torch.tensor([[3.0, 0.0], [3.0, 1.0]], dtype=torch.float64))
    # Each step's kernels also visit offset 1 of each query tile past block 0 (rank 0: 1, rank 1: 2) and launch 2
    # programs; rank 0's step 1 has no causal work and is skipped.
    f = CALIBRATED.forward
    assert sim.forward.compute[1, 1].item() == pytest.approx(
        f.fixed_ms + f.per_tile_ms + 2 * f.per_offset_ms + 2 * f.per_program_ms
    )
    assert sim.forward.compute[0, 0].item() == pytest.approx(
        f.fixed_ms + 3 * f.per_tile_ms + f.per_offset_ms + 2 * f.per_program_ms
    )
    assert sim.forward.compute[0, 1].item() == 0.0


def test_ulysses_splits_heads_and_adds_its_all_to_alls():
    n, index = 2048, _index()
    sim = simulate_attention(index, n, 4, Plan("striped", "ulysses", ulysses=2), TOPO, CALIBRATED, SHAPE)
    lay = make_layout("striped", 2, n, block_size=64)  # a ring of 2 ranks, each a group of 2 GPUs
    halves = [
        gathered_columns_work(
            AttentionPattern(n, VerticalSlashIndex(index.vertical[:, h : h + 2], index.slash[:, h : h + 2], 64)), lay
        )
        for h in (0, 2)
    ]
    assert any(torch.equal(sim.work.tiles, half.tiles) for half in halves)
    moved = n / 4 * 128 * 2 * (1 / 2) * (2 * 4 + 2 * 2)
    assert sim.all_to_all_ms == pytest.approx(2 * moved / 100e9 * 1e3)
    with pytest.raises(ValueError, match="Ulysses degree 3 must divide"):
        simulate_attention(index, n, 4, Plan("striped", "ulysses", ulysses=3), TOPO, CALIBRATED, SHAPE)


def test_training_step_adds_up():
    n, index = 2048, _index()
    att = simulate_attention(index, n, 4, Plan(), TOPO, CALIBRATED, SHAPE)
    step = simulate_step(att, n, 4, TOPO, SHAPE, accumulation=3)
    assert step.attention_s == pytest.approx(SHAPE.layers * att.layer_ms / 1e3)
    assert step.other_s == pytest.approx(SHAPE.non_attention_us_per_token * 1e-6 * n / 4)
    assert step.zero_s == pytest.approx(2 * SHAPE.params * 2 * 3 / 4 / 10e9)  # spans 2 nodes: the slow link
    assert step.optimizer_s == pytest.approx(SHAPE.optimizer_s * 2 / 4)
    assert step.step_s == pytest.approx(3 * (step.attention_s + step.other_s) + step.zero_s + step.optimizer_s)
    assert step.tokens_per_s == pytest.approx(3 * n / step.step_s)


@pytest.mark.parametrize("pattern", ["planted", "real", "moba", "xattention"])
def test_cli_on_a_tiny_cluster(tmp_path, pattern):
    out, png = tmp_path / "sim.md", tmp_path / "heat.png"
    argv = ["--seqlen", "8192", "--world", "4", "--gpus-per-node", "2", "--pattern", pattern, "--rings", "flat",
            "hierarchical", "ulysses", "--out", str(out), "--heatmap", str(png), "--layers", "2"]  # fmt: skip
    if pattern == "real":
        argv += ["--indices", "benchmarks/results/2026-11-29-smollm2_8k_indices.pt"]  # 9 heads, cycled to 16
    if pattern == "moba":
        argv += ["--chunk", "1024"]
    assert main(argv) == 0
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    refused = [row for row in rows if row["rank"] == "-"]
    # Both K/V exchanges of 3 layouts x 3 rings; Ulysses 2 on nodes of 2 leaves all-gather groups of one rank.
    assert len(rows) == 18 and len(refused) == 3
    assert all(row["plan"].endswith("ulysses 2 x ring, K/V all-gathered") for row in refused)
    assert png.stat().st_size > 1000
    for row in rows[:15]:
        assert float(row["step s"]) > 0 and row["vs dense ref."].endswith("x")


def test_cli_refuses_real_without_indices():
    with pytest.raises(SystemExit, match="--pattern real needs --indices FILE"):
        main(["--seqlen", "4096", "--world", "2", "--pattern", "real"])


def test_saved_heads_cycle_to_the_priced_shape():
    saved = stretched_index(load_saved_index("benchmarks/results/2026-11-29-smollm2_8k_indices.pt", 3), 16384, 64)
    index = cycled_heads(saved, 16)
    assert saved.heads == 9 and index.heads == 16
    for h in range(16):
        assert torch.equal(index.vertical[:, h], saved.vertical[:, h % 9])
        assert torch.equal(index.slash[:, h], saved.slash[:, h % 9])
    assert torch.equal(cycled_heads(saved, 4).vertical, saved.vertical[:, :4])
