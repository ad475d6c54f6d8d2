"""Process mesh: data parallel x sequence parallel, sequence parallel = Ulysses x ring; named groups.

World ``W = DP x SP`` and ``SP = U x R``. Global rank ``g = d * SP + r * U + u`` for data-parallel index ``d``,
ring position ``r`` and Ulysses index ``u``: a Ulysses group is ``U`` consecutive ranks (inside a node, where
the all-to-all is cheap) and a ring strides over them. A ring is flat, or hierarchical with ``inner`` ring
positions per node (``parallel.inner_ring_size``; when unset, taken from the launch: ``LOCAL_WORLD_SIZE / U``
ring positions share a node) and an outer ring across nodes (``RingGroups``).

Tokens: the layout (striped by default) is applied over the ``R`` ring positions; each ring shard is then cut
into ``U`` contiguous chunks, one per Ulysses rank, so the Ulysses all-to-all (sequence gathered, heads
scattered) rebuilds exactly the ring shard (:meth:`Mesh.shard`).

:class:`MeshShape` validates the degrees (pure, no processes needed; errors name the numbers and the fix);
:class:`Mesh` creates the groups (a collective: every process calls it with the same shape), each with the
deadline ``mtraining.parallel.timeout_s`` (a wait past it raises ``comm.CommTimeoutError``, not a hang).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import RingGroups, group_timeout
from .layout import Layout, make_layout

__all__ = ["Mesh", "MeshError", "MeshShape"]


class MeshError(ValueError):
    """Parallel degrees, heads, world size and sequence length do not fit together; the message says how."""


@dataclass(frozen=True)
class MeshShape:
    """Validated degrees.

    Attributes:
        world: processes in the job.
        dp: data-parallel degree (``world / (ulysses * ring)``).
        ulysses: Ulysses degree ``U`` (heads scattered over it).
        ring: ring degree ``R``.
        inner_ring: ring positions per inner (intra-node) ring; ``== ring`` for a flat ring.
    """

    world: int
    dp: int
    ulysses: int
    ring: int
    inner_ring: int

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def hierarchical(self) -> bool:
        return self.inner_ring < self.ring

    @classmethod
    def build(
        cls,
        *,
        world: int,
        ulysses: int,
        ring: int,
        q_heads: int,
        kv_heads: int,
        inner_ring: int | None = None,
        local_world_size: int | None = None,
    ) -> MeshShape:
        """Check the degrees against the world size and the model's heads.

        Args:
            world: processes launched.
            ulysses, ring: ``parallel.ulysses_degree`` and ``parallel.ring_degree``.
            q_heads, kv_heads: the model's attention and key/value heads.
            inner_ring: ``parallel.inner_ring_size``; ``None`` derives it from ``local_world_size``.
            local_world_size: processes per node (the launcher's ``LOCAL_WORLD_SIZE``); ``None``: one node.
        """
        sp = ulysses * ring
        if world % sp:
            raise MeshError(
                f"world size {world} is not a multiple of sequence_parallel_size={sp} (ulysses_degree={ulysses} x "
                f"ring_degree={ring}); launch a multiple of {sp} processes or change the degrees"
            )
        if q_heads % ulysses:
            raise MeshError(
                f"ulysses_degree={ulysses} does not divide the model's {q_heads} attention heads; "
                f"use a divisor of {q_heads}"
            )
        if kv_heads % ulysses and ulysses % kv_heads:
            raise MeshError(
                f"ulysses_degree={ulysses} and the model's {kv_heads} key/value heads: U must divide the KV heads, "
                f"or be a multiple of them (KV heads are then replicated); use a divisor or a multiple of {kv_heads}"
            )
        if inner_ring is None:
            inner_ring = ring
            if local_world_size is not None and local_world_size < sp and local_world_size % ulysses == 0:
                per_node = local_world_size // ulysses
                if per_node >= 1 and ring % per_node == 0:
                    inner_ring = per_node
        elif ring % inner_ring:
            raise MeshError(f"inner_ring_size={inner_ring} does not divide ring_degree={ring}")
        return cls(world=world, dp=world // sp, ulysses=ulysses, ring=ring, inner_ring=inner_ring)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp index, ring position, Ulysses index)`` of global ``rank``."""
        d, s = divmod(rank, self.sp)
        r, u = divmod(s, self.ulysses)
        return d, r, u

    def layout(self, seqlen: int, *, kind: str, block_size: int, stripe: int | None) -> Layout:
        """The ring-level layout of a ``seqlen``-token sequence, checked to split over the Ulysses ranks too."""
        if seqlen < 2:
            raise MeshError(f"sequence length must be at least 2 tokens (one input, one label); got {seqlen}")
        layout = make_layout(kind, self.ring, seqlen, block_size=block_size, stripe=stripe)  # type: ignore[arg-type]
        if layout.local_len % self.ulysses:
            raise MeshError(
                f"sequence length {seqlen} under the {kind} layout gives {layout.local_len} tokens per ring rank, "
                f"which the ulysses_degree={self.ulysses} ranks cannot split evenly; use a sequence length that "
                f"is a multiple of {block_size * self.ring * self.ulysses}"
            )
        return layout

    def describe(self) -> str:
        ring = f"hierarchical {self.ring // self.inner_ring} x {self.inner_ring}" if self.hierarchical else "flat"
        return (
            f"world {self.world} = DP {self.dp} x SP {self.sp} (Ulysses {self.ulysses} x ring {self.ring}, {ring} ring)"
        )


class Mesh:
    """This rank's process groups, by name: ``dp``, ``sp``, ``ulysses``, ``ring`` (a ``RingGroups``).

    A collective: every process of the default group constructs it with the same shape, in the same order
    relative to other group creations. Groups of a dimension of size 1 are ``None`` except ``dp`` and ``sp``.
    Every group gets the deadline ``timeout_s`` (default: ``comm.set_timeout``'s, which the training job sets
    from ``mtraining.parallel.timeout_s``).
    """

    def __init__(self, shape: MeshShape, *, timeout_s: float | None = None):
        if not dist.is_initialized() or dist.get_world_size() != shape.world:
            got = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise MeshError(f"the mesh is for {shape.world} processes; the default group has {got}")
        self.shape = shape
        self.rank = dist.get_rank()
        self.dp_index, self.ring_rank, self.ulysses_rank = shape.coords(self.rank)
        sp, u, r, g = shape.sp, shape.ulysses, shape.ring, shape.inner_ring
        timeout = group_timeout(timeout_s)
        self.timeout_s = timeout.total_seconds()

        def mine(ranks: list[int]) -> dist.ProcessGroup | None:
            group = dist.new_group(
                ranks, timeout=timeout
            )  # collective over the world: every process creates every group
            return group if self.rank in ranks else None

        def pick(groups) -> dist.ProcessGroup | None:
            found = [x for x in groups if x is not None]
            return found[0] if found else None

        self.sp = pick([mine(list(range(d * sp, (d + 1) * sp))) for d in range(shape.dp)])
        self.dp = pick([mine(list(range(s, shape.world, sp))) for s in range(sp)])
        self.model = pick([mine([rank]) for rank in range(shape.world)])  # size 1: DeepSpeed's model-parallel group
        self.ulysses = None
        if u > 1:
            self.ulysses = pick(
                [mine([d * sp + i * u + j for j in range(u)]) for d in range(shape.dp) for i in range(r)]
            )
        self.ring: RingGroups | None = None
        if r > 1:
            for d in range(shape.dp):
                for j in range(u):
                    ranks = [d * sp + i * u + j for i in range(r)]
                    ring = mine(ranks)
                    inner = pick([mine(ranks[n * g : (n + 1) * g]) for n in range(r // g)])
                    outer = pick([mine(ranks[i::g]) for i in range(g)]) if g < r else None
                    if ring is not None:
                        self.ring = RingGroups(ring, inner, outer)

    @property
    def sp_size(self) -> int:
        return self.shape.sp

    @property
    def ulysses_size(self) -> int:
        return self.shape.ulysses

    @property
    def ring_size(self) -> int:
        return self.shape.ring

    def shard(self, x: torch.Tensor, layout: Layout, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (global order along ``dim``, ``seqlen`` or ``padded_len`` long): the ring
        shard of ``layout``, then the Ulysses rank's contiguous chunk of it. Pad ``x`` first where zero is wrong."""
        ring_shard = layout.shard(x, self.ring_rank, dim)
        return ring_shard.chunk(self.shape.ulysses, dim=dim)[self.ulysses_rank]
