"""The non-finite guard: a step whose loss or gradient norm is NaN / inf ends the job before anything is saved.

DeepSpeed skips such steps only under fp16 loss scaling; in bf16 and fp32 it applies them, and the next
checkpoint would hold NaN weights while the job exits 0. Every rank sees the same (all-reduced) loss and the same
global gradient norm, so all ranks decide alike and none is left waiting in a collective.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["NonFiniteError", "check_step", "check_weights", "weights_finite"]


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; the message names the step and the cause."""


def check_step(step: int, loss: float, grad_norm: float | None, latest: str | None) -> None:
    """Raise :class:`NonFiniteError` if ``loss`` or ``grad_norm`` (``None``: not computed) is not finite.
    ``latest`` is the checkpoint tag the job would resume from (``None``: none saved yet)."""
    bad = [f"loss {loss}"] if not math.isfinite(loss) else []
    if grad_norm is not None and not math.isfinite(grad_norm):
        bad.append(f"gradient norm {grad_norm}")
    if bad:
        raise NonFiniteError(f"step {step}: {' and '.join(bad)}; " + _advice(latest))


def weights_finite(engine) -> bool:
    """Whether every rank's parameters are all finite (collective: call it on every rank)."""
    # Under ZeRO-3 a parameter outside its module's forward is an empty placeholder; its shard is ``ds_tensor``.
    ok = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters())
    flag = torch.tensor([0.0 if ok else 1.0], device=engine.device)
    dist.all_reduce(flag)
    return float(flag) == 0.0


def check_weights(engine, step: int, latest: str | None) -> None:
    """Raise :class:`NonFiniteError` before a checkpoint of non-finite weights would be written (collective)."""
    if not weights_finite(engine):
        raise NonFiniteError(f"step {step}: the weights hold NaN or inf; not saved; " + _advice(latest))


def _advice(latest: str | None) -> str:
    where = f"checkpoint {latest} stays latest" if latest else "no checkpoint was written"
    return f"{where}; lower the learning rate or check the data, then train again (--resume continues from latest)"
