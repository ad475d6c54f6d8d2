"""The main job's command line (``launch/train.py``): flags -> :class:`.TrainSettings` -> plan -> :class:`.Trainer`,
and the job's exit statuses.

    0    trained to --steps (or nothing left to do)
    2    an input or the installation is wrong: one ``error:`` line naming the fix, nothing written
    3    a peer did not answer within ``mtraining.parallel.timeout_s`` (every rank that saw it says so in one line)
    4    the loss or the gradient norm went non-finite (the last good checkpoint is named)
    5    a step ran out of GPU memory (one line: what the GPU held, the fixes that apply)
    130, 143  stopped by SIGINT / SIGTERM after a step (its checkpoint written)
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time
from typing import NoReturn

import torch

from ..console import print_error
from ..integration.deepspeed import optimizer_offloaded, release_cpu_allreduce_buffer
from ..integration.ds_config import cpu_checkpointing
from ..notices import quiet_library_notices
from .distributed import RendezvousError
from .finite import NonFiniteError
from ..memory import out_of_memory_message
from .plan import INPUT_ERRORS, describe, plan
from .settings import TrainSettings
from .stop import StopRequest

__all__ = ["INPUT_ERROR_WAIT_S", "RENDEZVOUS_GRACE_S", "leave", "main", "parse_args"]

INPUT_ERROR_WAIT_S = 10.0
"""How long a rank other than 0 waits, after an input error, for rank 0's line to end the job."""

RENDEZVOUS_GRACE_S = 3.0
"""How long a rank waits after saying that the rendezvous failed, so that peers at the same deadline say it too."""

_DEFAULTS = TrainSettings.__dataclass_fields__


def _default(name: str):
    return _DEFAULTS[name].default


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the description's layout and shows each flag's default."""


def parse_args(argv: list[str] | None = None, description: str | None = None) -> TrainSettings:
    """The job's flags as :class:`.TrainSettings` (checked: a setting that cannot be used raises ``UsageError``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    parser.add_argument("--deepspeed", default=_default("deepspeed"), help="DeepSpeed JSON config")
    parser.add_argument(
        "--model",
        default=_default("model"),
        help="tiny-qwen2 (random init), smollm2-135m (pretrained), a Hugging Face folder (weights loaded), or a "
        "config-only folder / config.json (random init of that architecture, e.g. model_configs/qwen2.5-3b)",
    )
    parser.add_argument(
        "--data",
        help="packed rows from launch/prepare_data.py (its OUT/train folder); default: synthetic copies for "
        "tiny-qwen2, the bundled corpus for a pretrained model",
    )
    parser.add_argument(
        "--heldout",
        help="packed rows from launch/prepare_data.py (its OUT/heldout folder): the mean loss of the first "
        "--heldout-rows rows is logged as heldout_loss every --heldout-every steps and after the last",
    )
    parser.add_argument(
        "--heldout-rows", type=int, default=_default("heldout_rows"), help="held-out rows evaluated (default 4)"
    )
    parser.add_argument(
        "--heldout-every",
        type=int,
        default=_default("heldout_every"),
        help="evaluate the held-out rows every N steps too (0: after the last)",
    )
    parser.add_argument("--rope-kind", choices=["linear", "yarn", "ntk"], help="RoPE scaling past the trained context")
    parser.add_argument(
        "--rope-factor", type=float, default=_default("rope_factor"), help="new context / trained context"
    )
    parser.add_argument("--seqlen", type=int, default=_default("seqlen"), help="tokens per sequence")
    parser.add_argument(
        "--steps", type=int, default=_default("steps"), help="optimizer steps to reach (counting resumed ones)"
    )
    parser.add_argument(
        "--output-dir", default=_default("output_dir"), help="metrics, loss plot and checkpoints go here"
    )
    parser.add_argument(
        "--save-interval",
        type=int,
        default=_default("save_interval"),
        help="checkpoint every N steps too (0: only at the end)",
    )
    parser.add_argument("--no-save", action="store_true", help="write no checkpoint at all (benchmarks)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoints/latest")
    parser.add_argument("--seed", type=int, default=_default("seed"), help="model init and data seed")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = vars(parser.parse_args(argv))
    del args["local_rank"]
    return TrainSettings(**args)


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """Run the job with the flags ``argv`` (default ``sys.argv[1:]``); returns its exit status (a peer that does not
    answer, or a step out of GPU memory, ends the process here with status 3 or 5: a normal exit could block in
    the backend's teardown)."""
    from ..parallel import comm
    from .trainer import Trainer

    quiet_library_notices()
    rank = os.environ.get("RANK", "0")
    stop = StopRequest().watch_launcher()  # from the first line: start-up can be long, or blocked
    try:
        p = plan(parse_args(argv, description))
        comm.set_timeout(p.mtraining.parallel.timeout_s)  # the deadline a backend's timeout message is read against
        stop.install()  # before the engine: a signal during its start-up stops after the first step
        with Trainer(p, stop=stop, banner=describe(p)) as trainer:
            stop.stepping = True
            return trainer.fit()
    except INPUT_ERRORS as e:
        # Every rank meets the same checks, and one line says it: rank 0's. The others wait for the launcher to end
        # them once rank 0 has said it; exiting at once could end the job before rank 0 printed (the launcher ends
        # every rank when one exits). A rank still here after the wait failed alone and says so itself.
        if rank != "0":
            _linger(INPUT_ERROR_WAIT_S)
            e = RuntimeError(f"rank {rank}: {e}")
        print_error(e)
        return 2
    except RendezvousError as e:  # every rank that cannot reach rank 0 says so, before the launcher ends its peers
        print_error(e)
        _linger(RENDEZVOUS_GRACE_S)
        return 3
    except NonFiniteError as e:  # every rank raises it at the same step; one says so
        if rank == "0":
            print_error(e)
        return 4
    except torch.OutOfMemoryError:  # on the rank (GPU) that ran out; the launcher then ends the others
        oom = out_of_memory_message(
            seqlen=p.settings.seqlen, offload=optimizer_offloaded(p.ds_config), fused=p.fused.apply,
            checkpoints_on_host=cpu_checkpointing(p.ds_config) or p.mtraining.activation_checkpointing.every is None,
            tiled=p.mtraining.tiled_mlp.tokens_per_tile is not None,
        )  # fmt: skip
        _leave_now(RuntimeError(oom), 5)
    except RuntimeError as e:
        if not comm.is_timeout(e):
            raise
        # A peer is stalled or dead: every rank that sees it says so in one line and leaves at once.
        if not isinstance(e, comm.CommTimeoutError):  # a world-group collective outside the attention
            e = comm.timeout_error(e, "a collective of the world group (gradient reduction or metrics)")
        _leave_now(e, 3)


def _linger(seconds: float) -> None:
    """Wait ``seconds`` before leaving, in a job of several processes, so that a peer can print its line first; the
    launcher's SIGTERM (it ends every rank once one has exited) ends the wait and the process quietly."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    sys.stderr.flush()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(seconds)


def _leave_now(error: BaseException, status: int) -> NoReturn:
    """Say ``error`` in one line and end the process at once: its peers may be inside a collective, where a normal
    exit would block in the backend's teardown or atexit handlers; the launcher then ends the other ranks."""
    print_error(error)
    sys.stderr.flush()
    sys.stdout.flush()
    release_cpu_allreduce_buffer()  # os._exit skips the atexit handlers
    os._exit(status)


def leave(status: int) -> NoReturn:
    """End the process with ``status`` once :func:`main` has returned: leave the process group, run the atexit
    handlers (log handlers, the CPU all-reduce workspace), and skip the interpreter's own teardown.

    That teardown now and then aborted a two-process CPU run after it had finished and written its outputs
    ("terminate called without an active exception": a C++ thread of the communication stack still joinable when
    its owner's static destructor runs), and the launcher reported the finished job as failed.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # what a normal exit would run; os._exit runs nothing
    os._exit(status)
