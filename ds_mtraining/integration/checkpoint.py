"""Activation checkpointing that recomputes a layer's attention but not its index.

Under non-reentrant activation checkpointing a layer's forward runs twice: in the forward pass, and again in
the backward to regenerate what the layer saved. The second run would estimate the index again — the same
index (the estimator is deterministic and sees the same q and k) at the same cost, which for the spread
estimator is as much as the sparse attention itself. :func:`reuse_index` is a ``context_fn`` for
``torch.utils.checkpoint.checkpoint``: every checkpointed call gets its own store; the forward records each
layer's estimate in it and the recomputation takes it back out. A recomputation that finds nothing (a second
backward through the same graph) estimates again, so the result is never stale.
:func:`enable_activation_checkpointing` switches it on for a transformers model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["enable_activation_checkpointing", "estimate_once", "reuse_index"]

R = TypeVar("R")
_STORE: ContextVar[tuple[bool, dict[Any, Any]] | None] = ContextVar("ds_mtraining_index_store", default=None)


@contextlib.contextmanager
def _active(replay: bool, store: dict[Any, Any]) -> Iterator[None]:
    token = _STORE.set((replay, store))
    try:
        yield
    finally:
        _STORE.reset(token)


def reuse_index() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``(forward context, recompute context)`` sharing one store, for ``checkpoint(..., context_fn=reuse_index)``."""
    store: dict[Any, Any] = {}
    return _active(False, store), _active(True, store)


def estimate_once(key: Any, estimate: Callable[[], R]) -> tuple[R, bool]:
    """``estimate()``, or inside a checkpoint's recomputation what the forward's ``estimate()`` returned for ``key``.

    Returns the result and whether it was reused (the caller then skips what it did with it the first time, such
    as recording statistics).
    """
    active = _STORE.get()
    if active is None:
        return estimate(), False
    replay, store = active
    if replay and key in store:
        return store.pop(key), True
    result = estimate()
    if not replay:
        store[key] = result
    return result, False


def enable_activation_checkpointing(model: PreTrainedModel, *, reuse: bool = True) -> None:
    """Non-reentrant activation checkpointing on every layer of ``model``; with ``reuse``, the recomputation takes
    each layer's index from the forward (:func:`reuse_index`) instead of estimating it again."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if reuse:
        kwargs["context_fn"] = reuse_index
    # transformers 5 renamed gradient checkpointing to activation checkpointing; the project supports both (>= 4.48).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
