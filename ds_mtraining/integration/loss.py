"""The training loss without full-length logits: the LM head and the cross-entropy run tile by tile of tokens.

``sequence_loss(model(...).logits, ...)`` needs ``[B, n, vocab]`` logits, and cross-entropy keeps as many again for
backward: at 128K tokens x 151,936 ids that is 80 GB per fp32 copy. :func:`forward_loss` asks the model for its final
hidden states instead (``logits_to_keep`` empty: the LM head projects no token) and :func:`tiled_sequence_loss`
computes the same value from them in tiles of at most ``TILE_BYTES`` of fp32 logits, keeping no logits for backward:
the backward recomputes each tile's logits and turns them into its part of the hidden-state and head-weight
gradients at once (the pattern of DeepSpeed's ``SequenceTiledCompute``).

DeepSpeed's own helpers (``deepspeed.runtime.sequence_parallel.ulysses_sp``) are not used because under ZeRO-2 they
give wrong results or fail on our models, as measured with DeepSpeed 0.19.8 (``tests/test_tiled_loss.py`` checks the
replacement against the full-logits loss in a ZeRO-2 engine). Both helpers run a nested ``torch.autograd.backward``
for each tile, which puts the head weight's gradient straight into ``.grad`` and fires ZeRO's gradient hook once per
tile (ZeRO skips all but the last through ``ds_grad_is_ready``). ``TiledFusedLogitsLoss`` does this inside its *forward*, so the weight gradient misses the incoming gradient:
with gradient accumulation 2 the untied ``lm_head.weight`` gradient comes out twice as large. With a tied
embedding (tiny-qwen2, SmolLM2) both helpers stop with "The parameter model.embed_tokens.weight has already been
reduced": the embedding lookup adds a second gradient after the head's tiles have been reduced. Here the weight is an
ordinary input of one autograd function, so autograd adds the tiles' gradient to the embedding's gradient and
accumulates the sum once, already scaled by the incoming gradient (accumulation steps, loss scale).

ZeRO-3 partitions every parameter and gathers it only inside its own module's forward and backward (hooks on the
module), so outside ``lm_head``'s forward ``lm_head.weight`` is an empty placeholder (shape ``[0]``, the real one in
``ds_shape``). The function therefore gathers the weight itself, once for the forward's tiles and once for the
backward's (:func:`_full_weight`: the parameter's ``all_gather`` / ``partition``, the backward's release deferred until
autograd has accumulated the gradient), and hands autograd
a full-shape gradient, which ZeRO-3's gradient hook on the parameter reduce-scatters like any other. Calling the
``lm_head`` module per tile instead would let its hooks do the gathering, but then once per tile (75 all-gathers of
the whole head, ~1 GiB each for a 7B Qwen2 in bf16, in the forward and as many again in the backward) and the tiles'
gradients would reach ZeRO's hook one by one (the failure of DeepSpeed's helpers above). One gather holds the full
weight as long as ZeRO-3's own ``lm_head`` forward would; without ZeRO-3 the context is a no-op.

On the GPU, with the fused kernels on (``mtraining.fused_kernels``), the head and loss are Liger Kernel's fused
linear cross-entropy instead (:func:`liger_sequence_loss`), chosen by measurement (``benchmarks/loss_bench.py``,
docs/measurements.md, "The loss"; one H200, Qwen2.5-3B's head: hidden 2048, 151,936 ids, bf16):

=========  ==========================  ===========================  ==========================
tokens     tiled (ours): ms, peak GiB  Liger, fp32 weight gradient  Liger vs ours
=========  ==========================  ===========================  ==========================
131072     927 ms, 5.22 GiB            407 ms, 2.24 GiB             0.44x time, 0.43x memory
262144     1860 ms, 5.73 GiB           797 ms, 3.32 GiB             0.43x time, 0.58x memory
=========  ==========================  ===========================  ==========================

Ours recomputes each tile's logits in the backward (8 N·hidden·vocab FLOPs against 6) and runs PyTorch's
cross-entropy per tile; Liger computes both gradients in the forward, chunk by chunk, with its own Triton softmax
kernel. Both are exact: in fp32 engines (ZeRO-2 with accumulation 2, tied and untied heads, ZeRO-3, a ring of 2) the
loss and every parameter's gradient are within 1.53x (Liger) and 1.0x (ours) of the full-logits loss's own error
against float64 (``tests/test_loss_choice.py``); in bf16 the hidden-state gradient differs from ours by 4.2e-3 of
its largest entry, half a bf16 rounding. Liger's wiring (:func:`liger_sequence_loss`): ``reduction="sum"`` divided
by the whole sequence's label tokens (its ``"mean"`` divides by this rank's count, wrong under sequence
parallelism), ``accum_dtype=float32`` (its default sums a bf16 weight's chunk gradients in bf16), and under ZeRO-3
the head weight gathered again in the backward, since its gradient is only scaled there. On the CPU Liger's kernels
need Triton's interpreter, so there ours runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..sparse.documents import Documents
from .batch import IGNORE, sequence_loss

if TYPE_CHECKING:
    from .batch import Batch
    from .transformers import MTrainingAttention

__all__ = ["TILE_BYTES", "forward_loss", "liger_sequence_loss", "tiled_sequence_loss"]

TILE_BYTES = 1 << 30
"""Budget of one tile's fp32 logits: 1 GiB (ArcticTraining's choice for tiled logits). The backward holds about four
tile-sized buffers at once (the logits, their fp32 copy, the log-softmax and its gradient), whatever the sequence
length: on an H200, hidden 896 and 151,936 ids in bf16, the loss's forward and backward peaked at 3.95 GiB for 128K
tokens (75 tiles), against 27.8 GiB for the full logits of 16K tokens."""


def forward_loss(
    model: nn.Module, batch: Batch, attention: MTrainingAttention, *, fused: bool = False, shards: int | None = None
) -> torch.Tensor:
    """This rank's loss of ``batch``, equal to ``sequence_loss(model(...).logits, labels, label_tokens)`` but without
    ``[B, n, vocab]`` logits: :func:`tiled_sequence_loss`, or with ``fused`` :func:`liger_sequence_loss` (``shards``
    is ours only).

    ``model``: a DeepSpeed engine or a transformers causal LM. The engine is called as a whole, so its own forward
    runs with the hooks it puts on its outputs (ZeRO's backward prologue fires when the gradient reaches the hidden
    states, which therefore must be among them). With ``logits_to_keep`` an empty slice it returns ``[B, 0, vocab]``
    logits; the final-norm hidden states are put in its output as ``hidden_states[-1]`` by forward hooks
    (:func:`_final_hidden_states`). Not by ``output_hidden_states``: transformers (5.17) then keeps every decoder
    layer's output until the forward ends, which holds the activation checkpoints that ``cpu_checkpointing`` moves to
    the host on the GPU all the same (measured on one H100 at 128K: 17.5 GiB, the peak 33.7 GiB where 24.0 is
    reached without them).

    Returns:
        a scalar, fp32 (fp64 for an fp64 model), on the model's device.
    """
    device = model.device
    documents = None if batch.documents is None else Documents(batch.documents.starts.to(device))
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    with _final_hidden_states(inner):
        out = model(
            batch.input_ids.to(device),
            position_ids=batch.position_ids.to(device),
            use_cache=False,
            mtraining=attention,
            mtraining_documents=documents,
            logits_to_keep=slice(0, 0),
        )
    head = inner.get_output_embeddings()
    labels = batch.labels.to(device)
    if fused:
        return liger_sequence_loss(out.hidden_states[-1], head, labels, batch.label_tokens)
    return tiled_sequence_loss(out.hidden_states[-1], head, labels, batch.label_tokens, shards=shards)


@contextlib.contextmanager
def _final_hidden_states(model: nn.Module) -> Iterator[None]:
    """While inside, ``model``'s (a transformers causal LM) output carries its base model's final-norm hidden states
    ``[B, n, hidden]`` as its only ``hidden_states``, taken by forward hooks (see :func:`forward_loss` for why not
    ``output_hidden_states``)."""
    final: list[torch.Tensor] = []

    def keep(_module: nn.Module, _args: Any, out: Any) -> None:
        final.append(out[0])

    def carry(_module: nn.Module, _args: Any, out: Any) -> Any:
        out["hidden_states"] = (final.pop(),)  # item, not attribute: DeepSpeed walks the output's items for its hooks
        return out

    handles = [model.base_model.register_forward_hook(keep), model.register_forward_hook(carry)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def tiled_sequence_loss(
    hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, label_tokens: int, *, shards: int | None = None
) -> torch.Tensor:
    """``sequence_loss(lm_head(hidden), labels, label_tokens)`` (``Σ_local CE / label_tokens``, labels ``-100``
    ignored), computed in tiles of tokens.

    Args:
        hidden: ``[B, n, hidden]`` final hidden states (the model's dtype).
        lm_head: the bias-free output projection, weight ``[vocab, hidden]``.
        labels: LongTensor ``[B, n]``.
        label_tokens: label tokens of the whole sequence (all sequence-parallel ranks).
        shards: number of tiles (the ``B * n`` tokens split evenly, the last tile shorter); ``None``: as many as keep a
            tile's fp32 logits within :data:`TILE_BYTES`.

    Returns:
        a scalar, fp32 (fp64 for fp64 inputs); its backward recomputes the logits one tile at a time.
    """
    if lm_head.bias is not None:
        raise ValueError("tiled_sequence_loss takes a bias-free lm_head (Qwen2, Llama)")
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on [B, n]")
    rows = _tile_rows(labels.numel(), lm_head.out_features, shards)
    # Applied while gathered: autograd records the weight's full shape, so the backward may return a full gradient.
    with _full_weight(lm_head.weight):
        return _TiledHeadLoss.apply(hidden, lm_head.weight, labels, label_tokens, rows)


def liger_sequence_loss(
    hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, label_tokens: int
) -> torch.Tensor:
    """:func:`tiled_sequence_loss`'s contract computed by Liger Kernel's fused linear cross-entropy, in its own
    chunks of tokens: ``hidden`` ``[B, n, hidden]``, ``labels`` ``[B, n]`` -> an fp32 scalar whose gradients were
    computed in the forward (the backward scales them by the incoming gradient)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if lm_head.bias is not None:
        raise ValueError("liger_sequence_loss takes a bias-free lm_head (Qwen2, Llama)")
    with _full_weight(lm_head.weight):
        weight = _GatherUntilAccumulated.apply(lm_head.weight)
        total = liger_fused_linear_cross_entropy(
            hidden.flatten(0, 1), weight, labels.flatten(), ignore_index=IGNORE, reduction="sum",
            accum_dtype=torch.float32,
        )  # fmt: skip
    return total / label_tokens


class _GatherUntilAccumulated(torch.autograd.Function):
    """The identity on the head weight, whose backward gathers a partitioned ZeRO-3 weight until autograd has
    accumulated its gradient (Liger's gradient has the weight's full shape); without ZeRO-3 a no-op."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (weight,) = ctx.saved_tensors
        with _full_weight(weight, until_accumulated=True):
            return grad


@contextlib.contextmanager
def _full_weight(weight: torch.Tensor, *, until_accumulated: bool = False) -> Iterator[None]:
    """Inside: ``weight`` whole on this rank.

    A partitioned ZeRO-3 parameter is all-gathered over its partition group (a collective: every rank of the group
    computes the loss, so all enter) and partitioned again on exit, or with ``until_accumulated`` only once autograd
    has accumulated its gradient: autograd accumulates a gradient into ``.grad`` *after* the function that produced
    it returned, and shapes it like the parameter (``clone_obey_contract``), which fails against the ``[0]``
    placeholder (ZeRO-3's own linear runs its backward while its module's hooks keep the weight gathered). ZeRO-3's
    gradient hook, registered first, reduce-scatters the full gradient before that release. A weight whole already
    (no ZeRO-3; a persistent or otherwise available ZeRO-3 parameter) is left as it is.
    """
    if not hasattr(weight, "ds_id"):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if weight.ds_status != ZeroParamStatus.NOT_AVAILABLE:
        yield
        return
    weight.all_gather()
    try:
        yield
    except BaseException:
        _release(weight)
        raise
    if not until_accumulated or not weight.requires_grad:
        _release(weight)
        return
    handle = None

    def release(param: torch.Tensor) -> None:
        handle.remove()
        _release(param)

    handle = weight.register_post_accumulate_grad_hook(release)


def _release(weight: torch.Tensor) -> None:
    """Partition a ZeRO-3 parameter this module gathered, unless a module holds it now: a tied embedding's backward
    fetches the same parameter, and its own release partitions it (freeing it under the module raises)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if weight.ds_status == ZeroParamStatus.AVAILABLE and not weight.ds_active_sub_modules:
        weight.partition()


def _tile_rows(tokens: int, vocab: int, shards: int | None) -> int:
    """Tokens per tile: ``tokens / shards`` rounded up, or the most whose fp32 logits fit :data:`TILE_BYTES`."""
    if shards is None:
        shards = math.ceil(tokens * vocab * 4 / TILE_BYTES)
    if shards < 1:
        raise ValueError(f"shards must be at least 1; got {shards}")
    return max(1, math.ceil(tokens / shards))


def _tile_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_tokens: int) -> torch.Tensor:
    """One tile's share: ``hidden`` ``[t, hidden]``, ``labels`` ``[t]`` -> scalar (the dtype of ``sequence_loss``)."""
    return sequence_loss(F.linear(hidden, weight)[None], labels[None], label_tokens)


class _TiledHeadLoss(torch.autograd.Function):
    """``Σ_tiles _tile_loss``: the forward keeps only its inputs; the backward recomputes each tile's logits.

    Tiles run over the flattened ``B * n`` tokens, so a tile of a ``B > 1`` batch is a contiguous row block."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_tokens: int, rows: int
    ) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, labels)
        ctx.label_tokens, ctx.rows = label_tokens, rows
        tiles = zip(hidden.flatten(0, 1).split(rows), labels.flatten().split(rows))
        return torch.stack([_tile_loss(h, weight, y, label_tokens) for h, y in tiles]).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        hidden, weight, labels = ctx.saved_tensors
        # Under ZeRO-3 the saved parameter is a placeholder again: gathered until its gradient is accumulated.
        with _full_weight(weight, until_accumulated=ctx.needs_input_grad[1]):
            return _TiledHeadLoss._backward(ctx, grad, hidden, weight, labels)

    @staticmethod
    def _backward(ctx, grad, hidden, weight, labels) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        grad_hidden = hidden.new_empty(hidden.shape)
        # Summing a bf16 weight's tile gradients in bf16 would round once per tile (75 times at 128K tokens); an fp32
        # sum rounds about as little as the fp32 accumulator of one matmul over all tokens.
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        # A detached weight is a leaf of this function's own graphs: no ZeRO hook fires inside them.
        leaf = weight.detach().requires_grad_()
        tiles = zip(
            hidden.flatten(0, 1).split(ctx.rows),
            labels.flatten().split(ctx.rows),
            grad_hidden.view(-1, hidden.shape[-1]).split(ctx.rows),
        )
        for h, y, out in tiles:
            h = h.detach().requires_grad_()
            with torch.enable_grad():
                loss = _tile_loss(h, leaf, y, ctx.label_tokens)
            grad_h, grad_w = torch.autograd.grad(loss, (h, leaf), grad)
            out.copy_(grad_h)
            grad_weight += grad_w
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
