"""Joining the launcher's process group: gloo on CPU, NCCL on GPU; a plain ``python`` run is a world of one."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator

import torch

from ..integration.deepspeed import release_cpu_allreduce_buffer
from ..notices import dropped_prints
from .settings import UsageError

__all__ = ["RendezvousError", "check_rendezvous", "init_distributed", "port_in_use"]


class RendezvousError(RuntimeError):
    """The master of the rendezvous does not resolve or answer; the message names it and the fix."""


def init_distributed(timeout_s: float | None = None, rendezvous_timeout_s: float = 30.0) -> None:
    """Join the launcher's process group (nothing to do when one exists already).

    The world group's collectives (DeepSpeed's gradient reduction, the metrics) get the deadline ``timeout_s``
    (``mtraining.parallel.timeout_s`` in the job; default ``comm.DEFAULT_TIMEOUT_S``), as the mesh's groups do;
    DeepSpeed's own default (10 minutes, or ``DEEPSPEED_TIMEOUT``) is not used. Before joining, every rank checks
    the rendezvous (:func:`check_rendezvous`, within ``rendezvous_timeout_s``)."""
    import deepspeed
    import torch.distributed as dist

    from ..parallel.comm import group_timeout

    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asserts it, also in a group the caller made
    if dist.is_initialized():
        return
    serving = False
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    else:
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        # Under torchrun the launcher's agent serves the store on MASTER_PORT itself: the port is taken by design.
        serving = os.environ["RANK"] == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        check_rendezvous(addr, port, serving=serving, deadline_s=rendezvous_timeout_s)
    try:
        with dropped_prints("built successfully"):  # said on every start, cached or not (ds_mtraining.notices)
            deepspeed.init_distributed(
                dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=group_timeout(timeout_s)
            )
    except dist.DistNetworkError as e:
        # Another job took the port between the check and the store's bind (two jobs started at once).
        if serving and "EADDRINUSE" in str(e):
            raise UsageError(port_in_use(port)) from None
        raise
    atexit.register(release_cpu_allreduce_buffer)


def port_in_use(port: int) -> str:
    """The one line for a rendezvous port another process holds."""
    return (
        f"port {port} (MASTER_PORT) is in use, probably by another job on this machine; pass a free one "
        f"to the launcher, e.g. deepspeed --master_port {port + 1} launch/train.py ..."
    )


def check_rendezvous(addr: str, port: int, *, serving: bool, deadline_s: float) -> None:
    """Check, within ``deadline_s`` seconds, that the rendezvous at ``addr:port`` (``MASTER_ADDR:MASTER_PORT``) can
    work, as torch's store will use it; raise :class:`RendezvousError` (or ``UsageError`` for a taken port) if not.

    - ``addr`` must resolve (checked at once).
    - The serving rank (rank 0) binds ``port`` (a port taken by another job is one line) and connects to itself
      through ``addr``, as its own store client will: an address that is not this machine's never answers it.
    - Any other rank connects to ``addr:port`` (retried: rank 0 may start later).

    torch's own rendezvous retries an unresolvable or silent master until the process group's deadline (10 minutes
    by default), printing a warning a second, then ends in a traceback; on rank 0 a master address that is not its
    own hung it without any check, since its server listens while its client waits."""
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise RendezvousError(
            f"MASTER_ADDR {addr!r} does not resolve ({e.strerror}); give the launcher the master's host name or "
            "address (deepspeed --master_addr or the hostfile's first host; torchrun --master_addr)"
        ) from None
    end = time.monotonic() + deadline_s
    if serving:
        with _listener(port, family) as listener:
            reason = _retry_until(end, lambda left: _reaches(listener, addr, port, left))
        host = socket.gethostname()
        if reason is not None:
            raise RendezvousError(
                f"rank 0 serves the rendezvous on this machine ({host}), but MASTER_ADDR:MASTER_PORT {addr}:{port} did "
                f"not lead back to it in {deadline_s:g} s ({reason}); set MASTER_ADDR to an address of {host}: the "
                "hostfile's first host must be rank 0's machine, or pass deepspeed --master_addr (torchrun "
                "--master_addr) with that machine's address"
            )
        return
    reason = _retry_until(end, lambda left: _connects(addr, port, left))
    if reason is not None:
        rank = os.environ.get("RANK", "?")
        raise RendezvousError(
            f"rank {rank} reached no rendezvous at {addr}:{port} (MASTER_ADDR:MASTER_PORT) in {deadline_s:g} s "
            f"({reason}); check that rank 0 runs on {addr} and that port {port} is open between the nodes, or raise "
            "mtraining.parallel.rendezvous_timeout_s if rank 0 starts later"
        )


def _retry_until(end: float, attempt) -> str | None:
    """Call ``attempt(seconds_left)`` every half second until it returns ``None`` (success) or ``end`` passes;
    returns the last failure's reason, or ``None``."""
    while True:
        reason = attempt(max(0.1, min(5.0, end - time.monotonic())))
        if reason is None or time.monotonic() >= end:
            return reason
        time.sleep(0.5)


def _connects(addr: str, port: int, timeout: float) -> str | None:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e)


@contextlib.contextmanager
def _listener(port: int, family: socket.AddressFamily) -> Iterator[socket.socket]:
    """A socket listening on ``port`` on every address of ``family`` (IPv6: IPv4 too), as rank 0's store will (its
    bind is the port check)."""
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for the store too
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            s.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UsageError(port_in_use(port)) from None
        s.listen(8)
        yield s


def _reaches(listener: socket.socket, addr: str, port: int, timeout: float) -> str | None:
    """Whether a connection to ``addr:port`` arrives at ``listener`` (not at another machine's port)."""
    reason = _connects(addr, port, timeout)
    if reason is not None:
        return reason
    listener.settimeout(min(timeout, 2.0))
    try:
        listener.accept()[0].close()
    except TimeoutError:
        return "another machine answered"
    return None
