"""DeepSpeed plumbing: config -> mesh -> engine, and crash-safe checkpoints.

- :func:`load_config`: the DeepSpeed JSON and its validated ``"mtraining"`` section, errors as one line.
- :func:`resolve_precision`, :func:`resolve_schedule`: the config's ``"auto"`` values decided for this machine and
  this run (the dict is changed before ``deepspeed.initialize``; the returned notes say what was decided and why).
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

__all__ = ["CheckpointError", "Checkpoints", "MeshMPU", "load_config", "resolve_precision", "resolve_schedule"]


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
    """``ds_config`` with ``bf16.enabled`` decided, and a note for the start-up print.

    ``true`` and ``false`` are kept as written (``true`` on a GPU without bf16 is a :class:`ConfigError`);
    ``"auto"`` turns bf16 on exactly where a CUDA device supports it. Without a ``bf16`` section the run is fp32, as
    in DeepSpeed.
    """
    cuda = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if cuda else "CPU"
    supported = cuda and torch.cuda.is_bf16_supported()
    requested = ds_config.get("bf16", {}).get("enabled", False)
    if requested == "auto":
        enabled = supported
        note = f'bf16 {"on" if supported else "off"} ("auto": {where} {"supports" if supported else "has no"} bf16)'
    elif isinstance(requested, bool):
        if requested and cuda and not supported:
            raise ConfigError(f'bf16.enabled is true, but {where} has no bf16; set it to "auto" or false')
        enabled = requested
        note = "bf16 on (config)" if requested else 'fp32 (bf16 off in the config; "auto" uses it where the GPU has it)'
    else:
        raise ConfigError(f'bf16.enabled must be true, false or "auto"; got {requested!r}')
    if ds_config.get("fp16", {}).get("enabled") is True:
        note = "fp16 (config)"
    return ds_config | {"bf16": ds_config.get("bf16", {}) | {"enabled": enabled}}, note


_WARMUP_SHARE = 0.1
"""``"warmup_num_steps": "auto"``: this share of the run's steps (at least DeepSpeed's minimum of 2)."""


def resolve_schedule(ds_config: dict[str, Any], steps: int) -> tuple[dict[str, Any], str]:
    """``ds_config`` with the scheduler's ``"auto"`` step counts filled in for a run of ``steps`` optimizer steps,
    checked against it, and a note for the start-up print.

    ``total_num_steps: "auto"`` becomes ``steps``; ``warmup_num_steps: "auto"`` 10 % of them (at least 2). A total
    below ``steps`` (the learning rate would sit at its floor for the rest of the run) or a warm-up that does not end
    before the total is a :class:`ConfigError` naming the fix.
    """
    scheduler = ds_config.get("scheduler")
    if scheduler is None:
        return ds_config, "constant learning rate (no scheduler)"
    params = dict(scheduler.get("params", {}))
    if params.get("warmup_num_steps") == "auto":
        params["warmup_num_steps"] = max(2, round(_WARMUP_SHARE * steps))
    if params.get("total_num_steps") == "auto":
        # A run shorter than DeepSpeed's shortest warm-up (2 steps) gets a total just past it: all warm-up.
        params["total_num_steps"] = max(steps, params.get("warmup_num_steps", 0) + 1)
    auto = [k for k, v in params.items() if v == "auto"]
    if auto:
        raise ConfigError(
            f'scheduler.params.{auto[0]} is "auto"; only total_num_steps and warmup_num_steps can be, set a value'
        )
    total, warmup = params.get("total_num_steps"), params.get("warmup_num_steps")
    if total is not None and total < steps:
        raise ConfigError(
            f"scheduler.params.total_num_steps={total} < --steps {steps}: the learning rate would stay at its floor "
            f'after step {total}; set it to at least {steps}, or "auto"'
        )
    if total is not None and warmup is not None and warmup >= total:
        raise ConfigError(
            f'scheduler.params.warmup_num_steps={warmup} >= total_num_steps={total}; lower it, or set "auto"'
        )
    note = f"{scheduler.get('type', '?')}" + (f" warm-up {warmup}" if warmup is not None else "")
    note += f" of {total} steps" if total is not None else " steps"
    return ds_config | {"scheduler": scheduler | {"params": params}}, note


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
