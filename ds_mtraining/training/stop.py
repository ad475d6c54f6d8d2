"""Stopping a training job cleanly: SIGTERM / SIGINT, or the ``deepspeed`` command above the launcher going away.

A signal only sets a flag; the job reads it at the end of a step (all ranks agree through the step's metrics
all-reduce), writes a final checkpoint and exits, so every rank stops at the same safe point and ``latest`` always
names a complete checkpoint. A second signal ends the process at once (the interrupted save leaves only a
``.partial`` folder, and ``latest`` still names the previous checkpoint).

Why the watch: on one node the ``deepspeed`` command starts ``deepspeed.launcher.launch`` and installs no signal
handler, so SIGTERM to it kills it alone and the launcher and its ranks run on. Each rank therefore also watches
the launcher's parent from its first line on: when the launcher is orphaned during the steps, the job stops as if
signalled; before the steps (loading, rendezvous, building the engine: nothing to save, and the main thread may be
blocked in a native call that no flag reaches) the rank ends at once, and the launcher then ends the others.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["EXIT_STATUS", "StopRequest"]

EXIT_STATUS = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}
"""The exit status of a job stopped by a signal (the shell's convention); a stopped launcher counts as SIGTERM."""

_LAUNCHER = "deepspeed.launcher.launch"


class StopRequest:
    """Whether the job has been asked to stop, and why (``reason``: ``"SIGTERM"``, ``"SIGINT"``, or ``None``).

    ``stepping`` is set once the training steps begin: from then on a request is honoured at the next step's end."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.stepping = False
        self._watcher: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT in this (main) thread: a first signal asks for a stop, a second ends now."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def watch_launcher(self, poll_s: float = 1.0) -> StopRequest:
        """Under the DeepSpeed launcher, watch whether the ``deepspeed`` command above it is still there."""
        launcher = os.getppid()
        runner = _parent_of(launcher)
        if runner is not None and _LAUNCHER in _cmdline(launcher):
            self._watcher = threading.Thread(
                target=self._watch, args=(launcher, runner, poll_s), name="stop-watch", daemon=True
            )
            self._watcher.start()
        return self

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:  # asked twice: stop now, without the final checkpoint
            os._exit(EXIT_STATUS.get(name, 128 + signum))
        self.reason = name

    def _watch(self, launcher: int, runner: int, poll_s: float) -> None:
        while _parent_of(launcher) == runner:  # once the deepspeed command is gone the launcher is re-parented
            time.sleep(poll_s)
        if self.stepping:
            self.reason = self.reason or "SIGTERM"
            return
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"stopped   the deepspeed command (pid {runner}) is gone; ending the job before its first step",
                  file=sys.stderr, flush=True)  # fmt: skip
        os._exit(EXIT_STATUS["SIGTERM"])


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc`` (Linux); ``None`` where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may hold spaces


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
