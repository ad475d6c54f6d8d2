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
placed at step ``(local tile) mod W`` (``gathered_columns_work``): the ring's column pass is PyTorch today and is not
measured, so this is what a Triton column pass would give, not what the ring gives now.

The rest of a step (``ModelShape``): non-attention work at its measured time per token (each GPU holds ``N / W``
tokens of the sequence), ZeRO-2's gradient reduce-scatter and parameter all-gather once per optimizer step (over the
inter-node link once the ring spans nodes, not overlapped: pessimistic), and the optimizer step, its measured
one-GPU time shared by the node's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..parallel.layout import make_layout
from ..parallel.work import (
    RingWork,
    gathered_on_schedule,
    pair_runs,
    pair_work,
    ring_sources,
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
    "DENSE_COSTS", "GPU_OPTIMIZER_S", "AttentionSim", "ModelShape", "Plan", "StepSim", "simulate_attention",
    "simulate_step",
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
    and where the columns run."""

    layout: str = "striped"
    ring: Ring = "flat"
    ulysses: int = 1
    columns: Columns = "per_step"

    @property
    def name(self) -> str:
        ring = f"ulysses {self.ulysses} x ring" if self.ring == "ulysses" else self.ring
        return f"{self.layout}, {ring}"


@dataclass(frozen=True)
class AttentionSim:
    """One layer's attention under a plan: the slowest head group's work and ring replay, and the all-to-alls.

    Attributes:
        work: work per (ring rank, step) in tiles.
        forward / backward: the replayed rings (ms).
        all_to_all_ms: Ulysses' all-to-alls, forward + backward (0 without Ulysses).
    """

    plan: Plan
    work: RingWork
    forward: RingTimeline
    backward: RingTimeline
    all_to_all_ms: float

    @property
    def layer_ms(self) -> float:
        """Forward + backward attention of one layer, ms."""
        return self.forward.total_ms + self.backward.total_ms + self.all_to_all_ms


def _heads(pattern: Pattern, start: int, stop: int) -> Pattern:
    if isinstance(pattern, BlockPattern):
        return BlockPattern(pattern.seqlen, pattern.block_size, pattern.blocks[start:stop])
    return VerticalSlashIndex(pattern.vertical[:, start:stop], pattern.slash[:, start:stop], pattern.block_size)


def _work(
    pattern: Pattern, seqlen: int, layout, inner: int | None, columns: Columns, counted: dict | None, key: tuple
) -> tuple[RingWork, StepTerms]:
    """Work per (rank, step) and what each step's kernels do (``StepTerms``, ``[W, W]``). ``counted`` keeps the
    counts per (query rank, key rank) of a head group on a layout under ``key``: every ring over that layout shares
    them."""
    world = layout.world
    sources = ring_sources(world, inner)
    programs = pattern.heads * layout.local_len // pattern.block_size  # one sequence: B = 1
    runs = pair_runs(layout).gather(1, sources)
    if isinstance(pattern, BlockPattern):
        work = block_ring_work(pattern, layout, inner=inner)
        return work, StepTerms(work.tiles, programs=programs, runs=runs)
    whole = AttentionPattern(seqlen, pattern)
    counted = {} if counted is None else counted
    if key not in counted:
        counted[key] = (pair_work(whole, layout), walked_columns(whole, layout), walked_offsets(whole, layout))
    pairs, chunks, offsets = counted[key]
    if columns == "gathered":
        work, chunks = gathered_on_schedule(pairs, layout, sources), 0.0
    else:
        work, chunks = work_on_schedule(pairs, sources), chunks.gather(1, sources)
    return work, StepTerms(work.tiles, chunks, offsets.gather(1, sources), programs, runs)


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
    they walk the columns of the shard in hand before each query tile.
    ``counted``: a dict the calls on one ``pattern`` share, so plans on the same layout count its work once (at a
    thousand ranks and millions of tokens the count takes most of a call).
    """
    costs.check_block_size(pattern.block_size)
    costs = costs.for_head_dim(shape.head_dim)
    u = plan.ulysses if plan.ring == "ulysses" else 1
    per_node = topology.gpus_per_node
    if world % u or shape.heads % u or per_node % u:
        raise ValueError(
            f"Ulysses degree {u} must divide the world ({world}), the heads ({shape.heads}) and the GPUs of a node "
            f"({per_node})"
        )
    ring_size, ranks_per_node = world // u, per_node // u
    inner = ranks_per_node if plan.ring == "hierarchical" and ring_size > ranks_per_node else None
    layout = make_layout(plan.layout, ring_size, seqlen, block_size=pattern.block_size)
    kv_heads = max(1, shape.kv_heads // u)  # fewer KV heads than ranks: each keeps one
    shard = shard_bytes(layout.local_len, kv_heads, shape.head_dim)
    group = shape.heads // u
    slowest = None
    for g in range(u):
        key = (plan.layout, ring_size, g * group, (g + 1) * group)
        work, terms = _work(
            _heads(pattern, g * group, (g + 1) * group), seqlen, layout, inner, plan.columns, counted, key
        )  # fmt: skip
        timelines = []
        for cost, backward in ((costs.forward, False), (costs.backward, True)):
            compute = cost(terms) + cost.per_tile_ms * work.columns * (plan.columns == "gathered")
            timelines.append(
                ring_timeline(compute, topology, shard_bytes=shard, backward=backward, inner=inner,
                              ranks_per_node=ranks_per_node)
            )  # fmt: skip
        if slowest is None or timelines[0].total_ms + timelines[1].total_ms > sum(t.total_ms for t in slowest[1]):
            slowest = (work, timelines)
    a2a = 0.0
    if u > 1:
        # Forward: q, k, v to their head group and out back; backward: dout there and dq, dk, dv back: the same bytes.
        # Each GPU keeps 1 / U of what it holds (bf16).
        moved = seqlen / world * shape.head_dim * 2 * (u - 1) / u * (2 * shape.heads + 2 * shape.kv_heads)
        a2a = 2 * topology.hop_ms(moved, False)
    return AttentionSim(plan, slowest[0], slowest[1][0], slowest[1][1], a2a)


@dataclass(frozen=True)
class StepSim:
    """One optimizer step of one sequence of ``seqlen`` tokens on ``world`` GPUs, seconds.

    Attributes:
        attention_s: every layer's attention (forward + backward) per micro-batch.
        other_s: the rest of the model per micro-batch.
        zero_s: ZeRO-2's gradient reduce-scatter and parameter all-gather, once per step.
        optimizer_s: the optimizer step.
        accumulation: micro-batches per step.
    """

    attention_s: float
    other_s: float
    zero_s: float
    optimizer_s: float
    accumulation: int
    seqlen: int

    @property
    def step_s(self) -> float:
        return self.accumulation * (self.attention_s + self.other_s) + self.zero_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.accumulation * self.seqlen / self.step_s


def simulate_step(
    attention: AttentionSim, seqlen: int, world: int, topology: Topology, shape: ModelShape, *, accumulation: int = 1
) -> StepSim:
    """A training step around ``attention`` (one layer's, the same in every layer)."""
    other = shape.non_attention_us_per_token * 1e-6 * seqlen / world
    moved = 2 * shape.params * shape.grad_bytes * (world - 1) / world  # reduce-scatter + all-gather per GPU
    zero = topology.hop_ms(moved, world > topology.gpus_per_node) / 1e3 if world > 1 else 0.0
    optimizer = shape.optimizer_s * min(1.0, topology.gpus_per_node / world)
    return StepSim(shape.layers * attention.layer_ms / 1e3, other, zero, optimizer, accumulation, seqlen)
