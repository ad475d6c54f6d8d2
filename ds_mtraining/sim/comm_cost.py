"""When is the ring's communication hidden? Step time = max(compute of the busiest rank, KV transfer).

Forward pass only (the backward sends K/V and dK/dV around a second ring against ~2.5x the compute, so its
ratio of compute to traffic is similar). Each step computes on the shard in hand while the next one moves
(double-buffered); the last step of a ring has nothing left to receive.

- flat ring: every hop of a ring that spans nodes is synchronous with the slowest one, so each step waits
  for the inter-node link when ``world > gpus_per_node``, else for NVLink;
- hierarchical ring (``inner = gpus_per_node``): per outer step, the inner ring runs its ``inner`` steps
  on NVLink while each GPU's shard crosses to the next node over its own inter-node link; the outer step
  lasts ``max(inner ring, one shard over the inter-node link)``.

Gathered columns (:mod:`.balance`) are all-gathered before the ring (NCCL-style: ``(W - 1) / W`` of them
arrive at each GPU over the slowest link the group spans), sharing the first shard transfer's link and
overlapped with the first step. That is pessimistic: the balancer could place column work late so the gather
overlaps several steps, and the backward reuses the gathered columns. FLOPs per tile: ``4 · bs² · D`` (QKᵀ and PV) per query head; work is in tiles,
summed over heads, so one tile of work is one head's ``bs × bs`` tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sparse.pattern import AttentionPattern


@dataclass(frozen=True)
class Cluster:
    """Per-GPU rates of the simulated machine.

    Attributes:
        tflops: achieved sparse-kernel TFLOP/s per GPU on the tiles (forward).
        nvlink_gbs: intra-node bandwidth per GPU, GB/s (one direction).
        internode_gbs: inter-node bandwidth per GPU (its own NIC), GB/s.
        gpus_per_node: GPUs sharing NVLink.
    """

    tflops: float = 200.0
    nvlink_gbs: float = 300.0
    internode_gbs: float = 25.0
    gpus_per_node: int = 8


@dataclass(frozen=True)
class RingTime:
    """Simulated forward time of one attention call, milliseconds.

    Attributes:
        compute_ms: ``Σ_s max_r`` compute (the ring with free communication).
        total_ms: with communication.
        transfer_ms: one KV shard over the link a step waits for.
    """

    compute_ms: float
    total_ms: float
    transfer_ms: float

    @property
    def exposed_fraction(self) -> float:
        """Share of the total spent waiting for communication."""
        return max(0.0, 1.0 - self.compute_ms / self.total_ms)  # max: rounding when fully hidden


def shard_bytes(local_len: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of one rank's K and V shard: ``2 · local_len · kv_heads · head_dim · dtype_bytes``."""
    return 2 * local_len * kv_heads * head_dim * dtype_bytes


def column_bytes(pattern: AttentionPattern, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of the gathered columns' K and V of ``pattern`` (with an index): per KV head, the union of its query
    heads' columns."""
    index, seqlen = pattern.index, pattern.seqlen
    if index is None:
        raise ValueError("column_bytes needs a pattern with an index (a dense pattern has no columns)")
    group = index.heads // kv_heads
    mask = index.column_mask(seqlen).view(index.batch, kv_heads, group, seqlen).any(2)
    return 2 * int(mask.sum()) * head_dim * dtype_bytes


def ring_time(
    work: torch.Tensor,
    cluster: Cluster,
    *,
    block_size: int,
    head_dim: int,
    shard: int,
    gathered: int = 0,
    hierarchical: bool = False,
) -> RingTime:
    """Forward time of a ring whose per-(rank, step) work is ``work`` (float64 ``[W, W]``, tiles).

    Args:
        shard: bytes of one KV shard (:func:`shard_bytes`).
        gathered: bytes every rank receives in the column all-gather before the ring (0: none).
        hierarchical: inner rings of ``cluster.gpus_per_node`` ranks (``work`` must follow that schedule,
            ``ring_work(..., inner=gpus_per_node)``); else one flat ring.
    """
    world = work.shape[0]
    compute = work.max(0).values * (4 * block_size**2 * head_dim) / (cluster.tflops * 1e12) * 1e3  # ms per step
    nvlink = shard / (cluster.nvlink_gbs * 1e9) * 1e3
    internode = shard / (cluster.internode_gbs * 1e9) * 1e3
    multi_node = world > cluster.gpus_per_node
    # The column all-gather: (W - 1) / W of the columns arrive, over the slowest link the group spans; it
    # shares that link with the first shard transfer.
    gather = (
        gathered * (world - 1) / world / ((cluster.internode_gbs if multi_node else cluster.nvlink_gbs) * 1e9) * 1e3
    )
    if hierarchical and multi_node:
        inner = cluster.gpus_per_node
        if world % inner:
            raise ValueError(f"world {world} is not a whole number of nodes of {inner} GPUs")
        steps = torch.maximum(compute, torch.full_like(compute, nvlink)).view(-1, inner)
        steps[:, -1] = compute.view(-1, inner)[:, -1]  # an inner ring's last step receives nothing
        wait = torch.full((world // inner,), internode, dtype=torch.float64)
        wait[0] += gather
        outer = torch.maximum(steps.sum(1), wait)
        outer[-1] = steps[-1].sum()  # nothing left to receive
        total, transfer = float(outer.sum()), internode
    else:
        link = internode if multi_node else nvlink
        wait = torch.full_like(compute, link)
        wait[0] += gather
        steps = torch.maximum(compute, wait)
        steps[-1] = compute[-1]
        total, transfer = float(steps.sum()), link
    return RingTime(float(compute.sum()), total, transfer)
