"""The DeepSpeed part of the JSON config, checked before the engine starts.

``deepspeed.initialize`` validates its config only when it builds the engine (after the process group exists, with
an assert or a pydantic traceback naming no file), and some values it never checks at all (a micro-batch of
``"one"`` reaches ``int()``; an unknown optimizer name reaches ``getattr(torch.optim, name)``). :func:`check_ds_config`
checks at start-up what this job's engine reads, each problem as a :class:`~ds_mtraining.config.ConfigError` of one
line ``DeepSpeed config FILE: KEY: what is wrong; the fix``:

- ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``: integers >= 1;
- ``gradient_clipping``: a finite number >= 0 (0 turns clipping off);
- ``zero_optimization``: ``stage`` in 0..3, the rest through DeepSpeed's own model
  (``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``: unknown keys, wrong types, offload devices);
- ``optimizer.type``: one DeepSpeed builds (``deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS``, any case) or a
  ``torch.optim`` optimizer class (exact name, DeepSpeed's fallback); ``optimizer.params`` an object without
  ``max_grad_norm`` (DeepSpeed refuses it: clipping is ``gradient_clipping``);
- ``scheduler.type``: one of DeepSpeed's schedules (``deepspeed.runtime.lr_schedules``) or a
  ``torch.optim.lr_scheduler`` class.

``"auto"`` stays legal where this job resolves it later: ``bf16.enabled``
(:func:`~ds_mtraining.integration.deepspeed.resolve_precision`) and the scheduler's ``warmup_num_steps`` /
``total_num_steps`` (:func:`~ds_mtraining.integration.deepspeed.resolve_schedule`); anywhere else DeepSpeed would
refuse it, so it is refused here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ..config import ConfigError

__all__ = ["check_ds_config", "deepspeed_optimizers"]

_DOCS = "https://www.deepspeed.ai/docs/config-json/"
_SECTIONS = ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16")
"""Sections DeepSpeed reads as objects (a number or a list there is an AttributeError deep inside it)."""
_COUNTS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


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


def check_ds_config(ds_config: Mapping[str, Any], source: str | os.PathLike[str] = "<dict>") -> None:
    """Check what the engine reads from ``ds_config`` (see the module docstring); raise :class:`ConfigError`."""
    source = os.fspath(source)
    if not isinstance(ds_config, Mapping):
        raise ConfigError(f"DeepSpeed config {source}: must be a JSON object, got {type(ds_config).__name__}")
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


def _check_zero(zero: Mapping[str, Any], source: str) -> None:
    stage = zero.get("stage", 0)
    if not _is_int(stage) or not 0 <= stage <= 3:
        raise _fail(
            source,
            "zero_optimization.stage",
            f'must be 0, 1, 2 or 3, got {stage!r}; use 2 (this job runs stages 0-2; add "offload_optimizer": '
            '{"device": "cpu"} for the CPU memory savings)',
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
