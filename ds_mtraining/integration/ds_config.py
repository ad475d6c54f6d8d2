"""The DeepSpeed part of the JSON config, checked before the engine starts.

``deepspeed.initialize`` validates its config only when it builds the engine (after the process group exists, with
an assert or a pydantic traceback naming no file), and some values it never checks at all (a micro-batch of
``"one"`` reaches ``int()``; an unknown optimizer name reaches ``getattr(torch.optim, name)``). :func:`check_ds_config`
checks at start-up what this job's engine reads, each problem as a :class:`~ds_mtraining.config.ConfigError` of one
line ``DeepSpeed config FILE: KEY: what is wrong; the fix``:

- every top-level key: one DeepSpeed reads (:func:`deepspeed_keys`) or ``"mtraining"``; DeepSpeed itself ignores the
  others, so a misspelled ``"zero_optimisation"`` would train as ZeRO-0 without a word;
- ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``: integers >= 1;
- ``gradient_clipping``: a finite number >= 0 (0 turns clipping off);
- ``zero_optimization``: ``stage`` in 0..3, the rest through DeepSpeed's own model
  (``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``: unknown keys, wrong types, offload devices);
- ``optimizer.type``: one DeepSpeed builds (``deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS``, any case) or a
  ``torch.optim`` optimizer class (exact name, DeepSpeed's fallback); ``optimizer.params`` an object without
  ``max_grad_norm`` (DeepSpeed refuses it: clipping is ``gradient_clipping``);
- ``scheduler.type``: one of DeepSpeed's schedules (``deepspeed.runtime.lr_schedules``) or a
  ``torch.optim.lr_scheduler`` class;
- ``activation_checkpointing``: ``cpu_checkpointing`` is honoured (:func:`cpu_checkpointing`); the keys of DeepSpeed's
  own checkpoint function (partitioning over model-parallel ranks, its contiguous buffer, its boundary sync and
  profile) are refused when set, as the job checkpoints through ``torch.utils.checkpoint`` (``integration.recompute``).

``"auto"`` stays legal where this job resolves it later: ``bf16.enabled``
(:func:`~ds_mtraining.integration.deepspeed.resolve_precision`) and the scheduler's ``warmup_num_steps`` /
``total_num_steps`` (:func:`~ds_mtraining.integration.deepspeed.resolve_schedule`); anywhere else DeepSpeed would
refuse it, so it is refused here.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

from ..config import ConfigError

__all__ = ["check_ds_config", "cpu_checkpointing", "deepspeed_keys", "deepspeed_optimizers"]

_DOCS = "https://www.deepspeed.ai/docs/config-json/"
_SECTIONS = ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16")
"""Sections DeepSpeed reads as objects (a number or a list there is an AttributeError deep inside it)."""
_COUNTS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
_KEY_MODULES = (
    "deepspeed.runtime.constants",
    "deepspeed.runtime.activation_checkpointing.config",
    "deepspeed.profiling.constants",
    "deepspeed.runtime.swap_tensor.constants",
    "deepspeed.autotuning.constants",
)
"""Modules whose upper-case string constants name config keys: sections the engine parses outside
``DeepSpeedConfig`` (activation checkpointing, the flops profiler, asynchronous I/O, autotuning)."""


def _fail(source: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"DeepSpeed config {source}: {key}: {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def deepspeed_optimizers() -> list[str]:
    """The ``optimizer.type`` names DeepSpeed builds itself (it lower-cases the name before comparing)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return list(DEEPSPEED_OPTIMIZERS)


@functools.cache
def deepspeed_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed 0.19 reads: those its config object (``DeepSpeedConfig``) looks up while it parses
    a minimal config, and the key constants of the sections its engine parses elsewhere (activation checkpointing,
    the flops profiler, asynchronous I/O, autotuning)."""
    import importlib

    from deepspeed.runtime.config import DeepSpeedConfig

    looked_up: set[str] = set()

    class Recording(dict):
        """A dict that notes every key it is asked for (DeepSpeed uses ``in``, ``[]`` and ``get``)."""

        def __getitem__(self, key):
            looked_up.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            looked_up.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            looked_up.add(key)
            return super().__contains__(key)

    DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    for name in _KEY_MODULES:
        module = importlib.import_module(name)
        looked_up.update(v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.islower())
    return frozenset(k for k in looked_up if isinstance(k, str))


def check_ds_config(ds_config: Mapping[str, Any], source: str | os.PathLike[str] = "<dict>") -> None:
    """Check what the engine reads from ``ds_config`` (see the module docstring); raise :class:`ConfigError`."""
    source = os.fspath(source)
    if not isinstance(ds_config, Mapping):
        raise ConfigError(f"DeepSpeed config {source}: must be a JSON object, got {type(ds_config).__name__}")
    known = deepspeed_keys() | {"mtraining"}
    for key in ds_config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}?" if close else f"remove it (the keys DeepSpeed knows: {_DOCS})"
            raise _fail(source, key, f"not a key DeepSpeed knows (it would ignore it); {fix}")
    for key in _COUNTS:
        if key in ds_config:
            value = ds_config[key]
            if not _is_int(value) or value < 1:
                raise _fail(source, key, f"must be an integer >= 1, got {value!r}; set e.g. 1")
    if "gradient_clipping" in ds_config:
        value = ds_config["gradient_clipping"]
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise _fail(
                source, "gradient_clipping", f"must be a finite number >= 0 (0: no clipping), got {value!r}; e.g. 1.0"
            )
    for key in _SECTIONS:
        if key in ds_config and not isinstance(ds_config[key], Mapping):
            raise _fail(source, key, f"must be an object, got {ds_config[key]!r}; see {_DOCS}")
    if "zero_optimization" in ds_config:
        _check_zero(ds_config["zero_optimization"], source)
    if "optimizer" in ds_config:
        _check_optimizer(ds_config["optimizer"], source)
    if "scheduler" in ds_config:
        _check_scheduler(ds_config["scheduler"], source)
    if "activation_checkpointing" in ds_config:
        _check_activation_checkpointing(ds_config["activation_checkpointing"], source)


_CHECKPOINTING_REFUSED = {
    "partition_activations": "splits each checkpoint over the model-parallel (tensor-parallel) ranks, and this job has "
    "none; remove it, and to free GPU memory set cpu_checkpointing",
    "contiguous_memory_optimization": "packs partitioned checkpoints into one buffer (with partition_activations, "
    "for DeepSpeed's own checkpoint function, which this job does not use); remove it",
    "number_checkpoints": "sizes that buffer (contiguous_memory_optimization); remove it, and choose the checkpointed "
    'layers with "mtraining": {"activation_checkpointing": {"layers": ...}}',
    "synchronize_checkpoint_boundary": "synchronizes the GPU at each checkpoint of DeepSpeed's own checkpoint "
    "function, which this job does not use; remove it",
    "profile": "times DeepSpeed's own checkpoint function, which this job does not use; remove it (the job logs its "
    "step times)",
}
"""DeepSpeed's activation-checkpointing keys that cannot apply to this job, and why: each refused when set."""


def _check_activation_checkpointing(section: Any, source: str) -> None:
    """DeepSpeed's ``"activation_checkpointing"`` section: ``cpu_checkpointing`` is honoured (the job's per-layer
    checkpoints go to CPU memory, ``checkpoint_offload``); a key that would ask for more is refused in one line."""
    if not isinstance(section, Mapping):
        example = '{"cpu_checkpointing": true}'
        raise _fail(source, "activation_checkpointing", f"must be an object, got {section!r}; e.g. {example}")
    known = ("cpu_checkpointing", *_CHECKPOINTING_REFUSED)
    for key, value in section.items():
        name = f"activation_checkpointing.{key}"
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}?" if close else f"the keys: {', '.join(known)}"
            raise _fail(source, name, f"not a key DeepSpeed knows (it would ignore it); {fix}")
        if key == "number_checkpoints":
            if value is not None:
                raise _fail(source, name, f"is {value!r}: it {_CHECKPOINTING_REFUSED[key]}")
        elif not isinstance(value, bool):
            raise _fail(source, name, f"must be true or false, got {value!r}")
        elif value and key != "cpu_checkpointing":
            raise _fail(source, name, f"is true: it {_CHECKPOINTING_REFUSED[key]}")


def cpu_checkpointing(ds_config: Mapping[str, Any]) -> bool:
    """Whether the DeepSpeed config asks for the activation checkpoints in CPU memory (checked by
    :func:`check_ds_config`)."""
    return bool(ds_config.get("activation_checkpointing", {}).get("cpu_checkpointing", False))


def _check_zero(zero: Mapping[str, Any], source: str) -> None:
    stage = zero.get("stage", 0)
    if not _is_int(stage) or not 0 <= stage <= 3:
        raise _fail(
            source,
            "zero_optimization.stage",
            f'must be 0, 1, 2 or 3, got {stage!r}; use 2, or 3 to partition the weights too (with '
            '"offload_optimizer": {"device": "cpu"} the optimizer state stays on the CPU)',
        )
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            key = ".".join(["zero_optimization", *map(str, err["loc"])])
            if err["type"] == "extra_forbidden":
                problems.append(f"{key}: unknown key; remove it (the keys DeepSpeed knows: {_DOCS})")
            else:
                problems.append(f"{key}: {err['msg']}, got {err['input']!r}; fix the value")
        raise ConfigError(f"DeepSpeed config {source}: " + "; ".join(problems)) from None


def _optimizer_names() -> tuple[list[str], list[str]]:
    import torch

    torch_names = sorted(
        name
        for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type)
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and name != "Optimizer"
    )
    return deepspeed_optimizers(), torch_names


def _check_optimizer(optimizer: Mapping[str, Any], source: str) -> None:
    name = optimizer.get("type")
    ds_names, torch_names = _optimizer_names()
    if not isinstance(name, str) or (name.lower() not in ds_names and name not in torch_names):
        what = 'no "type"' if name is None else f"unknown type {name!r}"
        raise _fail(
            source,
            "optimizer.type",
            f"{what}; DeepSpeed builds {', '.join(ds_names)} (any case) or a torch.optim class "
            f'({", ".join(torch_names)}); e.g. "AdamW"',
        )
    params = optimizer.get("params", {})
    if not isinstance(params, Mapping):
        raise _fail(source, "optimizer.params", f'must be an object, got {params!r}; e.g. {{"lr": 3e-4}}')
    if "max_grad_norm" in params:
        raise _fail(
            source,
            "optimizer.params.max_grad_norm",
            'DeepSpeed refuses it; move the value to the top-level "gradient_clipping"',
        )
    auto = [k for k, v in params.items() if v == "auto"]
    if auto:
        raise _fail(source, f"optimizer.params.{auto[0]}", 'is "auto", which nothing here resolves; set a value')


def _check_scheduler(scheduler: Mapping[str, Any], source: str) -> None:
    import torch
    from deepspeed.runtime import lr_schedules

    name = scheduler.get("type")
    known = list(lr_schedules.VALID_LR_SCHEDULES)
    if not isinstance(name, str) or not (
        hasattr(lr_schedules, name) or isinstance(getattr(torch.optim.lr_scheduler, name, None), type)
    ):
        what = 'no "type"' if name is None else f"unknown type {name!r}"
        raise _fail(
            source,
            "scheduler.type",
            f"{what}; DeepSpeed's schedules are {', '.join(known)}, or name a torch.optim.lr_scheduler class "
            '(e.g. "CosineAnnealingLR"), or drop the section for a constant learning rate',
        )
    params = scheduler.get("params", {})
    if not isinstance(params, Mapping):
        raise _fail(source, "scheduler.params", f"must be an object, got {params!r}")
