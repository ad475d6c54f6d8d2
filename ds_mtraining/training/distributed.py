"""Joining the launcher's process group: gloo on CPU, NCCL on GPU; a plain ``python`` run is a world of one."""

from __future__ import annotations

import atexit
import os
import socket
import time

import torch

from ..integration.deepspeed import release_cpu_allreduce_buffer
from .settings import UsageError

__all__ = ["RendezvousError", "check_master_port", "check_rendezvous", "init_distributed"]


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

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    else:
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        # Under torchrun the launcher's agent serves the store on MASTER_PORT itself: the port is taken by design.
        serving = os.environ["RANK"] == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        if serving:
            check_master_port(port)
        check_rendezvous(addr, port, serving=serving, deadline_s=rendezvous_timeout_s)
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=group_timeout(timeout_s)
    )
    atexit.register(release_cpu_allreduce_buffer)


def check_master_port(port: int) -> None:
    """Rank 0 is about to serve the rendezvous on ``port``: a port already taken (most often by another job on this
    machine) is one line naming the launcher's option, instead of a traceback minutes later."""
    import errno

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for the store too
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UsageError(
                f"port {port} (MASTER_PORT) is in use, probably by another job on this machine; pass a free one "
                f"to the launcher, e.g. deepspeed --master_port {port + 1} launch/train.py ..."
            ) from None


def check_rendezvous(addr: str, port: int, *, serving: bool, deadline_s: float) -> None:
    """Raise :class:`RendezvousError` at once when ``addr`` does not resolve, or, on a rank that does not serve the
    store, when ``addr:port`` accepts no connection within ``deadline_s`` seconds (retried: rank 0 may start later).

    torch's own rendezvous retries an unresolvable or silent master until the process group's deadline (10 minutes
    by default), printing a warning a second, then ends in a traceback."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousError(
            f"MASTER_ADDR {addr!r} does not resolve ({e.strerror}); give the launcher the master's host name or "
            "address (deepspeed --master_addr or the hostfile's first host; torchrun --master_addr)"
        ) from None
    if serving:
        return
    end = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, end - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() >= end:
                rank = os.environ.get("RANK", "?")
                raise RendezvousError(
                    f"rank {rank} reached no rendezvous at {addr}:{port} (MASTER_ADDR:MASTER_PORT) in {deadline_s:g} "
                    f"s ({e.strerror or e}); check that rank 0 runs on {addr} and that port {port} is open between "
                    "the nodes, or raise mtraining.parallel.rendezvous_timeout_s if rank 0 starts later"
                ) from None
            time.sleep(0.5)
