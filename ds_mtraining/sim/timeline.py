"""When each ring step of each worker starts and ends: the ring's dataflow, replayed with compute and link times.

The schedule is the ring's own (``parallel/ring.py``): at every step a rank posts the next K/V shard to its successor
before computing, computes on the shard in hand, and (backward) adds the dK/dV accumulator that arrived from its
predecessor to its own contribution and sends it on, one hop behind the K/V, so the last hop brings each shard's
dK/dV home. Hierarchical (``inner`` ranks a node): every outer step first posts the node's K/V to the next node over
the inter-node link, runs the whole inner ring, then (backward) passes the outer dK/dV on.

All-gathered K/V (``kv_exchange="all_gather"``, a group of ``g`` consecutive ranks: the inner ring, or the whole ring
when flat): every outer step the group all-gathers its ``g`` shards, runs one call over them and (backward)
reduce-scatters that call's fp32 dK/dV (twice the bf16 shard's bytes a shard), every rank joining both collectives
whatever its work. A collective starts when the group's last rank is ready (done with the previous step, its outer
shard arrived) and is priced as NCCL's ring algorithm, ``g - 1`` transfers of one shard (NVLink inside a node, the
inter-node link when the group spans nodes). Neither is overlapped with compute: the runtime gathers after the
previous step, with no prefetch (``parallel.ring``), so the gather cannot hide behind it; the outer ring's transfer is
posted before the gather and overlaps as in the ring.

Replayed as a dataflow per rank, vectorised over ranks: a step starts when the rank has finished the previous one
and its shard has arrived; a transfer takes ``latency + bytes / bandwidth`` of the link it crosses (NVLink inside a
node, the inter-node link across nodes; a flat ring spanning nodes crosses it at every node boundary) and starts when
its data is ready. Links are not shared: the K/V and dK/dV transfers of one hop overlap freely (optimistic where the
two directions of the backward contend for one NIC). Written here because no library replays a sparse ring's
per-step work: what is measured (``sim.costs``) and what moves (``sim.comm_cost``) come in as numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RingTimeline", "Topology", "ring_timeline"]


@dataclass(frozen=True)
class Topology:
    """The machines: GPUs per node, each GPU's links (one direction) and its memory, and the node's RAM.

    Attributes:
        gpus_per_node: GPUs sharing NVLink.
        nvlink_gbs / nvlink_latency_us: intra-node bandwidth (GB/s) and latency per transfer.
        internode_gbs / internode_latency_us: inter-node bandwidth per GPU (its own NIC) and latency.
        memory_gib: one GPU's memory as PyTorch reports it (``total_memory / 2**30``), what training's start-up
            check compares its estimate with (an "80 GB" card reports about 79.1).
        host_gib: one node's RAM, GiB, which its GPUs' ranks share for their pinned checkpoints and offloaded
            optimizer state (``memory.Machine``; default a DGX A100's 1 TiB).
    """

    gpus_per_node: int = 8
    nvlink_gbs: float = 300.0
    nvlink_latency_us: float = 10.0
    internode_gbs: float = 25.0
    internode_latency_us: float = 20.0
    memory_gib: float = 79.1
    host_gib: float = 1024.0

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or min(self.nvlink_gbs, self.internode_gbs, self.memory_gib, self.host_gib) <= 0:
            raise ValueError(f"a topology needs >= 1 GPU a node and positive bandwidths and memory; got {self}")

    def hop_ms(self, nbytes: float, internode: bool) -> float:
        """One transfer of ``nbytes`` over NVLink or the inter-node link, ms."""
        gbs, latency = (self.internode_gbs, self.internode_latency_us) if internode else (
            self.nvlink_gbs, self.nvlink_latency_us)  # fmt: skip
        return latency * 1e-3 + nbytes / (gbs * 1e9) * 1e3

    def collective_ms(self, part_bytes: float, parts: int, internode: bool) -> float:
        """An all-gather or reduce-scatter of ``parts`` ranks' parts of ``part_bytes`` each, ring algorithm: ``parts -
        1`` transfers of one part, ms (0 for one rank)."""
        return (parts - 1) * self.hop_ms(part_bytes, internode)


@dataclass(frozen=True)
class RingTimeline:
    """One attention call's ring, replayed; times in ms from the call's start, all float64.

    Attributes:
        compute: ``[W, S]`` (rank, step) kernel time of each step: ``S = W`` ring steps, or ``W / g`` all-gathered
            calls.
        start / end: ``[W, S]`` when each step's compute starts (all-gathered: after the gather), and when the step is
            done (backward: its dK/dV sent on, or reduce-scattered).
        finish: ``[W]`` when each rank is done (backward: its own shard's dK/dV home).
    """

    compute: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    finish: torch.Tensor

    @property
    def total_ms(self) -> float:
        """The call's time: the last rank's finish."""
        return float(self.finish.max())

    @property
    def idle(self) -> torch.Tensor:
        """``[W]`` time each rank spends not computing before the call ends (bubbles and exposed transfers)."""
        return self.total_ms - self.compute.sum(1)

    @property
    def efficiency(self) -> float:
        """Compute over (ranks × call time): 1 when no rank ever waits."""
        return float(self.compute.sum() / (self.compute.shape[0] * self.total_ms))

    @property
    def exposed_ms(self) -> float:
        """Call time beyond the busiest rank's compute (what communication and imbalance add)."""
        return self.total_ms - float(self.compute.sum(1).max())


def _pass(
    starts: torch.Tensor, compute: torch.Tensor, hop: torch.Tensor, dkv_hop: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ring pass of ``R`` ranks (ring order) over ``S = R`` steps: (start, end ``[R, S]``, finish ``[R]``).

    ``starts [R]``: when each rank begins (it holds its first shard); ``compute [R, S]``; ``hop [R]``: rank ``r``'s
    K/V transfer to rank ``r + 1``; ``dkv_hop`` the same for dK/dV (None: forward).
    """
    size, steps = compute.shape
    start, end = torch.empty_like(compute), torch.empty_like(compute)
    kv_at, done = starts.clone(), starts.clone()  # the shard for this step arrives at kv_at
    dkv_at = None
    for u in range(steps):
        begin = torch.maximum(done, kv_at)
        start[:, u] = begin
        if u + 1 < steps:
            kv_at = torch.roll(begin + hop, 1)  # posted before the compute, from rank r - 1
        ready = begin + compute[:, u]
        if dkv_hop is not None and size > 1:
            if dkv_at is not None:
                ready = torch.maximum(ready, dkv_at)
            dkv_at = torch.roll(ready + dkv_hop, 1)
        end[:, u] = done = ready
    finish = done if dkv_hop is None or size == 1 else torch.maximum(done, dkv_at)
    return start, end, finish


def _gathered_step(
    begin: torch.Tensor, compute: torch.Tensor, group: int, gather_ms: float, scatter_ms: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-gathered call of every group of ``group`` consecutive ranks: (start, end ``[W]``).

    ``begin [W]``: when each rank is ready (its previous step done, its outer shard in hand); ``compute [W]``: the
    call's kernel time; ``gather_ms`` / ``scatter_ms``: the K/V all-gather and (backward; None: forward) the dK/dV
    reduce-scatter, each starting when the group's last rank reaches it.
    """

    def last_of_group(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, group).amax(1).repeat_interleave(group)

    start = last_of_group(begin) + gather_ms
    end = start + compute
    return start, (end if scatter_ms is None else last_of_group(end) + scatter_ms)


def ring_timeline(
    compute: torch.Tensor,
    topology: Topology,
    *,
    shard_bytes: float,
    backward: bool = False,
    inner: int | None = None,
    ranks_per_node: int | None = None,
    ready_ms: float = 0.0,
    kv_exchange: str = "ring",
) -> RingTimeline:
    """Replay a ring whose per-(rank, step) kernel time is ``compute`` (float64, ms; ``[W, W]`` steps in the
    schedule's order, ``parallel.work.ring_sources(W, inner)``; all-gathered, ``[W, W / inner]`` calls in outer-step
    order).

    Args:
        shard_bytes: bytes of one rank's K/V shard (``sim.comm_cost.shard_bytes``); the backward's dK/dV accumulator
            is priced as large on the ring's hops, twice as large (fp32) in an all-gathered group's reduce-scatter.
        backward: replay the backward (dK/dV one hop behind the K/V) instead of the forward.
        inner: ranks per inner ring of a hierarchical ring (None: flat).
        ranks_per_node: ring ranks on one node (default ``topology.gpus_per_node``; fewer when other GPUs of the node
            belong to another parallel dimension, e.g. Ulysses, so each ring hop crosses nodes more often).
        ready_ms: when the ranks can start (e.g. after an all-gather of the columns' K/V, not overlapped).
        kv_exchange: ``"all_gather"``: each group of ``inner`` ranks (flat: all) gathers its shards for one call per
            outer step (the module docstring); ``"ring"``: one hop a step.
    """
    world = compute.shape[0]
    per_node = ranks_per_node or topology.gpus_per_node
    inner = world if inner is None else inner
    if world % inner:
        raise ValueError(f"inner ring size {inner} must divide the world size {world}")
    if inner < world and inner > per_node:
        raise ValueError(f"an inner ring of {inner} ranks spans nodes of {per_node}; use inner <= {per_node}")
    gather = kv_exchange == "all_gather"
    outer = world // inner
    steps = outer if gather else world
    if compute.shape != (world, steps):
        raise ValueError(f"compute must be [W, {steps}] (rank, step) for {kv_exchange!r}; got {tuple(compute.shape)}")
    compute = compute.to(torch.float64)
    rank = torch.arange(world)
    crossing = (rank // per_node) != (((rank % inner) + 1) % inner + rank // inner * inner) // per_node
    hop = torch.tensor([topology.hop_ms(shard_bytes, bool(c)) for c in crossing], dtype=torch.float64)
    dkv_hop = hop if backward else None
    start, end = torch.empty_like(compute), torch.empty_like(compute)
    if outer == 1 and not gather:
        start, end, finish = _pass(torch.full((world,), ready_ms, dtype=torch.float64), compute, hop, dkv_hop)
        return RingTimeline(compute, start, end, finish)
    spans = inner > per_node  # a flat group over several nodes gathers over the inter-node link
    gather_ms = topology.collective_ms(shard_bytes, inner, spans)
    scatter_ms = topology.collective_ms(2 * shard_bytes, inner, spans) if backward else None  # fp32 dK/dV
    # Hierarchical: rank n * inner + g sends its node's shard to rank (n + 1) * inner + g over the inter-node link.
    outer_hop = topology.hop_ms(shard_bytes, True)
    groups = rank.view(outer, inner)
    ready = torch.full((world,), ready_ms, dtype=torch.float64)  # when each rank finished the previous outer step
    kv_at = ready.clone()
    dkv_at = None
    for t in range(outer):
        begin = torch.maximum(ready, kv_at)
        if t + 1 < outer:
            kv_at = torch.roll(begin + outer_hop, inner)
        if gather:
            start[:, t], end[:, t] = _gathered_step(begin, compute[:, t], inner, gather_ms, scatter_ms)
            done = end[:, t].clone()
        else:
            cols = slice(t * inner, (t + 1) * inner)
            done = torch.empty(world, dtype=torch.float64)
            for g in groups:
                s, e, f = _pass(begin[g], compute[g, cols], hop[g], None if dkv_hop is None else dkv_hop[g])
                start[g, cols], end[g, cols], done[g] = s, e, f
        if backward and outer > 1:
            if dkv_at is not None:
                done = torch.maximum(done, dkv_at)
            dkv_at = torch.roll(done + outer_hop, inner)
        ready = done
    finish = ready if not backward or outer == 1 else torch.maximum(ready, dkv_at)
    return RingTimeline(compute, start, end, finish)
