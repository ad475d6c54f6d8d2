"""Point-to-point ring communication, and the deadline of every wait of the attention path.

``RingComm`` passes a tensor one hop along a ring (to the next rank, from the previous one) asynchronously:
``send_recv`` posts, ``wait`` completes. A ring algorithm posts the next hop before computing on what it holds,
so the transfer hides behind the compute. The hierarchical ring is two ``RingComm``s on two groups, taken from a
``DeviceMesh`` axis (:func:`ring_groups`).

Deadlines: every group of the attention path gets ``timeout`` (``mtraining.parallel.timeout_s``;
:func:`set_timeout` sets the default for groups made without one, :func:`group_timeout` reads it). A
``DeviceMesh`` creates its axes' groups with the ``_timeout`` of the options given for them
(``backend_override``), so each axis gets :func:`group_options`. A wait on a stalled or dead peer then fails in
the backend after that long; :func:`deadline` turns exactly that failure (gloo's ``Timed out
waiting ... for send/recv operation``, NCCL's watchdog timeout) into a :class:`CommTimeoutError` whose one-line
message names the operation, the peer rank(s), the layer and the training step where known (:func:`context`)
and the deadline; every other error passes through unchanged. On NCCL a timed-out collective is normally ended
by the watchdog, which aborts the process with its own message (the host does not wait on the GPU's work).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend  # DeviceMesh's options type; torch has no public name
from torch.distributed.device_mesh import DeviceMesh

DEFAULT_TIMEOUT_S = 600.0
"""The default of ``mtraining.parallel.timeout_s``."""

_timeout_s = DEFAULT_TIMEOUT_S
_where: dict[str, int | None] = {"step": None, "layer": None}

# What the backends raise when a wait passes the group's timeout (checked against torch 2.13's gloo):
# "[.../unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete", "Application timeout caused
# pair closure" (a later op on a pair closed by an earlier timeout), NCCL's "... ran for 3000 milliseconds before
# timing out" / "Wait timeout".
_TIMEOUT = re.compile(
    r"Timed out waiting (?P<ms>\d+)ms for (send|recv) operation|Application timeout caused pair closure"
    r"|ran for (?P<nccl_ms>\d+) milliseconds before timing out|\bWait timeout\b"
)


def set_timeout(seconds: float) -> None:
    """Make ``seconds`` the deadline of groups created without one (:class:`~.mesh.Mesh`, :func:`new_ring_groups`,
    :func:`ring_groups`, the training job's world group) and the one error messages quote."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"a communication timeout must be positive; got {seconds!r}")
    _timeout_s = float(seconds)


def group_timeout(seconds: float | None = None) -> timedelta:
    """``seconds`` (default: :func:`set_timeout`'s) as the ``timeout`` of ``dist.new_group``."""
    return timedelta(seconds=_timeout_s if seconds is None else float(seconds))


def group_options(seconds: float | None = None) -> C10dBackend.Options:
    """The deadline ``seconds`` (default: :func:`set_timeout`'s) as the options of one ``DeviceMesh`` axis
    (``backend_override``) over the default group's backend.

    DeviceMesh creates an axis's groups with ``timeout=options._timeout``; without options they would get torch's
    default timeout (10 or 30 minutes), and an axis spanning the world would reuse the world group itself. Make one
    per axis: NCCL keeps the options object of the group it creates and writes that group's ranks and name into it.
    """
    timeout = group_timeout(seconds)
    backend = dist.get_backend()
    if "nccl" in backend:  # ProcessGroupNCCL takes only its own options class (gloo uses nothing but the timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return C10dBackend.Options(backend, timeout)


def mesh_device_type() -> str:
    """The ``device_type`` of a ``DeviceMesh`` over the default group: ``"cpu"`` under gloo, else the accelerator's
    (``"cuda"`` under NCCL; DeviceMesh then makes ``LOCAL_RANK``'s GPU current if none is, as DeepSpeed does)."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type  # type: ignore[union-attr]


@contextmanager
def context(*, step: int | None = None, layer: int | None = None) -> Iterator[None]:
    """Name the training step and/or layer in the :class:`CommTimeoutError` of any wait inside (restored after).

    The ring, Ulysses and distributed-estimate functions also take ``layer=`` (captured by their backward)."""
    saved = dict(_where)
    if step is not None:
        _where["step"] = step
    if layer is not None:
        _where["layer"] = layer
    try:
        yield
    finally:
        _where.update(saved)


def set_step(step: int | None) -> None:
    """The training step a :class:`CommTimeoutError` names from now on (``None``: none)."""
    _where["step"] = step


def current_layer(layer: int | None = None) -> int | None:
    """``layer``, else the :func:`context`'s (``None``: not known)."""
    return layer if layer is not None else _where["layer"]


class CommTimeoutError(RuntimeError):
    """A collective or point-to-point wait passed its deadline: a peer is stalled or dead. The message is one
    line: rank, step and layer where known, the operation and its peer(s), the deadline."""

    def __init__(
        self,
        operation: str,
        *,
        timeout_s: float,
        rank: int | None = None,
        step: int | None = None,
        layer: int | None = None,
    ):
        self.operation, self.timeout_s, self.rank, self.step, self.layer = operation, timeout_s, rank, step, layer
        where = " ".join(
            f"{name} {value}" for name, value in (("rank", rank), ("step", step), ("layer", layer)) if value is not None
        )
        super().__init__(
            f"{where + ': ' if where else ''}{operation} did not complete within {timeout_s:g} s "
            "(mtraining.parallel.timeout_s); a rank is stalled or dead"
        )


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a backend's report that a wait passed the group's timeout."""
    return isinstance(error, CommTimeoutError) or (
        isinstance(error, RuntimeError) and _TIMEOUT.search(str(error)) is not None
    )


def _deadline_of(error: BaseException) -> float:
    """The deadline the backend quotes (exact), else the configured one."""
    found = _TIMEOUT.search(str(error))
    ms = found and (found.group("ms") or found.group("nccl_ms"))
    return int(ms) / 1000 if ms else _timeout_s


def _peers(group: dist.ProcessGroup | None) -> str:
    """The global ranks of ``group`` other than this one, for a message."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    others = [r for r in ranks if r != dist.get_rank()]
    return f"rank{'s' if len(others) != 1 else ''} {', '.join(map(str, others))}"


def timeout_error(error: BaseException, operation: str, *, layer: int | None = None) -> CommTimeoutError:
    """The :class:`CommTimeoutError` for backend timeout ``error`` raised by ``operation``."""
    return CommTimeoutError(
        operation,
        timeout_s=_deadline_of(error),
        rank=dist.get_rank() if dist.is_initialized() else None,
        step=_where["step"],
        layer=layer if layer is not None else _where["layer"],
    )


@contextmanager
def deadline(operation: str, *, group: dist.ProcessGroup | None = None, layer: int | None = None) -> Iterator[None]:
    """Raise a :class:`CommTimeoutError` for ``operation`` (with ``group``: "... over ranks ..."; the peers it
    waited for) when a wait inside passes its timeout; any other error propagates unchanged."""
    try:
        yield
    except CommTimeoutError:
        raise
    except RuntimeError as error:
        if not is_timeout(error):
            raise
        what = operation if group is None else f"{operation} with {_peers(group)}"
        raise timeout_error(error, what, layer=layer) from error


class RingComm:
    """Asynchronous sends to ``(rank + 1) % size`` and receives from ``(rank - 1) % size`` inside ``group``.

    ``name`` (what travels, e.g. ``"KV"``), ``layer`` and ``phase`` (``"forward"`` / ``"backward"``, set by the
    ring) only name the transfer in the :class:`CommTimeoutError` of a wait that passes the group's timeout.
    """

    def __init__(self, group: dist.ProcessGroup, *, name: str = "", layer: int | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.name, self.layer, self.phase = name, layer, ""
        self._requests: list[tuple[dist.Work, str]] = []

    def send_recv(
        self, send: torch.Tensor, recv: torch.Tensor | None = None, *, tag: int = 0, step: int | None = None
    ) -> torch.Tensor:
        """Post sending ``send`` to the next rank and receiving the previous rank's into ``recv`` (allocated
        like ``send`` if not given); returns ``recv``, valid after :meth:`wait`. ``tag`` keeps concurrent
        streams between the same two ranks apart; ``step`` (the ring step) names the transfer in errors."""
        recv = torch.empty_like(send) if recv is None else recv
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        what = f" of {self.name}" if self.name else ""
        at = f" at ring step {step}" if step is not None else ""
        if len(works) == 2:  # one work per op (gloo); NCCL coalesces the batch into one
            names = [f"ring send{what} to rank {self.next}{at}", f"ring recv{what} from rank {self.prev}{at}"]
        else:
            names = [f"ring send/recv{what} to rank {self.next} / from rank {self.prev}{at}"] * len(works)
        if self.phase:
            names = [f"{name} ({self.phase})" for name in names]
        self._requests.extend(zip(works, names))
        return recv

    def wait(self) -> None:
        """Complete every posted transfer; :class:`CommTimeoutError` when one passes the group's timeout."""
        try:
            for request, name in self._requests:
                with deadline(name, layer=self.layer):
                    request.wait()
        finally:
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


def _check_inner_size(size: int, inner_size: int | None) -> int:
    """``inner_size`` (``None``: ``size``, a flat ring), checked to divide the ring's ``size``."""
    inner_size = size if inner_size is None else inner_size
    if inner_size < 1 or size % inner_size:
        raise ValueError(f"inner ring size {inner_size} must divide the ring size {size}")
    return inner_size


def ring_groups(
    mesh: DeviceMesh, axis: str, inner_size: int | None = None, *, timeout_s: float | None = None
) -> RingGroups:
    """The groups of the rings along ``mesh``'s ``axis``; a collective over the world (it may create groups).

    ``ring`` is the axis's group. A flat ring (``inner_size`` ``None`` or the axis's size) runs its transfers on
    that group too. Otherwise the axis is unflattened into ``(size / inner_size, inner_size)`` axes named
    ``<axis>_outer`` and ``<axis>_inner`` (their groups get the deadline ``timeout_s``, default
    :func:`set_timeout`'s): ring position ``outer * inner_size + inner`` is the position on ``axis``, and an inner
    ring is ``inner_size`` consecutive positions (one node's).
    """
    dim = mesh.mesh_dim_names.index(axis)  # type: ignore[union-attr]
    size = mesh.size(dim)
    inner_size = _check_inner_size(size, inner_size)
    nested = None
    if inner_size < size:
        names = (f"{axis}_outer", f"{axis}_inner")
        # torch 2.11-2.13 has no public unflatten; _unflatten is the one way to split an axis into two. The axis goes
        # by its index: torch 2.11 refuses every axis given by name (pytorch/pytorch#176443, an inverted check).
        nested = mesh._unflatten(
            dim, (size // inner_size, inner_size), names, backend_override={n: group_options(timeout_s) for n in names}
        )
    if mesh.get_coordinate() is None:  # only after the collective part, which every process takes
        raise ValueError(f"rank {dist.get_rank()} is not in the ring {mesh.mesh.tolist()}")
    ring = mesh.get_group(axis)
    if nested is None:  # one group is enough: the ring's collectives never overlap its transfers
        return RingGroups(ring, ring)
    return RingGroups(ring, nested.get_group(f"{axis}_inner"), nested.get_group(f"{axis}_outer"))


def new_ring_groups(ranks: list[int], inner_size: int | None = None, *, timeout_s: float | None = None) -> RingGroups:
    """Create the groups of a ring over global ``ranks`` (in ring order); a collective over the world.

    Every process of the default group must call it with the same arguments (group creation is collective). It is
    :func:`ring_groups` on a one-axis ``DeviceMesh`` over ``ranks``: ``inner_size`` ranks form a node's inner ring
    (consecutive in ``ranks``); ``None`` or ``len(ranks)`` gives a flat ring. ``timeout_s``: the groups' deadline
    (default: :func:`set_timeout`'s).
    """
    _check_inner_size(len(ranks), inner_size)  # before any collective, the same on every process
    mesh = DeviceMesh(
        mesh_device_type(), ranks, mesh_dim_names=("ring",), backend_override=((None, group_options(timeout_s)),)
    )
    return ring_groups(mesh, "ring", inner_size, timeout_s=timeout_s)
