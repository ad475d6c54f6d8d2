"""Point-to-point ring communication: the one place that posts sends and receives.

``RingComm`` passes a tensor one hop along a ring (to the next rank, from the previous one) asynchronously:
``send_recv`` posts, ``wait`` completes. A ring algorithm posts the next hop before computing on what it holds,
so the transfer hides behind the compute. The hierarchical ring is two ``RingComm``s on two groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class RingComm:
    """Asynchronous sends to ``(rank + 1) % size`` and receives from ``(rank - 1) % size`` inside ``group``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._requests: list[dist.Work] = []

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor | None = None, *, tag: int = 0) -> torch.Tensor:
        """Post sending ``send`` to the next rank and receiving the previous rank's into ``recv`` (allocated
        like ``send`` if not given); returns ``recv``, valid after :meth:`wait`. ``tag`` keeps concurrent
        streams between the same two ranks apart."""
        recv = torch.empty_like(send) if recv is None else recv
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        self._requests.extend(dist.batch_isend_irecv(ops))
        return recv

    def wait(self) -> None:
        """Complete every posted transfer."""
        for request in self._requests:
            request.wait()
        self._requests.clear()


@dataclass(frozen=True)
class RingGroups:
    """The process groups of one attention ring: ``inner`` (inside a node), ``outer`` (across nodes) and
    ``ring`` (all of it, for collectives such as the distributed index estimate).

    A flat ring is ``inner`` = the whole ring and ``outer = None``. Ring position of a rank:
    ``outer_rank * inner_size + inner_rank``, which is also the index of the layout shard it holds.
    """

    ring: dist.ProcessGroup
    inner: dist.ProcessGroup
    outer: dist.ProcessGroup | None = None

    @property
    def inner_size(self) -> int:
        return dist.get_world_size(self.inner)

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else dist.get_world_size(self.outer)

    @property
    def size(self) -> int:
        return self.inner_size * self.outer_size

    @property
    def rank(self) -> int:
        """This rank's position in the ring (= its layout shard)."""
        outer = 0 if self.outer is None else dist.get_rank(self.outer)
        return outer * self.inner_size + dist.get_rank(self.inner)


def new_ring_groups(ranks: list[int], inner_size: int | None = None) -> RingGroups:
    """Create the groups of a ring over global ``ranks`` (in ring order); a collective over the world.

    Every process of the default group must call it with the same arguments (``dist.new_group`` is
    collective). ``inner_size`` ranks form a node's inner ring (consecutive in ``ranks``); ``None`` or
    ``len(ranks)`` gives a flat ring.
    """
    size = len(ranks)
    inner_size = size if inner_size is None else inner_size
    if inner_size < 1 or size % inner_size:
        raise ValueError(f"inner ring size {inner_size} must divide the ring size {size}")
    me = dist.get_rank()
    ring = dist.new_group(ranks)
    inner = outer = None
    for node in range(size // inner_size):
        group = dist.new_group(ranks[node * inner_size : (node + 1) * inner_size])
        if me in ranks[node * inner_size : (node + 1) * inner_size]:
            inner = group
    if inner_size < size:
        for local in range(inner_size):
            group = dist.new_group(ranks[local::inner_size])
            if me in ranks[local::inner_size]:
                outer = group
    if inner is None:
        raise ValueError(f"rank {me} is not in the ring {ranks}")
    return RingGroups(ring, inner, outer)
