"""DeepSpeed plumbing: config -> mesh -> engine.

- :func:`deepspeed_config`: a DeepSpeed JSON with our ``"mtraining"`` section -> what ``deepspeed.initialize`` takes,
  in one call (also ``ds_mtraining.deepspeed_config``). It is these steps:
- :func:`load_config`: the DeepSpeed JSON and its validated ``"mtraining"`` section, errors as one line.
- :func:`resolve_precision`, :func:`resolve_schedule`: the config's ``"auto"`` values decided for this machine and
  this run (the dict is changed before ``deepspeed.initialize``; the returned notes say what was decided and why).
- :class:`MeshMPU`: the mesh seen through DeepSpeed's ``mpu`` interface. Every ZeRO stage partitions over the DP x SP
  ranks (ZeRO-1/2 through ``get_sequence_data_parallel_group()``, ZeRO-3 through ``get_data_parallel_group()``,
  which is therefore the world) and divides the reduced gradients by ``|DP x SP| / SP`` = DP: gradients are
  *summed* over the sequence-parallel ranks and averaged over data parallelism — right for our loss, whose
  per-rank parts sum to the sequence mean (``integration/batch.py``). ZeRO-3's reduce-scatter path averages over
  all DP x SP ranks instead; ``integration/loss.py`` scales the loss's gradient by SP there. The model-parallel
  group is each rank alone.

Crash-safe checkpoints of the run are ``ds_mtraining.training.checkpoints``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..config import ConfigError, MTrainingConfig
from ..parallel.mesh import Mesh

__all__ = [
    "DeepSpeedConfig",
    "MeshMPU",
    "SP_GRADIENT_SCALE",
    "check_sequence_parallel_gradients",
    "compute_dtype",
    "deepspeed_config",
    "load_config",
    "normalize_cuda_arch_list",
    "ops_to_build",
    "optimizer_offloaded",
    "release_cpu_allreduce_buffer",
    "resolve_precision",
    "resolve_schedule",
    "sum_sequence_parallel_gradients",
]


def normalize_cuda_arch_list() -> str | None:
    """Rewrite ``TORCH_CUDA_ARCH_LIST``'s arch-specific entries (``9.0a``, ``10.0f``) as DeepSpeed's JIT builder
    reads them (``9.0``); returns the new value, or ``None`` when nothing changed.

    DeepSpeed 0.19.8 parses each entry as ``major.minor[+PTX]`` (``op_builder/builder.py``, ``int(minor)``) and its
    FusedAdam build, which a config without CPU offload needs, fails on the ``9.0a`` that Hopper images set. Its
    kernels use no arch-specific instructions, so the plain arch builds the same code.
    """
    import re

    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    fixed = re.sub(r"(\d+\.\d+)[af](?=\+PTX|[\s;]|$)", r"\1", value)
    if fixed == value:
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    return fixed


def release_cpu_allreduce_buffer() -> None:
    """Unlink this rank's shared-memory all-reduce workspace of DeepSpeed's CPU backend, if it made one.

    DeepSpeed's CPU communication op (``ops/csrc/cpu/comm/shm.cpp``) creates
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`` (about 67 MB) per rank and
    never unlinks it, so every CPU run leaves its ranks' buffers in RAM until the machine restarts (244 of them had
    filled 16 GB of a 24 GB machine and got a test run killed). Call it once the process's collectives are over:
    the other ranks mapped the workspace at start-up, and a mapping outlives the name.
    """
    if torch.cuda.is_available():
        return
    name = "_".join(
        ["deepspeed_allreduce_buffer", str(os.getuid()), os.environ.get("MASTER_ADDR", ""),
         os.environ.get("MASTER_PORT", ""), os.environ.get("RANK", "0")]
    )  # fmt: skip
    Path("/dev/shm", name).unlink(missing_ok=True)


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



def compute_dtype(ds_config: Mapping[str, Any]) -> torch.dtype:
    """The dtype a run computes in, from its config with ``bf16.enabled`` decided (:func:`resolve_precision`):
    bf16 or fp16 where enabled (``true``; an undecided ``"auto"`` is not), else fp32."""
    if ds_config.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    return torch.float16 if ds_config.get("fp16", {}).get("enabled") is True else torch.float32

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


class DeepSpeedConfig(NamedTuple):
    """A DeepSpeed JSON made ready for a run (:func:`deepspeed_config`).

    Attributes:
        ds_config: the dict for ``deepspeed.initialize(config=...)``, every ``"auto"`` decided; it keeps the
            ``"mtraining"`` section, which DeepSpeed ignores.
        mtraining: that section, validated (sparse attention, parallel degrees, ...).
        notes: what each ``"auto"`` became and why, one line each (precision, schedule).
    """

    ds_config: dict[str, Any]
    mtraining: MTrainingConfig
    notes: list[str]


def deepspeed_config(path: str | os.PathLike[str], steps: int) -> DeepSpeedConfig:
    """The DeepSpeed JSON at ``path`` (e.g. a shipped ``ds_configs/*.json``) for a run of ``steps`` optimizer steps:
    ``(ds_config, mtraining, notes)``, what the training job starts its engine from.

    Its ``"auto"`` values become (:func:`resolve_precision`, :func:`resolve_schedule`):

    - ``"bf16": {"enabled": "auto"}``: ``true`` exactly where a CUDA device supports bf16 (``false`` on the CPU);
      ``true`` / ``false`` are kept as written;
    - ``"scheduler": {"params": {"total_num_steps": "auto"}}``: ``steps``;
    - ``"warmup_num_steps": "auto"``: 10 % of ``steps``, at least 2 (DeepSpeed's minimum).

    Checked first, each problem one line: the JSON, our ``"mtraining"`` section (:func:`load_config`), every key the
    engine reads (:func:`~ds_mtraining.integration.ds_config.check_ds_config`: a misspelled top-level key DeepSpeed
    would ignore), and the schedule against ``steps`` (a total below it is refused).

    Raises:
        FileNotFoundError: no such file. ConfigError: an invalid value, named with its fix. ValueError: ``steps``
        not a positive integer.
    """
    from .ds_config import check_ds_config, cpu_checkpointing

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number of optimizer steps >= 1; got {steps!r}")
    ds_config, mtraining = load_config(path)
    check_ds_config(ds_config, str(path))
    if cpu_checkpointing(ds_config) and mtraining.activation_checkpointing.every is None:
        raise ConfigError(
            f"DeepSpeed config {path}: activation_checkpointing.cpu_checkpointing is true but "
            'mtraining.activation_checkpointing.layers is "none": no layer keeps a checkpoint to move; set '
            'cpu_checkpointing false, or checkpoint layers ("all" or every k-th)'
        )
    ds_config, precision = resolve_precision(ds_config)
    ds_config, schedule = resolve_schedule(ds_config, steps)
    return DeepSpeedConfig(ds_config, mtraining, [precision, schedule])


SP_GRADIENT_SCALE = "ds_mtraining_sp_gradient_scale"
"""The attribute :func:`sum_sequence_parallel_gradients` sets on each parameter: the factor its gradient gets."""


def sum_sequence_parallel_gradients(engine) -> int:
    """Make ``engine``'s gradient reduction *sum* the sequence-parallel ranks' gradients (their losses are parts of
    one sequence's mean) and average the data-parallel ones, under every ZeRO stage and whatever loss the backward
    starts from; returns the factor each parameter's gradient is multiplied by before DeepSpeed reduces it (1 where
    DeepSpeed already does so). Call it once after ``deepspeed.initialize``; a repeated call changes nothing.

    DeepSpeed 0.19.8 does so in ZeRO-1/2 (``stage_1_and_2.py:1506-1508``, ``:2380``: divided by ``|DP x SP| / SP``)
    and in ZeRO-3's all-reduce path (``stage3.py:1877-1878``), but ZeRO-3's reduce-scatter path, taken with
    ``reduce_scatter: true`` (the default), without ``contiguous_gradients`` or for a bucket over
    ``reduce_bucket_size`` (``stage3.py:1673-1678``), averages over all DP x SP ranks (``reduce_scatter_coalesced``
    divides by the group size, ``runtime/comm/coalesced_collectives.py:124``; ``stage3.py:1913-1942`` has no SP
    factor): there the gradient is scaled by SP, the loss's value is left alone. A configuration that mixes both
    paths (``reduce_scatter: false`` with a parameter larger than ``reduce_bucket_size``) cannot be corrected by
    one factor and is refused.

    The factor is applied by a hook on each parameter's gradient (before ZeRO-3's own hook reduces it), so a loss
    computed any way (``forward_loss``, ``sequence_loss`` on full logits, one's own) is corrected alike. Under
    ZeRO-3 with sequence parallelism our attention refuses to run a training forward until this was called
    (:func:`check_sequence_parallel_gradients`): the error would otherwise be silent (every gradient 1/SP of its
    value, the loss right).
    """
    scale = _sp_gradient_scale(engine)
    for param in engine.module.parameters():
        done = getattr(param, SP_GRADIENT_SCALE, None)
        if done is None:
            if scale != 1 and param.requires_grad:
                param.register_hook(lambda grad, scale=scale: grad * scale)
            setattr(param, SP_GRADIENT_SCALE, scale)
        elif done != scale:
            raise ValueError(f"the parameters' gradients are already scaled by {done}, not {scale}: another engine?")
    return scale


def check_sequence_parallel_gradients(param: torch.nn.Parameter) -> None:
    """Raise ``ConfigError`` when ``param`` is a ZeRO-3 parameter (``ds_id``) of an engine whose sequence-parallel
    gradients were not set up by :func:`sum_sequence_parallel_gradients`; called by the attention of a sharded
    training forward."""
    if hasattr(param, "ds_id") and getattr(param, SP_GRADIENT_SCALE, None) is None:
        raise ConfigError(
            "ZeRO-3 with sequence parallelism: DeepSpeed's reduce-scatter averages the sequence ranks' gradients where "
            "they must be summed; call ds_mtraining.integration.deepspeed.sum_sequence_parallel_gradients(engine) "
            "once after deepspeed.initialize (the training job does)"
        )


def _sp_gradient_scale(engine) -> int:
    """The factor of :func:`sum_sequence_parallel_gradients` for ``engine``."""
    optimizer = getattr(engine, "optimizer", None)
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    sp = getattr(optimizer, "sequence_parallel_size", 1)
    if stage != 3 or sp == 1:
        return 1
    if optimizer.reduce_scatter or not optimizer.contiguous_gradients:
        return sp
    largest = max(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    if largest > optimizer.reduce_bucket_size:
        raise ValueError(
            f'ZeRO-3 with sequence parallelism and "reduce_scatter": false reduces a parameter of {largest} elements '
            f"(over reduce_bucket_size={optimizer.reduce_bucket_size}) with another scaling than the others; set "
            f'"reduce_scatter": true (the default) or reduce_bucket_size >= {largest}'
        )
    return 1


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """``ds_config``'s ZeRO stage (``zero_optimization.stage``; 0 without the section)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def optimizer_offloaded(ds_config: dict[str, Any]) -> bool:
    """Whether ``ds_config`` keeps the optimizer state on the host (``zero_optimization.offload_optimizer.device``
    other than ``"none"``)."""
    return ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"


def ops_to_build(ds_config: dict[str, Any]) -> list[str]:
    """The DeepSpeed ops a run of ``ds_config`` will JIT-compile on this machine before its first step (minutes on a
    few cores, with no output of DeepSpeed's own): the CPU communication op on the CPU, CPU Adam with optimizer
    offload, FusedAdam for Adam(W) on the GPU; those installed prebuilt or in torch's extension cache are left out."""
    import importlib

    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory  # torch's own cache path (public: only its root)

    offload = optimizer_offloaded(ds_config)
    optimizer = ds_config.get("optimizer", {})
    adam = str(optimizer.get("type", "")).lower() in ("adam", "adamw") and not optimizer.get("params", {}).get(
        "torch_adam", False
    )
    wanted = ["CPUAdamBuilder"] if offload else ["FusedAdamBuilder"] if adam and torch.cuda.is_available() else []
    if not torch.cuda.is_available():
        wanted.insert(0, "ShareMemCommBuilder")
    names = []
    for name in wanted:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            continue
        try:
            importlib.import_module(builder.absolute_name())  # installed prebuilt (DS_BUILD_OPS=1)
            continue
        except ImportError:
            pass
        if not any(Path(_get_build_directory(builder.name, verbose=False)).glob("*.so")):
            names.append(builder.name)
    return names


class MeshMPU:
    """DeepSpeed's ``mpu`` protocol over a :class:`Mesh` (see the module docstring for how gradients reduce).

    ``get_data_parallel_group`` is the group ZeRO partitions over, so it is every DP x SP rank (the world), not the
    ranks of this rank's sequence position (``mesh.dp``): ZeRO-3 partitions a model not built under
    ``zero.Init`` over ``mpu.get_data_parallel_group()`` (DeepSpeed 0.19.8
    ``runtime/zero/parameter_offload.py:268``), and reduce-scatters each gradient over the group its parameter is
    partitioned over (``stage3.py:644``, ``:1643``), dividing by that group's size / SP (``stage3.py:1877-1878``).
    Over ``mesh.dp`` the sequence-parallel ranks' gradients were never summed (each rank kept SP x its own part and
    the replicas drifted apart); over DP x SP they are summed over SP and averaged over DP, as ZeRO-1/2 do (which
    take ``get_sequence_data_parallel_group`` directly, ``engine.py:2626``, ``:2683``). ALST's ``mpu``
    (``runtime/sequence_parallel/parallel_state_sp.py``) has no ``get_data_parallel_group`` for the same reason:
    DeepSpeed then partitions over the world group. Elsewhere (0.19.8, no MoE, no pipeline) the group only picks
    which rank writes the ZeRO-1/2 model file (data-parallel rank 0: now global rank 0 alone, not every SP rank of
    DP index 0 onto the same file, ``engine.py:5292``) and the fp16 overflow check (a max: any group covering the
    DP ranks is right).

    The data-parallel *size*, *rank* and peer ranks stay those of the data (``mesh.dp``): DeepSpeed's batch
    arithmetic takes ``get_data_parallel_world_size()`` as the number of distinct micro-batches per step
    (``runtime/config.py:463``, ``train_batch_size = micro x accumulation x DP``), and SP ranks share one.
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def get_data_parallel_group(self):
        return dist.group.WORLD  # the ZeRO partition group, DP x SP (see above); the mesh covers the world

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
