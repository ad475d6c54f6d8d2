"""The training run's log: ``metrics.jsonl`` (one strict-JSON record per optimizer step) and the loss curves
``loss.png`` (training, and held out where ``heldout_loss`` was measured), written by rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .checkpoints import CheckpointError

__all__ = ["Metrics"]


class Metrics:
    """``metrics.jsonl`` (one record per step, strict JSON: a non-finite number is ``null``; on resume the records
    after the checkpoint are dropped, and so is a last line a crash cut off, with a note) and the loss curve
    ``loss.png``, titled ``title``, with a dashed line where each resume continued (the first record after a resume
    carries ``"resumed": true``). Rank 0 only."""

    def __init__(self, directory: Path, resumed_step: int, title: str = "loss"):
        self.path = directory / "metrics.jsonl"
        self.plot_path = directory / "loss.png"
        self.title = title
        self.records: list[dict] = []
        self.notes: list[str] = []
        if resumed_step and self.path.exists():
            self.records = [r for r in self._read() if r["step"] <= resumed_step]
        self.path.write_text("".join(_json_line(r) for r in self.records))
        self._resumed = bool(resumed_step)

    def _read(self) -> list[dict]:
        """The records in ``self.path``; raises :class:`CheckpointError` naming the line that is not one, except a
        cut-off last line (no newline after it: a crash while writing), which is dropped with a note."""
        text = self.path.read_bytes().decode("utf-8", errors="replace")
        lines = text.split("\n")
        complete = text.endswith("\n")
        records = []
        for number, line in enumerate(lines[:-1] if complete else lines, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if number == len(lines) and not complete:
                    self.notes.append(
                        f"note: {self.path} line {number} was cut off (a crash while writing it); dropped"
                    )
                    break
                raise CheckpointError(
                    f"{self.path} line {number} is not a JSON record ({e.msg}); fix or delete that line, then "
                    "resume again"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise CheckpointError(
                    f'{self.path} line {number} is not a metrics record (no integer "step"); fix or delete that '
                    "line, then resume again"
                )
            records.append(record)
        return records

    def add(self, record: dict) -> None:
        if self._resumed:
            record, self._resumed = {**record, "resumed": True}, False
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(_json_line(record))

    def plot(self) -> None:
        # A Figure of its own, not pyplot: no global figure state or backend to switch, and half the import time
        # (about 0.5 s of every job's end).
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        ax.plot([r["step"] for r in self.records], [r["loss"] for r in self.records], marker=".", label="training")
        heldout = [r for r in self.records if r.get("heldout_loss") is not None]
        if heldout:
            ax.plot([r["step"] for r in heldout], [r["heldout_loss"] for r in heldout], marker="o", label="held out")
        for i, r in enumerate(r for r in self.records if r.get("resumed")):
            ax.axvline(r["step"] - 0.5, color="grey", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)
        if heldout or any(r.get("resumed") for r in self.records):
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("loss (token mean)")
        ax.set_title(self.title, fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)


def _finite(value):
    """``value`` with every non-finite float (also inside lists and dicts) as ``None``: JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json_line(record: dict) -> str:
    return json.dumps(_finite(record), allow_nan=False) + "\n"
