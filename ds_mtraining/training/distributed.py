"""Joining the launcher's process group: gloo on CPU, NCCL on GPU; a plain ``python`` run is a world of one."""

from __future__ import annotations

import atexit
import os

import torch

from ..integration.deepspeed import release_cpu_allreduce_buffer
from .settings import UsageError

__all__ = ["check_master_port", "init_distributed"]


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the launcher's process group (nothing to do when one exists already).

    The world group's collectives (DeepSpeed's gradient reduction, the metrics) get the deadline ``timeout_s``
    (``mtraining.parallel.timeout_s`` in the job; default ``comm.DEFAULT_TIMEOUT_S``), as the mesh's groups do;
    DeepSpeed's own default (10 minutes, or ``DEEPSPEED_TIMEOUT``) is not used."""
    import deepspeed
    import torch.distributed as dist

    from ..parallel.comm import group_timeout

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    elif os.environ["RANK"] == "0":
        check_master_port(int(os.environ.get("MASTER_PORT", "29500")))
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=group_timeout(timeout_s)
    )
    atexit.register(release_cpu_allreduce_buffer)


def check_master_port(port: int) -> None:
    """Rank 0 is about to serve the rendezvous on ``port``: a port already taken (most often by another job on this
    machine) is one line naming the launcher's option, instead of a traceback minutes later."""
    import errno
    import socket

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
