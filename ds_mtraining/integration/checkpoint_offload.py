"""Activation checkpoints in CPU memory: DeepSpeed's ``"activation_checkpointing": {"cpu_checkpointing": true}`` for
the job's per-layer checkpoints.

At long lengths the checkpoints themselves fill the GPU: a decoder layer's checkpoint is its input, ``B·N·hidden``
elements (36 layers x 1M tokens x 2048 x bf16 = 144 GiB for the 3B shape). This moves each checkpointed layer's
input to CPU memory after its forward and brings it back for its backward's recomputation.

Why by hand. DeepSpeed's ``cpu_checkpointing`` belongs to its own reentrant ``deepspeed.checkpointing.checkpoint``,
which the job does not use: transformers checkpoints each decoder layer with ``torch.utils.checkpoint``
(non-reentrant), whose recomputation reuses the layer's index (``recompute``). transformers' own
``activation_checkpointing_enable(offload=True)`` (newer than the release this project supports as its floor) wraps
the checkpoint in ``torch.autograd.graph.save_on_cpu``: both copies on the compute stream, so the step waits for them,
and every input moved, the rotary tables that all layers share included.

How. The non-reentrant checkpoint saves its inputs with ``save_for_backward`` outside its own saved-tensor hooks, so
hooks set around the checkpoint call (:meth:`CheckpointOffload.around`) see exactly the layer's inputs, not the
tensors its recomputation regenerates. An input that requires grad (the hidden states) is copied to pinned host memory
on a side stream and its device memory is freed with the forward's last use; the others (rotary tables, masks) stay.
When a layer's recomputation unpacks its input, the copy back of the input saved before it (the previous layer's,
whose backward comes next) starts on the side stream, so it overlaps this layer's backward; the compute stream waits
for a copy only when it needs the tensor. Host buffers are pooled by shape and dtype: pinning memory costs more than
copying it. On a machine without CUDA the inputs are copied to new CPU tensors, the same path without streams (the
CPU tests exercise it).
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterator

import torch

__all__ = ["CheckpointOffload"]


class _Saved:
    """One offloaded checkpoint input: its host copy, the device copy once fetched, and the input saved before it."""

    __slots__ = ("__weakref__", "device", "fetched", "host", "owner", "previous", "ready")

    def __init__(self, owner: CheckpointOffload, host: torch.Tensor, device: torch.device, previous: _Saved | None):
        self.owner, self.host, self.device, self.previous = owner, host, device, previous
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def __del__(self) -> None:  # autograd dropped the graph that held it: the host buffer serves the next step
        if not sys.is_finalizing():  # at interpreter exit CUDA may be gone, and nothing needs the buffer
            self.owner._release(self.host)


class CheckpointOffload:
    """Saved-tensor hooks that keep checkpoint inputs in CPU memory (module docstring); one per model.

    Use :meth:`around` around each layer's checkpoint call. ``device``: where the model computes.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # tensors name their card: "cuda" would match none of them
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Free host buffers by (shape, dtype), each with the side-stream event after which nothing reads it.
        self._pool: dict[tuple[torch.Size, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event | None]]]
        self._pool = defaultdict(list)
        self._last: _Saved | None = None  # the input saved last: the one before the next

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Offload the inputs that the checkpoint call inside saves (those that require grad)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds (free buffers; those in use belong to live graphs)."""
        return sum(t.numel() * t.element_size() for free in self._pool.values() for t, _ in free)

    def _pack(self, x: torch.Tensor) -> torch.Tensor | _Saved:
        if not x.requires_grad or x.device != self.device:
            return x
        free = self._pool[(x.shape, x.dtype)]
        if free:
            host, done = free.pop()
            if done is not None:
                done.synchronize()  # long past by the next forward: a copy back of the last step read it
        else:
            host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=self.cuda)
        if self.cuda:
            # The side stream copies once the forward has written x; x's memory is not reused before the copy ends.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(x.detach(), non_blocking=True)
            x.record_stream(self.stream)
        else:
            host.copy_(x.detach())
        saved = _Saved(self, host, x.device, self._last)
        self._last = saved
        return saved

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        self._last = None  # the backward has begun: the next forward starts a new chain
        if saved.fetched is None:
            self._fetch(saved)
        x, saved.fetched = saved.fetched, None  # a second backward through the graph fetches again
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            x.record_stream(current)
        previous = saved.previous
        if previous is not None and previous.fetched is None:
            self._fetch(previous)  # the next layer's backward needs it: copy while this one computes
        return x

    def _fetch(self, saved: _Saved) -> None:
        if not self.cuda:
            saved.fetched = saved.host.clone()
            return
        with torch.cuda.stream(self.stream):
            saved.fetched = saved.host.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self.stream)

    def _release(self, host: torch.Tensor) -> None:
        done = None
        if self.cuda:  # a copy queued on the side stream may still read the buffer; no wait here, in the backward
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pool[(host.shape, host.dtype)].append((host, done))
