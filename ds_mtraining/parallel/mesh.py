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
:class:`Mesh` is a ``torch.distributed.device_mesh.DeviceMesh`` with the axes ``dp``, ``ring``, ``ulysses`` (in
that order, so its coordinates are ``(d, r, u)`` above) and the flattened ``sp`` = (``ring``, ``ulysses``); the
hierarchical ring unflattens ``ring`` (``comm.ring_groups``). Creating it is a collective (every process calls it
with the same shape), and every group gets the deadline ``mtraining.parallel.timeout_s`` (a wait past it raises
``comm.CommTimeoutError``, not a hang).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import RingGroups, group_options, group_timeout, mesh_device_type, ring_groups
from .ring import KVExchange
from .layout import Layout, make_layout

__all__ = ["AXES", "Mesh", "MeshCoordinates", "MeshError", "MeshShape"]

AXES = ("dp", "ring", "ulysses")
"""The mesh's axes, outermost first: global rank ``d * SP + r * U + u`` is the row-major index of ``(d, r, u)``."""


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
        kv_exchange: how K/V moves inside an inner ring (``ParallelConfig.kv_exchange``).
    """

    world: int
    dp: int
    ulysses: int
    ring: int
    inner_ring: int
    kv_exchange: KVExchange = "ring"

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
        kv_exchange: KVExchange = "ring",
    ) -> MeshShape:
        """Check the degrees against the world size and the model's heads.

        Args:
            world: processes launched.
            ulysses, ring: ``parallel.ulysses_degree`` and ``parallel.ring_degree``.
            q_heads, kv_heads: the model's attention and key/value heads.
            inner_ring: ``parallel.inner_ring_size``; ``None`` derives it from ``local_world_size``.
            local_world_size: processes per node (the launcher's ``LOCAL_WORLD_SIZE``); ``None``: one node.
            kv_exchange: ``parallel.kv_exchange``.
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
        return cls(
            world=world, dp=world // sp, ulysses=ulysses, ring=ring, inner_ring=inner_ring, kv_exchange=kv_exchange
        )

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
        if self.kv_exchange == "all_gather" and self.ring > 1:
            ring += f", K/V all-gathered in groups of {self.inner_ring}"
        return (
            f"world {self.world} = DP {self.dp} x SP {self.sp} (Ulysses {self.ulysses} x ring {self.ring}, {ring} ring)"
        )


@dataclass(frozen=True)
class MeshCoordinates:
    """A rank's place in the mesh without its process groups: what cutting a batch needs (``Mesh.shard``), and
    what pickles into a data loader's worker processes, where the groups cannot go.

    Attributes:
        shape: the mesh's degrees.
        ring_rank / ulysses_rank: the rank's ring position and its Ulysses rank inside it.
    """

    shape: MeshShape
    ring_rank: int
    ulysses_rank: int

    @property
    def sp_size(self) -> int:
        return self.shape.sp

    def shard(self, x: torch.Tensor, layout: Layout, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (global order along ``dim``, ``seqlen`` or ``padded_len`` long): the ring
        shard of ``layout``, then the Ulysses rank's contiguous chunk of it. Pad ``x`` first where zero is wrong."""
        ring_shard = layout.shard(x, self.ring_rank, dim)
        return ring_shard.chunk(self.shape.ulysses, dim=dim)[self.ulysses_rank]


class Mesh:
    """This rank's view of the job's ``DeviceMesh`` and its process groups, by name.

    ``device_mesh`` has the axes :data:`AXES` (sizes DP, R, U) and the flattened axis ``sp``;
    ``device_mesh.get_coordinate()`` is :meth:`MeshShape.coords`. The groups: ``dp``, ``sp``, ``ulysses``, ``ring``
    (a ``RingGroups``: the ``ring`` axis, its hierarchy from ``comm.ring_groups``) and ``model`` (for DeepSpeed).
    ``ulysses`` and ``ring`` are ``None`` when their degree is 1.

    A collective: every process of the default group constructs it with the same shape, in the same order
    relative to other group creations. Every group gets the deadline ``timeout_s`` (default: ``comm.set_timeout``'s,
    which the training job sets from ``mtraining.parallel.timeout_s``).
    """

    device_mesh: DeviceMesh
    dp: dist.ProcessGroup
    sp: dist.ProcessGroup
    model: dist.ProcessGroup
    ulysses: dist.ProcessGroup | None
    ring: RingGroups | None

    def __init__(self, shape: MeshShape, *, timeout_s: float | None = None):
        if not dist.is_initialized() or dist.get_world_size() != shape.world:
            got = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise MeshError(f"the mesh is for {shape.world} processes; the default group has {got}")
        self.shape = shape
        self.rank = dist.get_rank()
        timeout = group_timeout(timeout_s)
        self.timeout_s = timeout.total_seconds()
        self.device_mesh = init_device_mesh(
            mesh_device_type(),
            (shape.dp, shape.ring, shape.ulysses),
            mesh_dim_names=AXES,
            backend_override={axis: group_options(timeout_s) for axis in AXES},
        )
        # torch 2.11-2.13 has no public flatten; _flatten is how DeviceMesh gives one group over several axes.
        self.device_mesh["ring", "ulysses"]._flatten("sp", backend_override=group_options(timeout_s))
        self.dp_index, self.ring_rank, self.ulysses_rank = self.device_mesh.get_coordinate()  # type: ignore[misc]
        self.dp = self.device_mesh.get_group("dp")
        self.sp = self.device_mesh.get_group("sp")
        self.ulysses = self.device_mesh.get_group("ulysses") if shape.ulysses > 1 else None
        self.ring = (
            ring_groups(self.device_mesh, "ring", shape.inner_ring, timeout_s=timeout_s) if shape.ring > 1 else None
        )
        # DeepSpeed's mpu asks for a model-parallel group (size 1 here). The mesh has no model-parallel axis, and a
        # DeviceMesh makes groups only for its axes, so this rank's own group is made by hand. new_group is a
        # collective over the world: every process creates every rank's group.
        self.model = [dist.new_group([rank], timeout=timeout) for rank in range(shape.world)][self.rank]

    @property
    def sp_size(self) -> int:
        return self.shape.sp

    @property
    def ulysses_size(self) -> int:
        return self.shape.ulysses

    @property
    def ring_size(self) -> int:
        return self.shape.ring

    @property
    def coordinates(self) -> MeshCoordinates:
        """This rank's place in the mesh, without the process groups (picklable)."""
        return MeshCoordinates(self.shape, self.ring_rank, self.ulysses_rank)

    def shard(self, x: torch.Tensor, layout: Layout, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x``: :meth:`MeshCoordinates.shard` of :attr:`coordinates`."""
        return self.coordinates.shard(x, layout, dim)
