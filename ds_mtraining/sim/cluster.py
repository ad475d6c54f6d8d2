"""One training step of a long-context model on a cluster, simulated: attention per layer through the ring's replayed
dataflow, the rest of the model at its measured rate, Ulysses' all-to-alls and ZeRO's gradient traffic.

Per layer, attention is the ring of ``sim.timeline`` over the work of ``parallel.work`` (vertical-slash indices) or
``sim.block_patterns`` (block-sparse patterns), each step priced by the measured step costs (``sim.costs``). The
parallel plans:

- ``flat``: one ring over the W GPUs;
- ``hierarchical``: inner rings of a node's GPUs, an outer ring across nodes (``parallel.ring``'s schedule);
- ``ulysses``: ``U`` GPUs of a node split the heads (all-to-all of q, k, v and out over NVLink, before and after), and a
  ring of ``W / U`` ranks, one a group of ``U``, runs over the sequence with ``Hq / U`` heads each; the slowest head
  group sets the time.

Columns (vertical-slash only), as the ring's ``ring_columns``: ``per_step`` (the ring's default) runs them inside
each step, whose kernels walk the columns of the shard in hand before each query tile (the measured
``walked_columns`` term); ``gathered``
all-gathers the columns' K/V once and runs their work apart from the steps, here priced at the slash tiles' rate and
placed at step ``(local tile) mod steps`` (``gathered_columns_work``): the ring's column pass is PyTorch today and is
not measured, so this is what a Triton column pass would give, not what the ring gives now.

K/V exchange (``Plan.kv_exchange``, the ring's ``kv_exchange``): ``ring`` passes the shards one hop a step;
``all_gather`` all-gathers a group's shards and attends them in one kernel call per outer step (dK/dV reduce-scattered
back). The group: the whole ring (``flat``), a node's ring ranks (``hierarchical``; Ulysses x ring once its ring spans
nodes, as the mesh makes its inner ring from the launcher's GPUs a node), an outer ring carrying the shards across
groups as before. A grouped call does the work of the ``g`` ring steps it replaces (``parallel.work.ring_work(...,
kv_exchange="all_gather")``, ``[W, W / g]``) and is priced once on it: its tiles, column chunks and offsets walked
summed over its shards, its fixed cost and query-tile programs paid once. The column chunks are counted as the sum of
the shards' lists, though a group's columns form one list walked in chunks of 64 from its start (the sum counts up to
one chunk more a shard, per head and query tile: twice the merged list at W = 32, four times at W = 1024): refitted
with the merged list's count, the calibration's steps fit the gathered shapes 8 % (forward) and 21 % (backward) off at
4M on 1024 ranks and 13 % at 256K on 8, against 3.5 % at most with the sum, so the sum is what the kernels' time tracks
(``benchmarks/results/2026-12-07-ring_steps_merged_columns_refit.md``). An offset that reaches two shards of the
group is visited once but counted at each (never on striped with one-block stripes, where an offset reaches one rank;
contiguous and zigzag: up to 2 and 4 times).
The collectives are priced in ``sim.timeline``, not overlapped.

The rest of a step (``ModelShape``): non-attention work at its measured time per token (each GPU holds ``N / W``
tokens of the sequence), ZeRO-2's gradient reduce-scatter and parameter all-gather once per optimizer step (over the
inter-node link once the ring spans nodes, not overlapped: pessimistic), and the optimizer step, its measured
one-GPU time shared by the node's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..parallel.layout import Layout, make_layout
from ..parallel.ring import KVExchange
from ..parallel.work import (
    RingWork,
    gathered_on_schedule,
    pair_runs,
    pair_work,
    ring_sources,
    summed_steps,
    walked_columns,
    walked_offsets,
    work_on_schedule,
)
from ..sparse.index import VerticalSlashIndex
from ..sparse.pattern import AttentionPattern
from .block_patterns import BlockPattern, block_ring_work
from .comm_cost import shard_bytes
from .costs import KernelCosts, StepCost, StepTerms
from .timeline import RingTimeline, Topology, ring_timeline

__all__ = [
    "DENSE_COSTS", "GPU_OPTIMIZER_S", "AttentionSim", "KVExchange", "ModelShape", "Plan", "StepSim",
    "simulate_attention", "simulate_step",
]  # fmt: skip

Ring = Literal["flat", "hierarchical", "ulysses"]
Columns = Literal["gathered", "per_step"]
Pattern = VerticalSlashIndex | BlockPattern


@dataclass(frozen=True)
class ModelShape:
    """The model and its measured non-attention costs (defaults: the 3B shape on one H200,
    ``benchmarks/results/2026-12-04-h200-train_step.md``, fused kernels, ``zero2_offload.json``).

    Attributes:
        heads / kv_heads / head_dim / layers: attention shape (Qwen2.5-3B: 16 / 2 / 128, 36 layers).
        params: parameters (3.09e9).
        non_attention_us_per_token: a micro-batch's time without attention per token on one GPU (run 1's "none"
            row at 128K: 4.95 s / 131,072 tokens; 256K gives 36.6).
        optimizer_s: the optimizer step on one GPU (offloaded Adam: 1.39 s; on the GPU: :data:`GPU_OPTIMIZER_S`).
        grad_bytes: bytes per parameter of the gradients ZeRO reduces (bf16: 2).
        hidden / intermediate / vocab: what the memory estimate needs besides (Qwen2.5-3B: 2048 / 11008 / 151936).
    """

    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    layers: int = 36
    params: float = 3.09e9
    non_attention_us_per_token: float = 37.8
    optimizer_s: float = 1.39
    grad_bytes: int = 2
    hidden: int = 2048
    intermediate: int = 11008
    vocab: int = 151936


GPU_OPTIMIZER_S = 0.12
"""The 3B shape's optimizer step with its state on the GPU (DeepSpeed's FusedAdam on one H200, s), against
``ModelShape.optimizer_s``'s 1.39 offloaded."""


DENSE_COSTS = KernelCosts(
    forward=StepCost(0.02, 3.91e-6, 0.0),
    backward=StepCost(0.04, 9.50e-6, 0.0),
    block_size=64,
    head_dim=128,
    source=(
        "cuDNN SDPA on one H200 at 128K (131.3 ms fwd, 450.2 ms fwd+bwd over 16 heads' 33.6M causal 64-tiles, "
        "benchmarks/results/2026-11-30-h200-kernel_bench_final.md) and an assumed launch cost per step"
    ),
)
"""The dense baseline's step costs: a ring of cuDNN-class dense steps (what a dense ring attention would run)."""


@dataclass(frozen=True)
class Plan:
    """How attention is spread: token ``layout`` over the ring, ``ring`` kind, Ulysses degree (``ring="ulysses"``),
    where the columns run, and how K/V moves inside a group of ring ranks (the module docstring)."""

    layout: str = "striped"
    ring: Ring = "flat"
    ulysses: int = 1
    columns: Columns = "per_step"
    kv_exchange: KVExchange = "ring"

    def rings(self, world: int, gpus_per_node: int) -> tuple[int, int, int | None]:
        """``(Ulysses degree, ring size, inner ring size)`` of this plan on ``world`` GPUs in nodes of
        ``gpus_per_node``; the inner size is ``None`` for a flat ring. Inner rings are a node's ring ranks for the
        hierarchical ring and for Ulysses x ring all-gathering (its ring-exchange plan stays flat), once the ring spans
        nodes."""
        u = self.ulysses if self.ring == "ulysses" else 1
        ring_size, ranks_per_node = world // u, gpus_per_node // u
        nodes_inner = self.ring == "hierarchical" or (self.ring == "ulysses" and self.kv_exchange == "all_gather")
        return u, ring_size, ranks_per_node if nodes_inner and ring_size > ranks_per_node else None

    @property
    def name(self) -> str:
        ring = f"ulysses {self.ulysses} x ring" if self.ring == "ulysses" else self.ring
        exchange = ", K/V all-gathered" if self.kv_exchange == "all_gather" else ""
        return f"{self.layout}, {ring}{exchange}"


@dataclass(frozen=True)
class AttentionSim:
    """One layer's attention under a plan: the slowest head group's work and ring replay, and the all-to-alls.

    Attributes:
        work: work per (ring rank, step) in tiles, ``[R, S]``: ``S = R`` ring steps, or ``R / g`` all-gathered calls.
        forward / backward: the replayed rings (ms).
        all_to_all_ms: Ulysses' all-to-alls, forward + backward (0 without Ulysses).
        gathered_bytes: bytes of the K/V a GPU holds gathered during a call (``g`` shards, bf16; 0 for the ring).
    """

    plan: Plan
    work: RingWork
    forward: RingTimeline
    backward: RingTimeline
    all_to_all_ms: float
    gathered_bytes: int = 0

    @property
    def layer_ms(self) -> float:
        """Forward + backward attention of one layer, ms."""
        return self.forward.total_ms + self.backward.total_ms + self.all_to_all_ms


def _heads(pattern: Pattern, start: int, stop: int) -> Pattern:
    if isinstance(pattern, BlockPattern):
        return BlockPattern(pattern.seqlen, pattern.block_size, pattern.blocks[start:stop])
    return VerticalSlashIndex(pattern.vertical[:, start:stop], pattern.slash[:, start:stop], pattern.block_size)


def _work(
    pattern: Pattern,
    seqlen: int,
    layout: Layout,
    inner: int | None,
    group: int,
    columns: Columns,
    counted: dict | None,
    key: tuple,
) -> tuple[RingWork, StepTerms]:
    """Work per (rank, kernel call) and what each call's kernels do (``StepTerms``), ``[W, W / group]``: a call per
    ring step (``group`` 1) or per all-gathered group of ``group`` shards, whose terms are its shards' summed and
    whose programs are launched once. ``counted`` keeps the counts per (query rank, key rank) of a head group on a
    layout under ``key``: every ring over that layout shares them."""
    world = layout.world
    sources = ring_sources(world, inner)
    programs = pattern.heads * layout.local_len // pattern.block_size  # one sequence: B = 1
    # A grouped call runs when any of its shards has causal work.
    runs = summed_steps(pair_runs(layout).gather(1, sources), group).clamp(max=1.0)
    if isinstance(pattern, BlockPattern):
        work = block_ring_work(pattern, layout, inner=inner).per_call(group)
        return work, StepTerms(work.tiles, programs=programs, runs=runs)
    whole = AttentionPattern(seqlen, pattern)
    counted = {} if counted is None else counted
    if key not in counted:
        counted[key] = (pair_work(whole, layout), walked_columns(whole, layout), walked_offsets(whole, layout))
    pairs, chunks, offsets = counted[key]
    if columns == "gathered":
        work, chunks = gathered_on_schedule(pairs, layout, sources, group=group), 0.0
    else:
        work, chunks = work_on_schedule(pairs, sources).per_call(group), summed_steps(chunks.gather(1, sources), group)
    return work, StepTerms(work.tiles, chunks, summed_steps(offsets.gather(1, sources), group), programs, runs)


def simulate_attention(
    pattern: Pattern,
    seqlen: int,
    world: int,
    plan: Plan,
    topology: Topology,
    costs: KernelCosts,
    shape: ModelShape,
    *,
    counted: dict | None = None,
) -> AttentionSim:
    """One layer's attention of ``pattern`` (``[1, Hq, ·]`` over ``seqlen`` tokens) on ``world`` GPUs under ``plan``.

    Steps cost ``costs`` (at the pattern's block size; per-tile terms scaled to ``shape.head_dim``) of what their
    kernels do (``StepTerms``: attended slash tiles, column chunks and slash offsets walked, query-tile programs; a
    step without causal work is skipped); K/V shards move on ``topology``. With ``gathered`` columns a step's kernels
    walk no columns and the step also runs its share of the column work (at the tile rate); with ``per_step`` columns
    they walk the columns of the shard in hand before each query tile. With ``all_gather`` each call is priced once on
    its group's summed terms and waits for the group's collectives (the module docstring).
    ``counted``: a dict the calls on one ``pattern`` share, so plans on the same layout count its work once (at a
    thousand ranks and millions of tokens the count takes most of a call).
    """
    costs.check_block_size(pattern.block_size)
    costs = costs.for_head_dim(shape.head_dim)
    per_node = topology.gpus_per_node
    u, ring_size, inner = plan.rings(world, per_node)
    if world % u or shape.heads % u or per_node % u:
        raise ValueError(
            f"Ulysses degree {u} must divide the world ({world}), the heads ({shape.heads}) and the GPUs of a node "
            f"({per_node})"
        )
    ranks_per_node = per_node // u
    gather = plan.kv_exchange == "all_gather"
    calls = (inner or ring_size) if gather else 1  # ring steps a kernel call covers
    if gather and calls == 1:
        raise ValueError(f"an all-gather group of one ring rank ({ranks_per_node} a node) is the ring plan")
    layout = make_layout(plan.layout, ring_size, seqlen, block_size=pattern.block_size)
    kv_heads = max(1, shape.kv_heads // u)  # fewer KV heads than ranks: each keeps one
    shard = shard_bytes(layout.local_len, kv_heads, shape.head_dim)
    heads = shape.heads // u
    slowest = None
    for g in range(u):
        key = (plan.layout, ring_size, g * heads, (g + 1) * heads)
        work, terms = _work(
            _heads(pattern, g * heads, (g + 1) * heads), seqlen, layout, inner, calls, plan.columns, counted, key
        )  # fmt: skip
        timelines = []
        for cost, backward in ((costs.forward, False), (costs.backward, True)):
            compute = cost(terms) + cost.per_tile_ms * work.columns * (plan.columns == "gathered")
            timelines.append(
                ring_timeline(compute, topology, shard_bytes=shard, backward=backward, inner=inner,
                              ranks_per_node=ranks_per_node, kv_exchange=plan.kv_exchange)
            )  # fmt: skip
        if slowest is None or timelines[0].total_ms + timelines[1].total_ms > sum(t.total_ms for t in slowest[1]):
            slowest = (work, timelines)
    a2a = 0.0
    if u > 1:
        # Forward: q, k, v to their head group and out back; backward: dout there and dq, dk, dv back: the same bytes.
        # Each GPU keeps 1 / U of what it holds (bf16).
        moved = seqlen / world * shape.head_dim * 2 * (u - 1) / u * (2 * shape.heads + 2 * shape.kv_heads)
        a2a = 2 * topology.hop_ms(moved, False)
    return AttentionSim(plan, slowest[0], slowest[1][0], slowest[1][1], a2a, calls * shard if gather else 0)


@dataclass(frozen=True)
class StepSim:
    """One optimizer step, seconds, of ``sequences`` data-parallel groups of GPUs, each training a sequence of
    ``seqlen`` tokens a micro-batch.

    Attributes:
        attention_s: every layer's attention (forward + backward) per micro-batch.
        other_s: the rest of the model per micro-batch.
        zero_s: ZeRO-2's gradient reduce-scatter and parameter all-gather, once per step.
        optimizer_s: the optimizer step.
        accumulation: micro-batches per step.
        sequences: sequences a micro-batch over the cluster (the data-parallel degree).
    """

    attention_s: float
    other_s: float
    zero_s: float
    optimizer_s: float
    accumulation: int
    seqlen: int
    sequences: int = 1

    @property
    def step_s(self) -> float:
        return self.accumulation * (self.attention_s + self.other_s) + self.zero_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.accumulation * self.sequences * self.seqlen / self.step_s


def simulate_step(
    attention: AttentionSim,
    seqlen: int,
    world: int,
    topology: Topology,
    shape: ModelShape,
    *,
    accumulation: int = 1,
    data_parallel: int = 1,
) -> StepSim:
    """A training step around ``attention`` (one layer's, the same in every layer) of a sequence over ``world``
    GPUs, ``data_parallel`` such groups side by side: ZeRO partitions over all ``world x data_parallel`` GPUs."""
    other = shape.non_attention_us_per_token * 1e-6 * seqlen / world
    gpus = world * data_parallel
    moved = 2 * shape.params * shape.grad_bytes * (gpus - 1) / gpus  # reduce-scatter + all-gather per GPU
    zero = topology.hop_ms(moved, gpus > topology.gpus_per_node) / 1e3 if gpus > 1 else 0.0
    optimizer = shape.optimizer_s * min(1.0, topology.gpus_per_node / gpus)
    attention_s = shape.layers * attention.layer_ms / 1e3
    return StepSim(attention_s, other, zero, optimizer, accumulation, seqlen, data_parallel)
