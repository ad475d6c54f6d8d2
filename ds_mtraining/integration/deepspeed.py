"""DeepSpeed plumbing: config -> mesh -> engine, and crash-safe checkpoints.

- :func:`load_config`: the DeepSpeed JSON and its validated ``"mtraining"`` section, errors as one line.
- :func:`resolve_precision`: bf16 on where the hardware has it, off elsewhere (the dict is changed before
  ``deepspeed.initialize``; the returned note says what was decided and why).
- :class:`MeshMPU`: the mesh seen through DeepSpeed's ``mpu`` interface. DeepSpeed (0.19) partitions ZeRO state
  and all-reduces gradients over ``get_sequence_data_parallel_group()`` (DP x SP ranks) and divides by
  ``|DP x SP| / SP`` = DP: gradients are *summed* over the sequence-parallel ranks and averaged over data
  parallelism — right for our loss, whose per-rank parts sum to the sequence mean (``integration/batch.py``).
  The model-parallel group is each rank alone.
- :class:`Checkpoints`: ``engine.save_checkpoint`` into ``<tag>.partial``, then (after every rank is done)
  a rename to ``<tag>`` and an atomic replace of ``latest``: an interrupted save leaves the last good checkpoint
  and ``latest`` untouched. :meth:`Checkpoints.load` checks the files before DeepSpeed reads them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError, MTrainingConfig
from ..parallel.mesh import Mesh

__all__ = ["CheckpointError", "Checkpoints", "MeshMPU", "load_config", "resolve_precision"]


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be resumed from; the message says which file and why."""


def load_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], MTrainingConfig]:
    """The DeepSpeed config dict of ``path`` and its ``"mtraining"`` section.

    Raises:
        FileNotFoundError: no such file. ConfigError: bad JSON or an invalid section.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"DeepSpeed config {path} not found; pass an existing JSON, e.g. ds_configs/zero2_offload.json"
        )
    try:
        ds_config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    return ds_config, MTrainingConfig.from_deepspeed_config(path)


def resolve_precision(ds_config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``ds_config`` with bf16 enabled iff this machine's accelerator supports it, and a note for the start-up print."""
    supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    requested = bool(ds_config.get("bf16", {}).get("enabled", False))
    config = ds_config | {"bf16": ds_config.get("bf16", {}) | {"enabled": supported}}
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    note = f"bf16 {'on' if supported else 'off'} ({where} {'supports' if supported else 'has no'} bf16; config said {requested})"
    return config, note


class MeshMPU:
    """DeepSpeed's ``mpu`` protocol over a :class:`Mesh` (see the module docstring for how gradients reduce)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def get_data_parallel_group(self):
        return self.mesh.dp

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.shape.dp

    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp_index

    def get_data_parallel_group_ranks(self) -> list[int]:
        sp = self.mesh.shape.sp
        return list(range(self.mesh.rank % sp, self.mesh.shape.world, sp))

    def get_sequence_parallel_group(self):
        return self.mesh.sp

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.shape.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.rank % self.mesh.shape.sp

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.shape.world

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.rank

    def get_model_parallel_group(self):
        return self.mesh.model

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


_LATEST = "latest"
_PARTIAL = ".partial"


class Checkpoints:
    """Crash-safe DeepSpeed checkpoints in ``directory``: ``step<N>/`` tags and a ``latest`` file naming one."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)

    def latest_tag(self) -> str | None:
        latest = self.directory / _LATEST
        return latest.read_text().strip() if latest.is_file() else None

    def check(self) -> str:
        """The tag ``latest`` names, after checking that its files are there; raises :class:`CheckpointError`."""
        where = self.directory
        if not where.is_dir():
            raise CheckpointError(f"checkpoint directory {where} not found; train without --resume first")
        tag = self.latest_tag()
        if tag is None:
            raise CheckpointError(f"{where} has no '{_LATEST}' file; it is not a checkpoint directory of this job")
        folder = where / tag
        if not tag or "/" in tag or not folder.is_dir():
            raise CheckpointError(f"{where / _LATEST} names checkpoint {tag!r}, but {folder} does not exist")
        models = sorted(folder.glob("*model_states.pt"))
        optims = sorted(folder.glob("*optim_states.pt"))
        if not models or not optims:
            raise CheckpointError(f"checkpoint {folder} is incomplete (no model or optimizer state files)")
        for file in (*models, *optims):
            try:
                torch.load(file, map_location="cpu", weights_only=False, mmap=True)
            except Exception as e:  # noqa: BLE001  (any unreadable file is the same user-facing problem)
                raise CheckpointError(
                    f"checkpoint file {file} is unreadable ({type(e).__name__}); it is corrupt"
                ) from None
        return tag

    def save(self, engine, step: int, client_state: dict[str, Any]) -> str:
        """Save ``engine`` at ``step`` (collective); returns the tag."""
        tag = f"step{step}"
        partial = tag + _PARTIAL
        if engine.global_rank == 0:
            shutil.rmtree(self.directory / partial, ignore_errors=True)  # left over by an interrupted save
        dist.barrier()
        engine.save_checkpoint(str(self.directory), tag=partial, client_state=client_state, save_latest=False)
        dist.barrier()
        if engine.global_rank == 0:
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
        """Load ``latest`` into ``engine`` (collective); returns the client state saved with it."""
        tag = self.check()
        path, client_state = engine.load_checkpoint(str(self.directory), tag=tag)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {self.directory / tag}")
        return client_state
