"""Known-harmless notices of the libraries underneath, silenced by the entry points (``launch/*.py``).

A user of ``launch/train.py`` should see the package's own output and real warnings, not DeepSpeed's and PyTorch's
notes about themselves. Each filter below matches one exact message, so anything else still shows:

- PyTorch 2.13 deprecates ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor``; DeepSpeed
  0.19's ZeRO and communication layers still call them (a ``FutureWarning`` per process and step under ZeRO-3,
  nothing the user can change).
- DeepSpeed's ``WarmupLR`` reads its own learning rate while it is being built, and warns "Attempting to get
  learning rate from scheduler before it has started" about that read on every run.
- On a machine without a GPU, DeepSpeed warns "Setting accelerator to CPU" in every process because it found
  none; choosing the CPU explicitly (``DS_ACCELERATOR=cpu``, DeepSpeed's own switch) is the same choice, unwarned.
- DeepSpeed prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" (a ``print``, not a log
  record) whenever a CPU process group loads its shared-memory op, cached or not; the job says itself when an op
  is really built (once per machine), so :func:`dropped_prints` removes that line around the process group's start.
- transformers' progress bars (loading weights, de-quantizing a GGUF file) draw with carriage returns: on a pipe or
  in a log file each is a screenful of repeated lines, so they show on a terminal only. The GGUF loader's bar is
  plain tqdm, which that switch does not reach: the conversion drops it with :func:`dropped_prints` off a terminal.

The DeepSpeed launcher (``deepspeed ...``) prints its own lines before any of this runs; ``deepspeed --log_level
warning`` quiets its INFO lines.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator

__all__ = ["dropped_prints", "quiet_library_notices"]

_DEEPSPEED_MESSAGES = ("Attempting to get learning rate from scheduler before it has started",)


class _DropMessages(logging.Filter):
    def __init__(self, messages: tuple[str, ...]):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in self.messages)


def quiet_library_notices() -> None:
    """Install the filters above (idempotent). Call before DeepSpeed is imported."""
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
    if not sys.stderr.isatty():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(_DEEPSPEED_MESSAGES))


@contextlib.contextmanager
def dropped_prints(*messages: str, stream: str = "stdout") -> Iterator[None]:
    """Run the block with ``sys.stdout`` (or ``sys.stderr``: ``stream``) held back, then write what it wrote except
    the lines that contain one of ``messages``; a progress bar's frames, joined by carriage returns, are one line.
    For notices a library prints instead of logging (log handlers and subprocesses keep their own streams)."""
    held = io.StringIO()
    redirect = contextlib.redirect_stdout if stream == "stdout" else contextlib.redirect_stderr
    try:
        with redirect(held):
            yield
    finally:
        lines = held.getvalue().split("\n")
        lines = [line + "\n" for line in lines[:-1]] + [lines[-1]]
        getattr(sys, stream).write("".join(line for line in lines if not any(m in line for m in messages)))
