"""Sparse ring attention on real gloo process groups against the single-process result.

Each rank rebuilds the whole problem from a seed, runs the ring on its layout shard and compares its rows
with the single-device ``vertical_slash_attention`` cut by the same layout (padding rows excluded).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from ds_mtraining.parallel.comm import new_ring_groups
from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.ring import RingTrace, gather_step_times, gather_step_work, sparse_ring_attention
from ds_mtraining.parallel.work import gathered_columns_work, ring_sources, ring_work
from ds_mtraining.sim import CALIBRATED, Topology
from ds_mtraining.sim.cluster import ModelShape, Plan, simulate_attention
from ds_mtraining.sparse import AttentionPattern, Documents, VerticalSlashIndex, vertical_slash_attention

BS = 64
# (layout, sparse, B, N, Hq, Hkv, D, dtype): N=448 splits evenly for W=2 striped only; the others pad.
CASES = [
    ("striped", True, 2, 448, 4, 2, 32, torch.float32),
    ("zigzag", True, 1, 700, 4, 1, 32, torch.float32),
    ("contiguous", True, 2, 300, 2, 2, 32, torch.float32),
    ("striped", False, 1, 500, 4, 2, 32, torch.float32),
    ("zigzag", False, 2, 256, 2, 1, 32, torch.float32),
    ("striped", True, 1, 640, 4, 2, 32, torch.float64),
]


# Packed documents, (case, document lengths per row): lengths of 1, bs - 1, bs, bs + 1 and longer, starting
# mid-block and on block starts, different per row.
DOC_CASES = [
    (("striped", True, 2, 448, 4, 2, 32, torch.float64), [[1, 63, 64, 65, 200, 55], [130, 318]]),
    (("zigzag", True, 1, 700, 4, 1, 32, torch.float64), [[300, 7, 393]]),
    (("striped", False, 1, 500, 2, 1, 32, torch.float64), [[64, 1, 129, 306]]),
]


def _problem(case, seed, lengths=None):
    kind, sparse, b, n, hq, hkv, d, dtype = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=gen, dtype=dtype) for h in (hq, hkv, hkv, hq))
    index = None
    if sparse:
        nb = -(-n // BS)
        index = VerticalSlashIndex.build(
            torch.randint(-1, n, (b, hq, 12), generator=gen), torch.randint(-1, nb, (b, hq, 4), generator=gen), BS
        )
    documents = None
    if lengths is not None:
        ids = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
        documents = Documents.from_document_ids(torch.stack(ids))
    return q, k, v, dout, index, documents


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*leaves)
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout)


def _ring_worker(rank: int, world: int, inner_size: int | None, cases, kv_exchange: str = "ring") -> None:
    """``cases``: ``CASES`` entries, or ``(case, document lengths)`` pairs of ``DOC_CASES``."""
    groups = new_ring_groups(list(range(world)), inner_size)
    for i, (entry, columns) in enumerate((c, m) for c in cases for m in ("gathered", "per_step")):
        case, lengths = entry if len(entry) == 2 else (entry, None)
        q, k, v, dout, index, documents = _problem(case, seed=i, lengths=lengths)
        # The whole rows' pattern, the same on every rank and for the single-device reference.
        pattern = AttentionPattern(q.shape[1], index, documents)
        layout = make_layout(case[0], world, q.shape[1], block_size=BS)
        me = groups.rank
        shards = [layout.shard(x, me) for x in (q, k, v)]
        trace = RingTrace(work=True)

        def ring(*x):
            return sparse_ring_attention(
                *x,
                pattern,
                groups=groups,
                layout=layout,
                return_lse=True,
                trace=trace,
                columns=columns,
                kv_exchange=kv_exchange,
            )

        out, lse, grads = _grads(
            ring,
            shards,
            layout.shard(dout, me),
        )
        ref_out, ref_lse, ref_grads = _grads(
            lambda *x: vertical_slash_attention(*x, pattern, return_lse=True), (q, k, v), dout
        )
        real = layout.positions(me) < q.shape[1]
        tol = {"atol": 2e-5, "rtol": 1e-5} if case[-1] == torch.float32 else {"atol": 1e-11, "rtol": 1e-11}
        where = f"rank {me}, case {case[:2]}, columns {columns}, documents {lengths}, {kv_exchange}"
        torch.testing.assert_close(
            out[:, real], layout.shard(ref_out, me)[:, real], **tol, msg=lambda m: f"out {where}: {m}"
        )
        torch.testing.assert_close(
            lse[..., real],
            layout.shard(ref_lse, me, dim=2)[..., real].to(lse.dtype),
            **tol,
            msg=lambda m: f"lse {where}: {m}",
        )
        for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
            torch.testing.assert_close(got, layout.shard(ref, me), **tol, msg=lambda m: f"{name} {where}: {m}")
        forward, backward = gather_step_times(trace, groups)
        steps = world if kv_exchange == "ring" else world // (inner_size or world)
        for load in (forward, backward):  # one call: every rank timed each of its steps
            assert load.work.shape == (world, steps) and (load.work >= 0).all()
            assert load.ring_efficiency <= 1.0 and load.worker_imbalance >= 1.0 and load.step_imbalance >= 1.0
        _check_counted_work(trace, groups, pattern, layout, inner_size, columns, where, q.shape, kv_exchange)


def _check_counted_work(trace, groups, pattern, layout, inner_size, columns, where, shape, kv_exchange) -> None:
    """The ring's own count of each step's work (its kernels' plan) is the work model's and the simulator's; an
    all-gathered inner group's step does the work of the inner ring's steps it replaces."""
    tiles, cols, padding = gather_step_work(trace, groups)
    n, world = layout.seqlen, layout.world
    sources = ring_sources(world, inner_size)[groups.rank].tolist()
    g = inner_size or world
    if kv_exchange == "all_gather":
        sources = [sorted(sources[t * g : (t + 1) * g]) for t in range(world // g)]
    else:
        sources = [[s] for s in sources]
    assert [list(s) for s in trace.sources] == sources, where
    index = pattern.index
    if index is None:  # the dense ring: the dense index
        index = VerticalSlashIndex.dense(shape[0], shape[2], n, BS)
    whole = AttentionPattern(n, index, pattern.documents)
    gathered = columns == "gathered" and index.vertical.shape[-1] > 0
    model = (gathered_columns_work if gathered else ring_work)(whole, layout, inner=inner_size, kv_exchange=kv_exchange)
    torch.testing.assert_close(tiles, model.tiles, rtol=1e-12, atol=0, msg=lambda m: f"tiles {where}: {m}")
    torch.testing.assert_close(cols, model.columns, rtol=1e-12, atol=1e-12, msg=lambda m: f"columns {where}: {m}")
    # Query tiles of layout padding only are computed (and dropped), outside the model: say how much.
    assert (padding.sum() > 0) == (layout.padded_len // BS > -(-n // BS)), where
    if pattern.documents is None and pattern.index is not None and groups.rank == 0 and kv_exchange == "ring":
        ring = "hierarchical" if inner_size else "flat"
        topology = Topology(gpus_per_node=inner_size or world)
        model_shape = ModelShape(heads=index.heads, kv_heads=1, head_dim=32, layers=1)
        plan = Plan(layout.kind, ring, columns=columns)
        sim = simulate_attention(index, n, world, plan, topology, CALIBRATED, model_shape)
        torch.testing.assert_close(sim.work.tiles, tiles, rtol=1e-12, atol=0, msg=lambda m: f"sim {where}: {m}")
        torch.testing.assert_close(sim.work.columns, cols, rtol=1e-12, atol=1e-12, msg=lambda m: f"sim {where}: {m}")


@pytest.mark.parametrize("cases", [pytest.param(CASES, id="whole"), pytest.param(DOC_CASES, id="documents")])
@pytest.mark.parametrize(
    "world,inner_size",
    [
        pytest.param(2, None, id="flat-2"),
        pytest.param(3, None, id="flat-3"),
        pytest.param(4, None, id="flat-4"),
        pytest.param(4, 2, id="hierarchical-2x2"),
    ],
)
def test_ring_matches_single_process(world, inner_size, cases):
    """Every rank's rows (out, lse) and dq/dk/dv equal the single process's, per-step and gathered columns, on
    whole rows and on packed documents (document-masked attention)."""
    run_distributed(world, _ring_worker, inner_size, cases, timeout=240)


@pytest.mark.parametrize(
    "world,inner_size",
    [
        pytest.param(2, None, id="flat-2"),
        pytest.param(3, None, id="flat-3"),
        pytest.param(4, 2, id="hierarchical-2x2"),
        pytest.param(6, 3, id="hierarchical-2x3"),
    ],
)
def test_all_gathered_ring_matches_single_process(world, inner_size):
    """With the inner group's K/V all-gathered (one step per outer step, dK/dV reduce-scattered back), every rank's
    rows and dq/dk/dv equal the single process's: flat (the whole K/V gathered), hierarchical, uneven groups."""
    run_distributed(world, _ring_worker, inner_size, CASES[:3] + DOC_CASES[:1], "all_gather", timeout=240)


def _hand_counted_worker(rank: int, world: int) -> None:
    """One head, contiguous shards of 2 blocks, offsets {0, 1} and one column at position 10 (block 0)."""
    groups = new_ring_groups(list(range(world)))
    n = 128 * world
    index = VerticalSlashIndex.build(torch.tensor([[[10]]]), torch.tensor([[[0, 1]]]), BS)
    layout = make_layout("contiguous", world, n, block_size=BS)
    # Step 0 (own shard): tiles (2r, 2r), (2r + 1, 2r + 1), (2r + 1, 2r) = 3; step 1: rank r >= 1 holds rank r - 1's
    # shard: tile (2r, 2r - 1) = 1. Query blocks 2.. attend the column (offsets 2 and up are not chosen): 2 tiles of
    # rank r >= 1, 1 / 64 of a tile each, at the step that holds shard 0 (step r), or gathered: local tile t at step t.
    tiles = torch.zeros(world, world, dtype=torch.float64)
    tiles[:, 0], tiles[1:, 1] = 3, 1
    per_step = torch.zeros(world, world, dtype=torch.float64)
    gathered = torch.zeros(world, world, dtype=torch.float64)
    for r in range(1, world):
        per_step[r, r] = 2 / BS
        gathered[r, :2] = 1 / BS
    q, k, v = (torch.randn(1, layout.local_len, 1, 32, dtype=torch.float64) for _ in range(3))
    topology, shape = Topology(gpus_per_node=world), ModelShape(heads=1, kv_heads=1, head_dim=32, layers=1)
    for columns, hand in (("per_step", per_step), ("gathered", gathered)):
        trace = RingTrace(work=True)
        sparse_ring_attention(
            q, k, v, AttentionPattern(n, index), groups=groups, layout=layout, columns=columns, trace=trace
        )  # fmt: skip
        counted_tiles, counted_columns, padding = gather_step_work(trace, groups)
        sim = simulate_attention(index, n, world, Plan("contiguous", columns=columns), topology, CALIBRATED, shape)
        for got in (counted_tiles, sim.work.tiles):
            assert torch.equal(got, tiles), (columns, got)
        for got in (counted_columns, sim.work.columns):
            assert torch.allclose(got, hand, rtol=0, atol=1e-15), (columns, got)
        assert not padding.any()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_counts_its_work_as_counted_by_hand(world):
    """The ring's own count of each (rank, step)'s work, and the simulator's, on a case counted by hand."""
    run_distributed(world, _hand_counted_worker, timeout=120)


def _estimate_worker(rank: int, world: int, inner_size: int | None) -> None:
    from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
    from ds_mtraining.sparse.planted import plant_head

    groups = new_ring_groups(list(range(world)), inner_size)
    gen = torch.Generator().manual_seed(0)
    planted = [
        plant_head(1500, columns={200: 0.2, 900: 0.1}, diagonals={0: 0.2, 5: 0.1, 700: 0.2}, sink=0.1, seed=s)
        for s in range(2)
    ]
    inputs = [
        (
            torch.stack([p[0] for p in planted], dim=1)[None].float(),
            torch.stack([p[1] for p in planted], dim=1)[None].float(),
            1.0,
        ),
        (torch.randn(2, 1000, 4, 32, generator=gen), torch.randn(2, 1000, 2, 32, generator=gen), None),
    ]
    configs = [
        SparseAttentionConfig(
            sink_tokens=4, estimator=BaselineEstimator(column_recall=0.8, diagonal_recall=0.8, last_q=64)
        ),
        SparseAttentionConfig(
            block_size=128,
            sink_tokens=0,
            local_blocks=2,
            estimator=BaselineEstimator(
                column_recall=0.95, diagonal_recall=0.9, last_q=100, max_columns=50, max_diagonals=40
            ),
        ),
        SparseAttentionConfig(sink_tokens=4, estimator=SpreadEstimator(rows=48, exclusion=64, max_columns=40)),
        SparseAttentionConfig(
            block_size=128, local_blocks=2, sink_tokens=0, estimator=SpreadEstimator(rows=20, recall=0.97)
        ),
    ]
    for q, k, scale in inputs:
        for config in configs:
            check_distributed_estimate(q, k, config, scale, groups, world)


def check_distributed_estimate(q, k, config, scale, groups, world: int, pattern=None) -> None:
    """On every layout, this rank's ``estimate_index_distributed`` of its shard equals ``estimate_index`` of the
    whole q ``[B, N, Hq, D]`` / k: the same index bit for bit, the same recall (to fp32 sums) and density.

    ``pattern``: the whole rows' ``AttentionPattern`` without an index (their packed documents), or ``None``."""
    from ds_mtraining.estimator import estimate_index
    from ds_mtraining.parallel.estimate import estimate_index_distributed

    expected, expected_report = estimate_index(q, k, config, softmax_scale=scale, return_report=True, pattern=pattern)
    for kind in ("contiguous", "zigzag", "striped"):
        layout = make_layout(kind, world, q.shape[1], block_size=config.block_size)
        index, report = estimate_index_distributed(
            layout.shard(q, groups.rank),
            layout.shard(k, groups.rank),
            config,
            groups=groups,
            layout=layout,
            softmax_scale=scale,
            return_report=True,
            pattern=pattern,
        )
        where = f"rank {groups.rank}, {kind}, N={q.shape[1]}, {config.estimator.strategy}, block {config.block_size}"
        assert torch.equal(index.vertical, expected.vertical), where
        assert torch.equal(index.slash, expected.slash), where
        torch.testing.assert_close(report.recall, expected_report.recall, atol=1e-5, rtol=0)
        torch.testing.assert_close(report.density, expected_report.density, atol=0, rtol=0)


@pytest.mark.parametrize(
    "world,inner_size",
    [pytest.param(2, None, id="flat-2"), pytest.param(3, None, id="flat-3"), pytest.param(4, 2, id="hierarchical-2x2")],
)
def test_distributed_estimate_equals_single_device(world, inner_size):
    run_distributed(world, _estimate_worker, inner_size, timeout=180)


def test_ring_rejects_a_shards_documents():
    """Every rank needs the whole rows' pattern and documents; its own shard's are refused (no process group
    needed: the ring checks the pattern before it touches one)."""
    from types import SimpleNamespace

    layout = make_layout("striped", 2, 128, block_size=BS)
    q = torch.randn(1, layout.local_len, 2, 16)
    groups = SimpleNamespace(size=layout.world)  # stand-in: the refusal comes before any collective
    shard = Documents(torch.zeros(1, layout.local_len, dtype=torch.long))
    # The shard's documents in a pattern over the whole rows: refused by the pattern itself.
    with pytest.raises(ValueError, match=r"documents are for rows of 64 tokens but the pattern's seqlen is 128"):
        AttentionPattern(layout.seqlen, documents=shard)
    # A pattern over the shard's rows: refused by the ring.
    shard_pattern = AttentionPattern(layout.local_len, documents=shard)
    message = r"the pattern is for rows of 64 tokens but the layout's are 128: the ring takes the whole rows' pattern"
    with pytest.raises(ValueError, match=message):
        sparse_ring_attention(q, q, q, shard_pattern, groups=groups, layout=layout)
    # Whole rows' documents of other rows (batch): refused by the ring's check of the pattern against q.
    other = Documents(torch.zeros(2, layout.seqlen, dtype=torch.long))
    message = r"\[2, 128\] but sparse_ring_attention's q \(the whole rows, every rank\) has batch=1, seqlen=128"
    with pytest.raises(ValueError, match=message):
        sparse_ring_attention(q, q, q, AttentionPattern(layout.seqlen, documents=other), groups=groups, layout=layout)
