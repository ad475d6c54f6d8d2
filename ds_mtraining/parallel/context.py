"""Context parallelism as strategies: where a layer's tokens live, and how its index is estimated and its attention
computed there.

The attention handle (``integration.transformers.MTrainingAttention``) picks one strategy when it first attends and
calls the same four methods for every layer, whatever the mesh (torchtitan keeps context parallelism in
``distributed/context_parallel`` the same way: the attention never sees it):

- :class:`WholeSequence`: this rank holds whole sequences; the estimator and the single-device kernels.
- :class:`Ring`: this rank holds its layout shard; the estimate is reduced over the ring
  (``estimate_index_distributed``) and ``sparse_ring_attention`` computes the shard's rows.
- :class:`Ulysses`: the all-to-all trades heads for tokens; an inner strategy runs on the gathered tokens of a
  subset of heads (:class:`WholeSequence` on the unpadded sequence when the ring is 1, :class:`Ring` otherwise).

Each strategy's ``enter`` / ``leave`` move q/k/v into and the output out of the strategy's token space; ``estimate``
and ``attend`` take the tensors ``enter`` returned and the whole rows' pattern (``sparse.AttentionPattern``: the
rows' length and packed documents, and after ``estimate`` the index); ``work`` is the pattern's ring work model
(``None`` off a ring), returned unevaluated: it runs on the host, so the training loop evaluates it after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from ..estimator import GraphCache, estimate_index
from ..sparse import AttentionPattern, masked_sparse_attention, vertical_slash_attention
from .estimate import estimate_index_distributed
from .layout import Layout
from .ring import KVExchange, sparse_ring_attention
from .ulysses import gather_heads, scatter_heads
from .work import RingWork, gathered_columns_work, ring_work

if TYPE_CHECKING:
    from ..config import SparseAttentionConfig
    from ..estimator import EstimateReport
    from .mesh import Mesh, RingGroups

__all__ = ["ContextParallel", "Ring", "Ulysses", "WholeSequence", "context_parallel"]

Attention = tuple[torch.Tensor, torch.Tensor]
Keep = Callable[[int, Callable[[Attention | None], Attention]], Attention]
"""``keep(layer, attend)``: ``attend(None)``, or ``attend(kept)`` with an earlier ``(out, lse)`` of the same inputs
(``integration.recompute.attend_once``, keep-attention checkpointing)."""


def _run(layer: int, attend: Callable[[Attention | None], Attention]) -> Attention:
    return attend(None)


class ContextParallel(Protocol):
    """One layout of a layer's attention over the ranks; see the module docstring."""

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """This rank's q ``[B, n, Hq, D]``, k/v ``[B, n, Hkv, D]`` -> the strategy's token space."""
        ...

    def leave(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        """The attention output in the strategy's token space -> this rank's ``[B, n, Hq, D]``."""
        ...

    def estimate(
        self, q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig, pattern: AttentionPattern, *,
        scale: float, layer: int, graphs: GraphCache,
    ) -> tuple[AttentionPattern, EstimateReport]:  # fmt: skip
        """``pattern`` (the whole rows', no index) with the layer's estimated index, and the estimate's report,
        from the tensors :meth:`enter` returned."""
        ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, *, scale: float,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        """Causal attention over the whole rows' ``pattern`` (no index: dense)."""
        ...

    def work(self, pattern: AttentionPattern) -> Callable[[], RingWork] | None:
        """The pattern's ring work model, unevaluated; ``None`` off a ring."""
        ...


@dataclass(frozen=True)
class WholeSequence:
    """Whole sequences on this rank.

    Attributes:
        masked: sparse layers as dense SDPA under the index's boolean mask (``masked_sparse_attention``).
        keep: how a sparse layer's ``(out, lse)`` is kept for its recomputation (:data:`Keep`; default: never).
        seqlen: the real tokens of the sequences (``None``: all of them); under Ulysses without a ring the gathered
            sequence is the layout's padded one, whose padding rows are neither estimated nor attended (zeros out).
    """

    masked: bool = False
    keep: Keep = _run
    seqlen: int | None = None

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        return q, k, v

    def leave(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        return out

    def estimate(
        self, q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig, pattern: AttentionPattern, *,
        scale: float, layer: int, graphs: GraphCache,
    ) -> tuple[AttentionPattern, EstimateReport]:  # fmt: skip
        q, k = (x[:, : self.seqlen] for x in (q, k))
        index, report = estimate_index(
            q, k, config, softmax_scale=scale, return_report=True, graphs=graphs, pattern=pattern
        )  # fmt: skip
        return pattern.with_index(index), report

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, *, scale: float,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        padded = q.shape[1]
        q, k, v = (x[:, : self.seqlen] for x in (q, k, v))
        out = self._attend(q, k, v, pattern, scale=scale, layer=layer)
        if out.shape[1] == padded:
            return out
        return torch.cat([out, out.new_zeros(out.shape[0], padded - out.shape[1], *out.shape[2:])], dim=1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, *, scale: float,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        if pattern.index is None:
            return vertical_slash_attention(q, k, v, pattern, softmax_scale=scale, check_index=False)
        if self.masked:
            return masked_sparse_attention(q, k, v, pattern, scale)
        out, _ = self.keep(
            layer,
            lambda kept: vertical_slash_attention(
                q, k, v, pattern, softmax_scale=scale, return_lse=True, check_index=False, precomputed=kept
            ),  # fmt: skip
        )
        return out

    def work(self, pattern: AttentionPattern) -> None:
        return None


@dataclass(frozen=True)
class Ring:
    """This rank's layout shard on a (flat or hierarchical) sparse ring.

    Attributes:
        groups: the ring's process groups; layout: the layout the shards are cut with.
        columns: how the ring meets the vertical columns (``ParallelConfig.ring_columns``).
        inner: ring positions per inner (intra-node) ring, for the work model's schedule.
        kv_exchange: how K/V moves inside an inner ring (``ParallelConfig.kv_exchange``).
    """

    groups: RingGroups
    layout: Layout
    columns: Literal["per_step", "gathered"] = "per_step"
    inner: int | None = None
    kv_exchange: KVExchange = "ring"

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        return q, k, v

    def leave(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        return out

    def estimate(
        self, q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig, pattern: AttentionPattern, *,
        scale: float, layer: int, graphs: GraphCache,
    ) -> tuple[AttentionPattern, EstimateReport]:  # fmt: skip
        index, report = estimate_index_distributed(
            q, k, config, groups=self.groups, layout=self.layout, softmax_scale=scale, return_report=True,
            layer=layer, graphs=graphs, pattern=pattern,
        )  # fmt: skip
        return pattern.with_index(index), report

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, *, scale: float,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        return sparse_ring_attention(
            q, k, v, pattern, groups=self.groups, layout=self.layout, softmax_scale=scale, columns=self.columns,
            check_index=False, layer=layer, kv_exchange=self.kv_exchange,
        )  # fmt: skip

    def work(self, pattern: AttentionPattern) -> Callable[[], RingWork]:
        model = gathered_columns_work if self.columns == "gathered" else ring_work
        return partial(model, pattern, self.layout, inner=self.inner, kv_exchange=self.kv_exchange)


@dataclass(frozen=True)
class Ulysses:
    """Heads scattered over ``group`` for the gathered tokens (``[B, U * n, H / U, D]``), then ``inner`` on them."""

    group: torch.distributed.ProcessGroup
    inner: WholeSequence | Ring

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        return self.inner.enter(*scatter_heads(q, k, v, group=self.group, layer=layer), layer)

    def leave(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        return gather_heads(self.inner.leave(out, layer), group=self.group, layer=layer)

    def estimate(
        self, q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig, pattern: AttentionPattern, *,
        scale: float, layer: int, graphs: GraphCache,
    ) -> tuple[AttentionPattern, EstimateReport]:  # fmt: skip
        return self.inner.estimate(q, k, config, pattern, scale=scale, layer=layer, graphs=graphs)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, *, scale: float,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        return self.inner.attend(q, k, v, pattern, scale=scale, layer=layer)

    def work(self, pattern: AttentionPattern) -> Callable[[], RingWork] | None:
        return self.inner.work(pattern)


def context_parallel(
    mesh: Mesh | None,
    layout: Layout | None,
    *,
    columns: Literal["per_step", "gathered"] = "per_step",
    masked: bool = False,
    keep: Keep = _run,
) -> ContextParallel:
    """The strategy of ``mesh`` (``None`` or a sequence-parallel degree of 1: :class:`WholeSequence`): Ulysses over
    ``mesh.ulysses`` when its degree is above 1, around a ring over ``mesh.ring`` when that one's is."""
    if mesh is None or mesh.sp_size == 1:
        return WholeSequence(masked=masked, keep=keep)
    if layout is None:
        raise ValueError(
            "sequence-parallel attention needs the batches' layout: MTrainingAttention(..., mesh=mesh, layout=layout)"
        )
    if mesh.ring_size == 1:  # the gathered sequence is the whole (padded) sequence, in order
        inner: WholeSequence | Ring = WholeSequence(keep=keep, seqlen=layout.seqlen)
    else:
        inner = Ring(mesh.ring, layout, columns, inner=mesh.shape.inner_ring, kv_exchange=mesh.shape.kv_exchange)
    return Ulysses(mesh.ulysses, inner) if mesh.ulysses_size > 1 else inner
