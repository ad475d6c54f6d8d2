"""The estimator's Triton kernel modules (``estimator.triton.*``), imported on first use so that CPU-only installs
never import Triton. Which device runs them is ``sparse.backends.uses_triton``'s one rule (CUDA)."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

__all__ = ["EstimatorKernels", "estimator_kernels"]


class EstimatorKernels(NamedTuple):
    """The spread strategy's kernels: candidate ratio, evidence sweeps, greedy rounds, recall report, tail split."""

    candidates: ModuleType
    evidence: ModuleType
    greedy: ModuleType
    recall: ModuleType
    tail: ModuleType


@functools.cache
def estimator_kernels() -> EstimatorKernels:
    """The kernel modules, imported on the first call (raises ImportError without Triton)."""
    from .triton import candidates, evidence, greedy, recall, tail

    return EstimatorKernels(candidates, evidence, greedy, recall, tail)
