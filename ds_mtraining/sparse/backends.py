"""Which implementation runs for tensors on a device: the Triton kernels on CUDA, the PyTorch code elsewhere.

The one place the index (``sparse.index``), the attention API (``sparse.attention.kernel_backend``) and the
estimator (``estimator.kernels`` holds its own kernel modules) ask. The index's kernel modules are imported on
first use, so CPU-only installs never import Triton.
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
    """The Triton kernel modules of the index (``sparse.triton.*``): ``with_columns``'s merge, ``density``."""

    columns: ModuleType
    report: ModuleType


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (CUDA) rather than the PyTorch code."""
    return device.type in _TRITON_DEVICES


@functools.cache
def triton_kernels() -> TritonKernels:
    """The Triton kernel modules, imported on the first call (raises ImportError without Triton)."""
    from .triton import columns, report

    return TritonKernels(columns, report)
