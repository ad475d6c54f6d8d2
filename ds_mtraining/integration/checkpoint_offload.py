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
copying it. Each is pinned in power-of-two pieces (``memory.pinned_pieces``), as PyTorch's pinned-memory allocator
rounds every block up to a power of two: a checkpoint of 1.25M tokens of a 2048-wide model, 5 GiB, would take 8. On
a machine without CUDA the inputs are copied to new CPU tensors, the same path without streams (the CPU tests
exercise it).
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterator

import torch

from ..memory import pinned_pieces

__all__ = ["CheckpointOffload"]


class _Saved:
    """One offloaded checkpoint input: its shape, its host copy (flat pieces, :meth:`CheckpointOffload._pieces`), the
    device copy once fetched, and the input saved before it."""

    __slots__ = ("__weakref__", "device", "fetched", "host", "owner", "previous", "ready", "shape")

    def __init__(self, owner: CheckpointOffload, x: torch.Tensor, host: list[torch.Tensor], previous: _Saved | None):
        self.owner, self.shape, self.host, self.device, self.previous = owner, x.shape, host, x.device, previous
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def __del__(self) -> None:  # autograd dropped the graph that held it: the host buffer serves the next step
        if not sys.is_finalizing():  # at interpreter exit CUDA may be gone, and nothing needs the buffer
            self.owner._release(self.shape, self.host)


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
        self._pool: dict[tuple[torch.Size, torch.dtype], list[tuple[list[torch.Tensor], torch.cuda.Event | None]]]
        self._pool = defaultdict(list)
        self._last: _Saved | None = None  # the input saved last: the one before the next

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Offload the inputs that the checkpoint call inside saves (those that require grad)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds (free buffers; those in use belong to live graphs)."""
        return sum(t.numel() * t.element_size() for free in self._pool.values() for host, _ in free for t in host)

    def _pack(self, x: torch.Tensor) -> torch.Tensor | _Saved:
        if not x.requires_grad or x.device != self.device or x.numel() == 0:
            return x
        free = self._pool[(x.shape, x.dtype)]
        if free:
            host, done = free.pop()
            if done is not None:
                done.synchronize()  # long past by the next forward: a copy back of the last step read it
        else:
            host = [torch.empty(n, dtype=x.dtype, device="cpu", pin_memory=self.cuda) for n in pinned_pieces(x.numel())]
        if self.cuda:
            # The side stream copies once the forward has written x; x's memory is not reused before the copy ends.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for piece, part in self._pieces(host, x.detach()):
                    piece.copy_(part, non_blocking=True)
            x.record_stream(self.stream)
        else:
            for piece, part in self._pieces(host, x.detach()):
                piece.copy_(part)
        saved = _Saved(self, x, host, self._last)
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

    @staticmethod
    def _pieces(host: list[torch.Tensor], x: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each host piece (the last one's used part) beside the part of ``x`` (contiguous) it holds."""
        flat, start = x.reshape(-1), 0
        for piece in host:
            n = min(piece.numel(), flat.numel() - start)
            yield piece[:n], flat[start : start + n]
            start += n

    def _fetch(self, saved: _Saved) -> None:
        host = saved.host
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            x = torch.empty(saved.shape, dtype=host[0].dtype, device=saved.device)
            for piece, part in self._pieces(host, x):
                part.copy_(piece, non_blocking=self.cuda)
            saved.fetched = x
            if self.cuda:
                saved.ready = torch.cuda.Event()
                saved.ready.record(self.stream)

    def _release(self, shape: torch.Size, host: list[torch.Tensor]) -> None:
        done = None
        if self.cuda:  # a copy queued on the side stream may still read the buffer; no wait here, in the backward
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pool[(shape, host[0].dtype)].append((host, done))
