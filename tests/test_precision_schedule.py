"""The DeepSpeed config's precision and schedule as the job decides them: explicit values kept, ``"auto"`` resolved
by the hardware and by ``--steps``, contradictions refused with the fix."""

from __future__ import annotations

import pytest
import torch

from ds_mtraining.config import ConfigError
from ds_mtraining.integration.deepspeed import resolve_precision, resolve_schedule


def _gpu(monkeypatch, *, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "H200" if bf16 else "V100")


@pytest.mark.parametrize(
    "gpu, requested, enabled",
    [
        ("H200", "auto", True),
        ("V100", "auto", False),
        (None, "auto", False),
        ("H200", False, False),  # an explicit false stays false on a bf16 GPU
        ("H200", True, True),
        (None, True, True),
        (None, False, False),
    ],
)
def test_precision(monkeypatch, gpu, requested, enabled):
    if gpu:
        _gpu(monkeypatch, bf16=gpu == "H200")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = {"bf16": {"enabled": requested}, "train_micro_batch_size_per_gpu": 1}
    resolved, note = resolve_precision(config)
    assert resolved["bf16"]["enabled"] is enabled and resolved["train_micro_batch_size_per_gpu"] == 1
    assert config["bf16"]["enabled"] == requested  # the caller's dict is not changed
    assert note.startswith("bf16 on" if enabled else ("bf16 off" if requested == "auto" else "fp32"))


def test_precision_without_a_section_is_fp32(monkeypatch):
    _gpu(monkeypatch, bf16=True)
    resolved, note = resolve_precision({})
    assert resolved["bf16"]["enabled"] is False and note.startswith("fp32")


def test_precision_refusals(monkeypatch):
    _gpu(monkeypatch, bf16=False)
    with pytest.raises(ConfigError, match='V100 has no bf16; set it to "auto" or false'):
        resolve_precision({"bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="must be true, false or \"auto\"; got 'yes'"):
        resolve_precision({"bf16": {"enabled": "yes"}})


def _schedule(**params) -> dict:
    return {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3} | params}}


@pytest.mark.parametrize("steps, warmup, total", [(8, 2, 8), (100, 10, 100), (25, 2, 25), (1, 2, 3), (2, 2, 3)])
def test_auto_schedule_follows_the_run(steps, warmup, total):
    resolved, note = resolve_schedule(_schedule(warmup_num_steps="auto", total_num_steps="auto"), steps)
    params = resolved["scheduler"]["params"]
    assert params == {"warmup_max_lr": 1e-3, "warmup_num_steps": warmup, "total_num_steps": total}
    assert note == f"WarmupDecayLR warm-up {warmup} of {total} steps"


def test_explicit_schedule_is_kept_and_checked():
    config = _schedule(warmup_num_steps=10, total_num_steps=200)
    assert resolve_schedule(config, 200)[0] == config
    with pytest.raises(ConfigError, match="total_num_steps=200 < --steps 201"):
        resolve_schedule(config, 201)
    with pytest.raises(ConfigError, match="warmup_num_steps=300 >= total_num_steps=300"):
        resolve_schedule(_schedule(warmup_num_steps=300, total_num_steps=300), 10)
    with pytest.raises(ConfigError, match='warmup_max_lr is "auto"'):
        resolve_schedule(_schedule(warmup_max_lr="auto"), 10)


def test_no_scheduler():
    assert resolve_schedule({"optimizer": {}}, 5) == ({"optimizer": {}}, "constant learning rate (no scheduler)")
