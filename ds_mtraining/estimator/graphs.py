"""CUDA-graph replay for the estimator's sync-free GPU work, from a cache its caller owns.

The spread estimator is ~50 Triton kernels and ~100 small PyTorch ops; launched one by one from Python they cost
more host time than their work takes on the GPU (measured at 128K on an H200: 5.0 ms wall for ~3.9 ms of kernels,
with only the greedy replayed). :meth:`GraphCache.replay` captures a function once per key (shapes, dtypes and the
static arguments the caller folds into it) and replays it: inputs are copied into the graph's static buffers,
outputs are cloned out. The function must be free of host synchronisation, data-dependent shapes and collectives
(a captured graph cannot hold them), which every part of the estimator on one device is by design. Captures nest:
a replay reached while another capture is running just calls the function, so the outer graph holds its kernels.

The cache is an object, not module state: the attention handle owns one per model, so the captured graphs (each
with its own memory pool) live as long as the model does and no longer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

__all__ = ["GraphCache", "config_key"]

Outputs = tuple[torch.Tensor | None, ...]


class _Captured:
    """One captured graph: static copies of its inputs, the outputs its replay overwrites."""

    def __init__(self, fn: Callable[..., Outputs], inputs: tuple[torch.Tensor, ...]):
        device = inputs[0].device
        self.inputs = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # first run outside the graph: Triton compiles, the allocator warms up
            fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> Outputs:
        for static, x in zip(self.inputs, inputs, strict=True):
            static.copy_(x)
        self.graph.replay()
        return tuple(None if x is None else x.clone() for x in self.outputs)


class GraphCache:
    """Captured CUDA graphs by key, the least recently used dropped past ``capacity``.

    Args:
        capacity: graphs kept: one per sequence length and knob set in use (every layer of a model shares one).
            Each holds copies of its inputs (for the estimator, the keys: 64 MB at 128K tokens with 2 kv heads of
            128 in bf16) and its own memory pool, the estimate's working set.
    """

    def __init__(self, capacity: int = 8):
        if capacity < 1:
            raise ValueError(f"GraphCache: capacity must be at least 1; got {capacity}")
        self.capacity = capacity
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self._constants: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graphs)

    def constant(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor ``build()`` makes for ``key``, built on first use and kept (least recently used dropped past
        ``4 * capacity``): inputs of the graphs that depend only on the key, such as the observation rows of a
        sequence length, whose dozen small launches would otherwise run before every replay. Callers must not write
        to it."""
        value = self._constants.pop(key, None)
        if value is None:
            value = build()
        self._constants[key] = value
        if len(self._constants) > 4 * self.capacity:
            self._constants.popitem(last=False)
        return value

    def replay(self, fn: Callable[..., Outputs], key: Hashable, inputs: tuple[torch.Tensor, ...]) -> Outputs:
        """``fn(*inputs)``, replayed from the graph cached under ``key`` (captured on first use).

        Args:
            fn: a function of CUDA tensors returning a tuple of tensors (or ``None``s); no host sync, no collective.
            key: everything besides the inputs' shapes, dtypes and device that ``fn``'s work depends on (its name
                and static arguments); the inputs' shapes, dtypes and device are added here.
            inputs: the tensors ``fn`` reads, on one CUDA device.

        Returns:
            ``fn``'s outputs, cloned out of the graph (the next replay overwrites its buffers). On CPU, or while
            another graph is being captured, ``fn(*inputs)`` is called directly.
        """
        if not inputs[0].is_cuda or torch.cuda.is_current_stream_capturing():
            return fn(*inputs)
        key = (key, inputs[0].device, *((tuple(x.shape), x.dtype) for x in inputs))
        captured = self._graphs.pop(key, None) or _Captured(fn, inputs)
        self._graphs[key] = captured
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return captured(inputs)


def config_key(config: object) -> tuple:
    """Every setting of ``config`` (a per-layer ``SparseAttentionConfig``, a strategy's settings or a namespace of
    their fields) as a hashable part of a :meth:`GraphCache.replay` key, so a graph is never replayed for knobs it
    was not captured with."""
    return tuple(sorted((name, value) for name, value in vars(config).items() if name != "overrides"))
