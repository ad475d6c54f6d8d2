"""Our attention inside Hugging Face ``transformers`` models: ``attn_implementation="mtraining"``, for training
and for evaluation.

Importing this module registers ``"mtraining"`` with transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (no mask is built: the attention is causal by construction and a
materialised ``N x N`` mask would not fit at long context, nor match a sharded sequence). Any decoder that
dispatches through the interface — Qwen2, Llama and their relatives (RoPE, GQA) — can then switch to it::

    model = AutoModelForCausalLM.from_config(config, attn_implementation="mtraining")
    attention = MTrainingAttention(cfg.sparse_attention)            # per model run: settings + statistics
    logits = model(input_ids, mtraining=attention).logits            # the handle travels as a forward kwarg

Per layer ``i``: ``sparse.for_layer(i).pattern == "dense"`` runs dense causal attention; ``"vertical_slash"``
estimates the index from this forward's (q, k) and runs the sparse kernels (Triton on CUDA, PyTorch elsewhere).
With sequence parallelism the handle also carries the mesh and the batches' layout (``mesh``, ``layout``)
and each rank holds its shard of the tokens: the Ulysses all-to-all (if ``U > 1``) gathers the ring shard for
a subset of heads, the index is estimated on the ring (``estimate_index_distributed``), and
``sparse_ring_attention`` computes the shard's rows.

Evaluation (``ds_mtraining.eval``) runs the same handle on one device, with what only it needs: generation over
a KV cache (the prompt — the long part — is *prefilled* as above; each decoding step's new rows then attend
densely to the cache, as sparse-prefill inference does), a per-layer probe of the prefill's q/k/v (attention
fidelity), and sparse layers computed as masked dense SDPA (``masked``). Dense layers of whole sequences run
the dense path of ``vertical_slash_attention`` (cuDNN first on CUDA) in training and evaluation alike.

Packed documents (docs/design.md, "Packed documents") are read as transformers reads packed batches: from the
``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs of a flattened batch (``DataCollatorWithFlattening``), and, with
``MTrainingAttention(packed=True)``, from position ids that restart (a document starts wherever an id is not its
predecessor's plus one: ``Documents.from_position_ids``, transformers' ``find_packed_sequence_indices`` rule). Each
layer builds its pattern (``sparse.AttentionPattern``) from its kwargs: the rows' length and documents, to which the
estimate adds the index; the one pattern then goes to the attention and to the ring's work model, and keeps dense and
sparse layers inside each document (from position ids a few ``[B, N]`` device ops a layer; from ``cu_seq_lens`` one
check of the lengths, a host sync a layer: the training job passes its documents built once, as
``mtraining_documents``). The estimator takes them too (its observation rows score only their own document's keys,
and every document keeps its sink columns), and the recorded density is the share of the in-document causal entries
that the index attends inside the documents. Under sequence parallelism the whole rows' documents come as the
``mtraining_documents`` kwarg (a shard's position ids do not mark them), and the ring takes them.

HF hands q/k/v over as ``[B, H, N, D]`` and takes ``[B, N, H, D]`` back: this module is the only place that
transposes. The latest forward's per-layer density, observed recall and the caps its index reached
(:mod:`.budget`) are kept in ``MTrainingAttention.stats`` for the training loop's metrics and the evaluations'
reports (a recomputed forward under activation checkpointing writes the same values; a decoding step none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..estimator import GraphCache
from ..parallel.context import ContextParallel, context_parallel
from ..parallel.layout import Layout
from ..parallel.work import RingWork
from ..sparse import AttentionPattern, Documents
from ..sparse.dense import dense_causal_attention
from .budget import CAPS, capped_heads
from .deepspeed import check_sequence_parallel_gradients
from .recompute import attend_once, estimate_once

if TYPE_CHECKING:
    from ..config import SparseAttentionConfig
    from ..parallel.mesh import Mesh
    from ..sparse import VerticalSlashIndex

__all__ = [
    "NAME",
    "IndexSource",
    "LayerStats",
    "MTrainingAttention",
    "PlantedIndices",
    "Probe",
    "mtraining_attention_forward",
]

NAME = "mtraining"
"""The ``attn_implementation`` name our attention is registered under."""

Probe = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]
"""``probe(layer, q, k, v, scale)`` with q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]`` (post-RoPE, the model's
dtype), called before the layer's attention of a whole sequence (not for decoding steps)."""


@dataclass(frozen=True)
class PlantedIndices:
    """Sparse layers attend over planted indices (``ds_mtraining.sparse.planted``: sinks, columns, a local band and
    far bands, the shape of real indices) of ``density`` instead of estimated ones: for benchmarks on random weights,
    whose near-uniform attention has no real index to find.

    Attributes:
        density: target fraction of the causal entries (``planted_index`` reaches it within one block offset).
        run_estimator: run the estimator first and drop its index, so that its cost counts in the timing.
        seed: the planted index's seed (one index per shape, the same on every rank and every layer).
    """

    density: float
    run_estimator: bool = True
    seed: int = 0


IndexSource: TypeAlias = Literal["estimated", "none"] | PlantedIndices
"""Which index the sparse layers (``pattern == "vertical_slash"``) use: ``"estimated"`` from this forward's q/k
(training, evaluation), a :class:`PlantedIndices`, or ``"none"``: no attention at all in any layer (each head returns
its V: the ceiling of the rest of the step, which no attention kernel can beat). Dense layers stay dense except
under ``"none"``; dense attention everywhere is ``SparseAttentionConfig(pattern="dense")``."""


@dataclass(frozen=True)
class LayerStats:
    """One layer's attention in the latest forward (means over batch and this rank's query heads).

    Attributes:
        density: attended fraction of the causal entries, of the in-document ones with packed documents (1.0 for a
            dense layer); float64, as the estimate reports it, so that the evaluations' means over layers and
            windows are the estimate's own.
        recall: observed-row softmax mass inside the index (1.0 for a dense layer).
        capped_columns, capped_offsets, capped_tail: share of the heads whose index reached ``max_columns`` columns,
            ``max_offsets`` offsets, or ``max_columns + tail_columns`` columns (the estimator's caps) (``integration.budget.
            capped_heads``; 0.0 for a dense layer): with a recall well below its target, the cap to raise.
        ring_work: the index's ring work model (``ds_mtraining.parallel.work``), evaluated when :attr:`imbalance` is
            read; ``None`` without a ring or for a dense layer.

    All tensors but :attr:`density` and :attr:`imbalance` are float32 scalars on the layer's device.
    """

    density: torch.Tensor
    recall: torch.Tensor
    capped_columns: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    capped_offsets: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    capped_tail: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    ring_work: Callable[[], RingWork] | None = None

    @property
    def imbalance(self) -> torch.Tensor:
        """Ring load imbalance ``Σ_steps max_r(work) / Σ_steps mean_r(work)`` of the index on the ring's schedule
        (``1 / ring_efficiency``; 1.0 without a ring or for a dense layer), a float64 scalar on the CPU.

        Computed here, not in the forward: the work model runs on the host from the index, which would make every
        layer's forward wait for its estimate; read after the step (the training loop's metrics), it costs no
        synchronisation the metrics do not already make."""
        if self.ring_work is None:
            return torch.ones((), dtype=torch.float64)
        return torch.tensor(1.0 / self.ring_work().ring_efficiency, dtype=torch.float64)


@dataclass
class MTrainingAttention:
    """What our attention needs besides q/k/v: pass it to the model's forward as ``mtraining=...``.

    Attributes:
        sparse: the ``sparse_attention`` settings (per-layer overrides applied with ``for_layer``);
            ``SparseAttentionConfig(pattern="dense")`` for dense attention everywhere.
        mesh: the process groups when the sequence is sharded (``None``: the whole sequence on this rank).
        layout: the token layout the batches are cut with (required with a ``mesh``; fixed for the run).
        ring_columns: how the ring meets the vertical columns (``ParallelConfig.ring_columns``).
        masked: compute a sparse layer as dense SDPA under its index's boolean mask (:func:`masked_sparse_attention`:
            the same numbers in O(N²) memory, for accelerators without the sparse kernels); whole sequences only.
        probe: called with each layer's q/k/v before its attention of a whole sequence (:data:`Probe`).
        graphs: the estimator's CUDA graphs, captured once per sequence length and settings and replayed by every
            layer (``estimator.GraphCache``; unused off CUDA).
        stats: layer index -> :class:`LayerStats` of the latest forward over whole sequences (decoding steps over a
            KV cache leave the prefill's).
        packed: the rows hold packed documents marked by restarting position ids (``mtraining.data.document_masking``):
            attention stays inside each document. Off, a row is one sequence whatever its position ids (they only
            rotate q and k); ``cu_seq_lens_q`` kwargs give documents either way.
        indices: which index the sparse layers use (:data:`IndexSource`; ``"estimated"`` but in benchmarks).
    """

    sparse: SparseAttentionConfig
    mesh: Mesh | None = None
    layout: Layout | None = None
    ring_columns: Literal["per_step", "gathered"] = "per_step"
    masked: bool = False
    probe: Probe | None = None
    graphs: GraphCache = field(default_factory=GraphCache)
    stats: dict[int, LayerStats] = field(default_factory=dict)
    packed: bool = False
    indices: IndexSource = "estimated"
    _planted: dict[tuple, tuple[VerticalSlashIndex, SimpleNamespace]] = field(
        default_factory=dict, init=False, repr=False
    )
    _context: ContextParallel | None = field(default=None, init=False, repr=False)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        pattern: AttentionPattern | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``layer``: q ``[B, n, Hq, D]``, k/v ``[B, nk, Hkv, D]`` (this rank's tokens; on one
        device ``nk > n`` is a decoding step over a KV cache, whose ``n`` new rows are the last ones), fp32 / fp16 /
        bf16 (fp64 off CUDA); the output ``[B, n, Hq, D]`` in q's dtype. ``pattern``: the whole rows' pattern
        without an index (``AttentionPattern(N, documents=...)``, under sequence parallelism over all of each row,
        not this rank's shard) that the layer's estimate completes, or None for one sequence a row."""
        config = self.sparse.for_layer(layer)
        if self.indices == "none":
            self._record(layer, None, q)
            return v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        if pattern is not None and pattern.documents is not None and q.shape[1] != k.shape[1]:
            raise ValueError(
                "packed documents need whole sequences (no decoding over a KV cache): decoding attention does not "
                "take documents"
            )
        sharded = self.mesh is not None and self.mesh.sp_size > 1
        if sharded and (self.masked or self.probe is not None or q.shape[1] != k.shape[1]):
            raise ValueError(
                "masked attention, probes and decoding over a KV cache need the whole sequence on one rank: "
                "MTrainingAttention(..., mesh=None)"
            )
        if q.shape[1] < k.shape[1]:  # a decoding step: the new rows attend densely to the cache
            return dense_causal_attention(q, k, v, scale)
        if pattern is None:
            pattern = AttentionPattern(q.shape[1] if self.layout is None or not sharded else self.layout.seqlen)
        context = self.context()
        q, k, v = context.enter(q, k, v, layer)
        if self.probe is not None:
            self.probe(layer, q, k, v, scale)
        estimate = partial(context.estimate, q, k, config, pattern, scale=scale, layer=layer, graphs=self.graphs)
        pattern = self._pattern(layer, config, estimate, pattern, q, context.work)
        out = context.attend(q, k, v, pattern, scale=scale, layer=layer)
        return context.leave(out, layer)

    def context(self) -> ContextParallel:
        """The context-parallel strategy of :attr:`mesh` and :attr:`layout` (``parallel.context``), built on first
        use."""
        if self._context is None:
            self._context = context_parallel(
                self.mesh, self.layout, columns=self.ring_columns, masked=self.masked, keep=attend_once
            )
        return self._context

    def mean_density(self) -> float:
        """Mean density over the layers of the latest forward (dense layers count as 1); waits for the device."""
        return sum(float(s.density) for s in self.stats.values()) / max(len(self.stats), 1)

    def mean_recall(self) -> float:
        """Mean observed recall over the layers of the latest forward (dense layers count as 1); waits for the
        device."""
        return sum(float(s.recall) for s in self.stats.values()) / max(len(self.stats), 1)

    def _pattern(
        self,
        layer: int,
        config: SparseAttentionConfig,
        estimate,
        pattern: AttentionPattern,
        q: torch.Tensor,
        work: Callable[[AttentionPattern], Callable[[], RingWork] | None],
    ) -> AttentionPattern:
        """The layer's pattern: ``pattern`` (the rows', no index) for a dense layer, else with its index from
        ``estimate() -> (pattern, report)``, its statistics recorded with its ring work model (``work(pattern)``: on a
        ring, only the work inside the whole rows' packed documents counts, as in the ring's kernels); inside an
        activation checkpoint's recomputation, the forward's pattern (:mod:`.recompute`)."""
        if config.pattern != "vertical_slash":
            self._record(layer, None, q)
            return pattern
        if isinstance(self.indices, PlantedIndices):
            estimate = partial(self._plant, estimate, pattern, q, config.block_size)
        (sparse, report), reused = estimate_once(layer, estimate)
        if reused:
            return sparse
        self._record(layer, report, q, work(sparse), capped_heads(sparse.index, config))
        return sparse

    def _plant(
        self, estimate, pattern: AttentionPattern, q: torch.Tensor, block_size: int
    ) -> tuple[AttentionPattern, SimpleNamespace]:
        """``pattern`` with the planted index of q's shape (the whole sequence's length under sequence parallelism),
        after running ``estimate`` when :attr:`PlantedIndices.run_estimator`; its report has the index's density and
        recall 1."""
        from ..sparse.planted import planted_index

        source = self.indices
        if source.run_estimator:
            estimate()  # its cost counts; its index is not used
        batch, heads = q.shape[0], q.shape[2]
        seqlen = q.shape[1] if self.layout is None else self.layout.seqlen
        key = (batch, heads, seqlen, block_size, q.device)
        if key not in self._planted:
            generator = torch.Generator().manual_seed(source.seed)
            # planted_index's local band (2048 tokens) and columns (960) would cover a short sequence whole: on one
            # of under 16K tokens they shrink with it, so that even a tiny test's index is sparse.
            index = planted_index(
                batch, heads, seqlen, block_size, density=source.density, columns=min(960, seqlen // 16),
                local_tokens=min(2048, max(block_size, seqlen // 8)), generator=generator, device=q.device,
            )  # fmt: skip
            ones = torch.ones(batch, heads, device=q.device)  # nothing was observed
            self._planted[key] = index, SimpleNamespace(density=index.density(seqlen).float(), recall=ones)
        index, report = self._planted[key]
        return pattern.with_index(index), report

    def _record(
        self,
        layer: int,
        report,
        q: torch.Tensor,
        work: Callable[[], RingWork] | None = None,
        capped: dict[str, torch.Tensor] | None = None,
    ) -> None:
        one = torch.ones((), device=q.device)
        self.stats[layer] = LayerStats(
            density=one.double() if report is None else report.density.double().mean(),
            recall=one if report is None else report.recall.float().mean(),
            **(capped or dict.fromkeys(CAPS, torch.zeros((), device=q.device))),
            ring_work=work,
        )


def mtraining_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    mtraining: MTrainingAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q ``[B, Hq, N, D]``, k/v ``[B, Hkv, Nk, D]`` in (``Nk > N``: a
    decoding step over a KV cache), the output ``[B, N, Hq, D]`` in q's dtype and no attention weights out. Of the
    other kwargs, ``mtraining_documents`` (``Documents`` of the whole rows; the training job's, and the only way
    under sequence parallelism), else ``position_ids`` and ``cu_seq_lens_q`` / ``cu_seq_lens_k`` mark packed
    documents (:func:`documents_from_kwargs`)."""
    if mtraining is None:
        raise ValueError(
            f'attn_implementation="{NAME}" needs its settings: call the model with '
            "mtraining=MTrainingAttention(sparse_config) (ds_mtraining.integration.transformers)"
        )
    if attention_mask is not None:
        raise ValueError(
            f'attn_implementation="{NAME}" is causal attention over whole sequences and takes no attention_mask; '
            "pack sequences without padding masks"
        )
    if dropout:
        raise ValueError(f"attention dropout is not supported by {NAME!r}; got dropout={dropout}; set it to 0")
    if sliding_window is not None:
        raise ValueError(f"sliding-window layers are not supported by {NAME!r}; disable use_sliding_window")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    documents = kwargs.get("mtraining_documents")
    sharded = mtraining.mesh is not None and mtraining.mesh.sp_size > 1
    if documents is None and sharded and (mtraining.packed or kwargs.get("cu_seq_lens_q") is not None):
        raise ValueError(
            "packed documents under sequence parallelism: a shard's position ids do not mark them; pass the whole "
            "rows' documents as mtraining_documents=Documents(...) (integration.batch.Batch.documents)"
        )
    if sharded and torch.is_grad_enabled():
        check_sequence_parallel_gradients(next(module.parameters()))
    if documents is None and not sharded:
        documents = documents_from_kwargs(
            kwargs.get("position_ids") if mtraining.packed else None, kwargs.get("cu_seq_lens_q"),
            kwargs.get("cu_seq_lens_k"), *q.shape[:2],
        )  # fmt: skip
    if documents is None:
        return mtraining.attend(module.layer_idx, q, k, v, scale), None
    pattern = AttentionPattern(documents.seqlen, documents=documents)
    return mtraining.attend(module.layer_idx, q, k, v, scale, pattern), None


def documents_from_kwargs(
    position_ids: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
    batch: int,
    seqlen: int,
) -> Documents | None:
    """The packed documents of a forward's rows from transformers' kwargs (``None``: one sequence a row):
    ``cu_seq_lens_q`` (integer ``[D + 1]``, a flattened batch; checked, one host sync), else ``position_ids``
    (integer ``[B or 1, seqlen]``, restarting ids; no sync), which the caller passes only for
    ``MTrainingAttention(packed=True)``."""
    if cu_seq_lens_q is None:
        return None if position_ids is None else Documents.from_position_ids(position_ids.expand(batch, -1))
    if (
        cu_seq_lens_k is not None
        and cu_seq_lens_k is not cu_seq_lens_q
        and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)
    ):
        raise ValueError(
            f"cu_seq_lens_k {cu_seq_lens_k.tolist()} differs from cu_seq_lens_q {cu_seq_lens_q.tolist()}: "
            f"{NAME!r} is self-attention over whole packed sequences; pass the same lengths for both"
        )
    return Documents.from_cu_seqlens(cu_seq_lens_q, seqlen)


def whole_sequences_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask builder (``AttentionMaskInterface``) of attentions that are causal over whole sequences: nothing to
    build (``None``); a padding mask (any 0 in ``attention_mask``, ``[B, N]`` of 0/1 in any integer or bool dtype)
    is passed on, so that the attention rejects it instead of attending to the padding."""
    if attention_mask is not None and bool(attention_mask.all()):
        return None
    return attention_mask


AttentionInterface.register(NAME, mtraining_attention_forward)
AttentionMaskInterface.register(NAME, whole_sequences_mask)
