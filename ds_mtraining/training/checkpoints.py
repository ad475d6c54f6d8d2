"""The run's checkpoints: ``engine.save_checkpoint`` into ``<tag>.partial``, then (after every rank is done) a rename
to ``<tag>`` and an atomic replace of ``latest``: an interrupted save leaves the last good checkpoint and ``latest``
untouched. Each tag carries a ``manifest.json`` (files, sizes, SHA-256, the run's settings; :mod:`.manifest`):
:meth:`Checkpoints.check` verifies it, and the settings a resume must keep, before DeepSpeed reads anything.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import manifest
from .manifest import RunSettings

__all__ = ["CheckpointError", "Checkpoints", "LatestTagError"]


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be resumed from; the message says which file and why."""


_LATEST = "latest"
_PARTIAL = ".partial"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
"""What ``latest`` may hold: the name of a folder next to it (no ``/``, no leading dot)."""


class LatestTagError(CheckpointError, ValueError):
    """``latest`` does not hold a tag name (also a ``ValueError`` for callers that catch those, launch/export.py)."""


def _step_of(tag: str) -> int | None:
    match = re.fullmatch(r"step(\d+)", tag)
    return int(match[1]) if match else None


class Checkpoints:
    """Crash-safe, verified DeepSpeed checkpoints in ``directory``: ``step<N>/`` tags, each with a ``manifest.json``
    (:mod:`ds_mtraining.training.manifest`), and a ``latest`` file naming one.

    Args:
        directory: the ``checkpoints/`` folder.
        run: this run's settings, recorded in every manifest saved and compared on resume; ``None`` records none
            and compares none (files are still verified).
    """

    def __init__(self, directory: str | os.PathLike[str], run: RunSettings | None = None):
        self.directory = Path(directory)
        self.run = run
        self.notes: list[str] = []
        """After :meth:`check`: one ``note: ...`` line per note setting that changed since the save."""
        self._verified: str | None = None

    def tags(self) -> list[str]:
        """The tags present (finished saves: no ``.partial`` / ``.old`` leftovers), oldest first."""
        if not self.directory.is_dir():
            return []
        names = [
            p.name
            for p in self.directory.iterdir()
            if p.is_dir() and not p.name.endswith((_PARTIAL, ".old")) and _TAG.fullmatch(p.name)
        ]
        return sorted(names, key=lambda n: (_step_of(n) is None, _step_of(n) or 0, n))

    def latest_tag(self) -> str | None:
        """The tag ``latest`` names, ``None`` without a ``latest`` file; raises :class:`LatestTagError` when the
        file holds anything but a tag name (binary data, a path, nothing)."""
        latest = self.directory / _LATEST
        if not latest.is_file():
            return None
        data = latest.read_bytes()
        try:
            text = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            text = None
        if text and _TAG.fullmatch(text):
            return text
        if text is None or any(not c.isprintable() for c in text):
            what = f"{len(data)} bytes of binary data"
        elif not text:
            what = "nothing"
        else:
            what = f"{text[:80]!r} (a tag is the name of a folder next to it, without '/')"
        raise LatestTagError(f"{latest} holds {what}, not a checkpoint tag; {self._fix(None)}")

    def _fix(self, tag: str | None) -> str:
        """How to resume anyway: point ``latest`` at another tag present (the newest before ``tag``), or start over."""
        latest, present = self.directory / _LATEST, self.tags()
        others = [t for t in present if t != tag]
        if not others:
            return "no other checkpoint tag is present: train without --resume (into another --output-dir)"
        step = _step_of(tag) if tag else None
        earlier = [t for t in others if step is None or (_step_of(t) is not None and _step_of(t) < step)]
        choice = (earlier or others)[-1]
        which = "the previous tag" if tag and earlier else "a tag present, e.g."
        return (
            f"point {latest} at {which} {choice} (echo {choice} > {latest}; tags present: {', '.join(present)}), "
            "or train without --resume"
        )

    def check(self) -> str:
        """The tag ``latest`` names, after verifying it against its manifest (every file, size and SHA-256, no
        foreign state file) and this run's settings; sets :attr:`notes`. Reads only; raises
        :class:`CheckpointError` with one line naming the file and the fix."""
        where = self.directory
        if not where.is_dir():
            raise CheckpointError(f"checkpoint directory {where} not found; train without --resume first")
        tag = self.latest_tag()
        if tag is None:
            raise CheckpointError(f"{where} has no '{_LATEST}' file; it is not a checkpoint directory of this job")
        folder = where / tag
        if not folder.is_dir():
            raise CheckpointError(
                f"{where / _LATEST} names checkpoint {tag!r}, but {folder} does not exist; {self._fix(tag)}"
            )
        try:
            recorded = manifest.read_manifest(folder)
            step = _step_of(tag)
            if step is not None and recorded["step"] != step:
                raise manifest.ManifestError(
                    f"{folder / manifest.MANIFEST} is for step {recorded['step']}, not {step} (a renamed tag)"
                )
            manifest.verify_files(folder, recorded)  # the bytes are the ones saved: no unpickling needed to trust them
            self.notes = manifest.compare_run(recorded, self.run, str(folder)) if self.run is not None else []
        except manifest.SettingsMismatch as e:
            raise CheckpointError(str(e)) from None
        except manifest.ManifestError as e:
            raise CheckpointError(f"{e}; {self._fix(tag)}") from None
        self._verified = tag
        return tag

    def save(self, engine, step: int, client_state: dict[str, Any]) -> str:
        """Save ``engine`` at ``step`` (collective); returns the tag. Rank 0 writes the manifest into the partial
        folder once every rank's files are there, then renames it into place and points ``latest`` at it."""
        tag = f"step{step}"
        partial = tag + _PARTIAL
        if engine.global_rank == 0:
            shutil.rmtree(self.directory / partial, ignore_errors=True)  # left over by an interrupted save
        dist.barrier()
        engine.save_checkpoint(str(self.directory), tag=partial, client_state=client_state, save_latest=False)
        dist.barrier()
        if engine.global_rank == 0:
            manifest.write_manifest(
                self.directory / partial, tag=tag, step=step, run=self.run if self.run is not None else RunSettings()
            )
            final, old = self.directory / tag, self.directory / (tag + ".old")
            if final.exists():
                final.rename(old)
            (self.directory / partial).rename(final)
            shutil.rmtree(old, ignore_errors=True)
            tmp = self.directory / (_LATEST + ".tmp")
            tmp.write_text(tag)
            os.replace(tmp, self.directory / _LATEST)
        dist.barrier()
        return tag

    def load(self, engine) -> dict[str, Any]:
        """Load ``latest`` into ``engine`` (collective); returns the client state saved with it. The files are
        verified first (once per process: a :meth:`check` before is not repeated for the same tag)."""
        tag = self._verified if self._verified is not None and self._verified == self.latest_tag() else self.check()
        path, client_state = engine.load_checkpoint(str(self.directory), tag=tag)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {self.directory / tag}")
        return client_state
