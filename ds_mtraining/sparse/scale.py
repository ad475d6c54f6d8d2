"""The softmax-scale check shared by the attention API, the estimator and the Triton launchers."""

from __future__ import annotations

import math


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int, caller: str) -> float:
    """The logit scale to use: ``head_dim ** -0.5`` for None, else ``softmax_scale``, which must be positive and
    finite (the Triton kernels take row maxima of the unscaled scores, whose order a positive scale keeps)."""
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"{caller}: softmax_scale must be a positive finite number; got {softmax_scale!r} "
            f"(pass None for 1/sqrt(head_dim) = {1.0 / math.sqrt(head_dim):.4g})"
        )
    return scale
