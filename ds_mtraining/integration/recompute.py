"""Activation checkpointing whose recomputation reuses a layer's index, and optionally its attention output.

Under non-reentrant activation checkpointing a layer's forward runs twice: in the forward pass, and again in
the backward to regenerate what the layer saved. The second run would estimate the index again — the same
index (the estimator is deterministic and sees the same q and k) at the same cost, which for the spread
estimator is as much as the sparse attention itself. :func:`reuse_index` is a ``context_fn`` for
``torch.utils.checkpoint.checkpoint``: every checkpointed call gets its own store; the forward records each
layer's estimate in it and the recomputation takes it back out. A recomputation that finds nothing (a second
backward through the same graph) estimates again, so the result is never stale.

:func:`keep_attention` does that and also keeps each sparse layer's attention output and log-sum-exp from the
forward (:func:`attend_once`), so the recomputation skips the attention kernel too: it hands the kept
``(out, lse)`` to ``vertical_slash_attention(precomputed=...)``, whose backward computes dq/dk/dv from
(q, k, v, out, lse, index) exactly as without it. Memory for time: a layer keeps
``B·N·Hq·D·itemsize(out) + B·Hq·N·itemsize(lse)`` bytes (lse is fp32, fp64 for fp64 inputs) from its forward
until its backward; dense layers (SDPA) and the ring path recompute as before.

:func:`enable_activation_checkpointing` switches either on for a transformers model, on every k-th decoder layer, with
the checkpoints in GPU or CPU memory (``checkpoint_offload``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .checkpoint_offload import CheckpointOffload

__all__ = ["attend_once", "enable_activation_checkpointing", "estimate_once", "keep_attention", "reuse_index"]

R = TypeVar("R")
Attention = tuple[torch.Tensor, torch.Tensor]
"""``(out, lse)`` of one attention call."""


class _State(NamedTuple):
    replay: bool  # inside the recomputation
    keep: bool  # also keep the attention's (out, lse)
    store: dict[Any, Any]


_STORE: ContextVar[_State | None] = ContextVar("ds_mtraining_index_store", default=None)


class _AttentionKey(NamedTuple):
    """Store key of a layer's kept attention, apart from its index's (``key`` itself)."""

    key: Any


class _Active(contextlib.AbstractContextManager[None]):
    """Makes a store current. Enterable again: checkpoint enters its recompute context once per recomputation,
    and a second backward through a retained graph recomputes again (a generator-based one could not)."""

    def __init__(self, replay: bool, keep: bool, store: dict[Any, Any]) -> None:
        self._state = _State(replay, keep, store)
        self._tokens: list[Token[_State | None]] = []

    def __enter__(self) -> None:
        self._tokens.append(_STORE.set(self._state))

    def __exit__(self, *exc: object) -> None:
        _STORE.reset(self._tokens.pop())


def reuse_index() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``(forward context, recompute context)`` sharing one store, for ``checkpoint(..., context_fn=reuse_index)``."""
    store: dict[Any, Any] = {}
    return _Active(False, False, store), _Active(True, False, store)


def keep_attention() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """Like :func:`reuse_index`, and the recomputation also takes each sparse layer's ``(out, lse)`` from the
    forward instead of running the attention kernel (:func:`attend_once`)."""
    store: dict[Any, Any] = {}
    return _Active(False, True, store), _Active(True, True, store)


_keep_attention_context = keep_attention  # enable_activation_checkpointing's parameter of that name shadows it


def estimate_once(key: Any, estimate: Callable[[], R]) -> tuple[R, bool]:
    """``estimate()``, or inside a checkpoint's recomputation what the forward's ``estimate()`` returned for ``key``.

    Returns the result and whether it was reused (the caller then skips what it did with it the first time, such
    as recording statistics).
    """
    active = _STORE.get()
    if active is None:
        return estimate(), False
    replay, _, store = active
    if replay and key in store:
        return store.pop(key), True
    result = estimate()
    if not replay:
        store[key] = result
    return result, False


def attend_once(key: Any, attend: Callable[[Attention | None], Attention]) -> Attention:
    """``attend(None)``; under :func:`keep_attention`, the forward keeps its ``(out, lse)`` for ``key`` (when
    autograd records, i.e. a backward may follow) and the recomputation returns ``attend(kept)``.

    ``attend(precomputed)`` is the attention call, e.g. ``vertical_slash_attention(..., return_lse=True,
    precomputed=precomputed)``: with ``None`` it runs the kernel, with the kept pair it only rebuilds the
    autograd node. A recomputation that finds nothing (a second backward) gets ``None`` and runs the kernel.
    """
    active = _STORE.get()
    if active is None or not active.keep:
        return attend(None)
    slot = _AttentionKey(key)
    if active.replay:
        return attend(active.store.pop(slot, None))
    out, lse = attend(None)
    if torch.is_grad_enabled():
        active.store[slot] = (out.detach(), lse.detach())
    return out, lse


def enable_activation_checkpointing(
    model: PreTrainedModel,
    *,
    reuse: bool = True,
    keep_attention: bool = False,
    every: int = 1,
    offload: CheckpointOffload | None = None,
) -> int:
    """Non-reentrant activation checkpointing on every ``every``-th decoder layer of ``model`` (from layer 0; the
    others keep their activations); with ``reuse``, the recomputation takes each layer's index from the forward
    (:func:`reuse_index`) instead of estimating it again; with ``keep_attention`` also each sparse layer's attention
    output (:func:`keep_attention`: memory for time); with ``offload``, the checkpointed layers' inputs wait for their
    backward in CPU memory (``checkpoint_offload``). Returns how many decoder layers checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if keep_attention not in (True, False):
        raise ValueError(
            f"keep_attention must be True or False; got {keep_attention!r} (the training job decides \"auto\" from its "
            "start-up memory estimate, ds_mtraining.memory.decide_auto)"
        )
    if keep_attention and not reuse:
        raise ValueError(
            "keep_attention=True needs reuse=True: the kept attention output belongs to the forward's index"
        )
    if every < 1:
        raise ValueError(f"every must be >= 1 (1: every decoder layer); got {every}")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if keep_attention:
        kwargs["context_fn"] = _keep_attention_context
    elif reuse:
        kwargs["context_fn"] = reuse_index
    # transformers 5 renamed gradient checkpointing to activation checkpointing; the project supports both (>= 4.48).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # The layer choice and the offload by hand: transformers' own (every_n_layers, offload) came after 5.17, the
    # oldest release supported, and its offload copies on the compute stream.
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0
        if offload is not None and layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = _offloaded(layer._gradient_checkpointing_func, offload)
    return sum(layer.gradient_checkpointing for layer in layers)


def _offloaded(checkpoint: Callable[..., R], offload: CheckpointOffload) -> Callable[..., R]:
    def offloaded_checkpoint(*args: Any, **kwargs: Any) -> R:
        with offload.around():
            return checkpoint(*args, **kwargs)

    return offloaded_checkpoint
