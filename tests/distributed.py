"""Run a function on N real processes joined in a process group (gloo on CPU, NCCL one GPU a process), with a
deadline: tests fail, never hang."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# What every test's processes import (6-7 s a process on two cores): a gloo test forks its processes from a server
# that imported these once per pytest process (forkserver), rather than spawning fresh interpreters that each import
# them again. A module missing here is imported by the process itself, as under spawn.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "deepspeed",
    "ds_mtraining.integration.transformers",
    "ds_mtraining.integration.batch",
    "ds_mtraining.parallel.ring",
    "ds_mtraining.parallel.estimate",
    "ds_mtraining.training.trainer",
]


def _start_method(backend: str) -> str:
    """forkserver for gloo (CPU) groups; spawn for NCCL, whose processes must not inherit a CUDA-touched parent."""
    return "forkserver" if backend == "gloo" else "spawn"


def _worker(
    rank: int, world: int, backend: str, init_file: str, fn: Callable, args: tuple, errors, environ: dict[str, str]
) -> None:
    # The test process's environment as it is now, as a spawned process gets it (a forked one has the server's).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)  # N processes share 2 cores: oversubscribed threads slow everything down
    device = None
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60),
        device_id=device,
    )  # fmt: skip
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
    # The outcome is decided. About one run in eight of a DeepSpeed engine in a spawned process then aborts in the
    # interpreter's teardown ("terminate called without an active exception": a C++ thread still joinable when its
    # owner's static destructor runs), which would turn a passed test into a failed one: leave without teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(world: int, fn: Callable, *args, timeout: float = 120.0, backend: str = "gloo") -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` processes of one ``backend`` group (``"nccl"``: rank r on GPU r);
    raise if any fails or if they have not all finished within ``timeout`` seconds (then every process is killed)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (read by NCCL at communicator init)
    method = _start_method(backend)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read once, when this process's server starts
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker,
            args=(world, backend, os.path.join(tmp, "init"), fn, args, errors, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout
        try:
            # join() returns whenever one process exits; keep joining until all have, or the deadline passes.
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"distributed test with {world} processes did not finish in {timeout:.0f} s")
        except mp.ProcessRaisedException as err:
            messages = []
            while not errors.empty():
                messages.append(errors.get())
            raise AssertionError("\n".join(messages) or str(err)) from None
