"""What the command-line entry points print: a console that suits terminals and log files, and progress bars.

On a terminal, :func:`track` draws a live rich progress bar. On a pipe or file (a cluster log, ``| tee``) a live
bar would be drawn once, cut to 80 columns: there it prints one plain line per update instead (at most one
every ``every`` seconds, and always the last), and the console never wraps long lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console

__all__ = ["Tracker", "make_console", "print_error", "track"]

_FILE_WIDTH = 160
"""Columns of a console that writes to a pipe or file: wide enough for every table the package prints."""


def make_console(*, stderr: bool = False) -> Console:
    """A rich console; writing to a pipe or file it neither wraps lines nor emits colour codes."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=_FILE_WIDTH, soft_wrap=True, no_color=True, highlight=False)


def print_error(error: BaseException) -> None:
    """``error: <message>`` on stderr, the message's lines joined into one: what an entry point prints for bad input."""
    message = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    print(f"error: {message}", file=sys.stderr)


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class Tracker:
    """The handle :func:`track` yields: ``advance(n, **fields)`` after each unit of work."""

    console: Console
    description: str
    total: int
    completed: int = 0
    every: float = 10.0
    fields: dict[str, str] = field(default_factory=dict)
    _bar: object | None = None
    _task: object | None = None
    _start: float = field(default_factory=lambda: time.perf_counter())  # looked up at each start: tests set the clock
    _started_at: int = 0
    _last_line: float = float("-inf")
    _first: tuple[float, int] | None = None  # (time, units done) at the end of the first advance

    def advance(self, n: int = 1, **fields: str) -> None:
        """Count ``n`` more units done; ``fields`` replace the values shown after the bar (e.g. ``loss="2.31"``)."""
        self.completed += n
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.update(self._task, advance=n, info=self._info())
            return
        now = time.perf_counter()
        first, self._first = self._first, self._first or (now, self.completed)
        if self.completed >= self.total or now - self._last_line >= self.every:
            self._last_line = now
            self.console.print(self._line(now, first))

    def _info(self) -> str:
        return "  ".join(f"{k} {v}" for k, v in self.fields.items())

    def _line(self, now: float, first: tuple[float, int] | None) -> str:
        """The progress line; the ETA is the rate since the first advance, whose unit carries the one-time costs
        (the first training step took about twice a later one: warm-up, the optimizer's state), so it is ``?``
        until a second advance."""
        left = self.total - self.completed
        if left == 0:
            eta = _clock(0)
        elif first is None:
            eta = "?"
        else:
            eta = _clock((now - first[0]) / (self.completed - first[1]) * left)
        return f"{self.description} {self.completed}/{self.total}  {self._info()}  elapsed {_clock(now - self._start)} ETA {eta}"


@contextmanager
def track(
    console: Console, description: str, total: int, *, completed: int = 0, every: float = 10.0, **fields: str
) -> Iterator[Tracker]:
    """Progress over ``total`` units of work (``completed`` of them already done, e.g. by a resumed run).

    ``fields`` name the values shown after the bar, with their initial text. ``every``: on a pipe or file, the
    fewest seconds between two progress lines (0: a line per update).
    """
    tracker = Tracker(console, description, total, completed, every, dict(fields), _started_at=completed)
    if not console.is_terminal:
        yield tracker
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn(f"[bold]{description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )
    tracker._bar, tracker._task = bar, bar.add_task(description, total=total, completed=completed, info=tracker._info())
    with bar:
        yield tracker
