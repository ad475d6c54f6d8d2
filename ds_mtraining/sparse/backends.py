"""Which implementation runs for tensors on a device: the Triton kernels on CUDA, the PyTorch code elsewhere.

The one place the index (``sparse.index``), the estimator (``sparse.spread``, ``sparse.greedy``) and the attention
API (``sparse.attention.kernel_backend``) ask. The kernel modules are imported on first use, so CPU-only installs
never import Triton.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch

__all__ = ["TritonKernels", "triton_kernels", "uses_triton"]

_TRITON_DEVICES = frozenset({"cuda"})
"""Device types whose tensors run the Triton kernels."""


class TritonKernels(NamedTuple):
    """The Triton kernel modules of the index and the estimator (``sparse.triton.*``)."""

    candidates: ModuleType
    columns: ModuleType
    evidence: ModuleType
    greedy: ModuleType
    report: ModuleType
    tail: ModuleType


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (CUDA) rather than the PyTorch code."""
    return device.type in _TRITON_DEVICES


@functools.cache
def triton_kernels() -> TritonKernels:
    """The Triton kernel modules, imported on the first call (raises ImportError without Triton)."""
    from .triton import candidates, columns, evidence, greedy, report, tail

    return TritonKernels(candidates, columns, evidence, greedy, report, tail)
