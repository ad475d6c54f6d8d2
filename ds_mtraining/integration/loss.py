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

Not for ZeRO-3: there the head weight is a partitioned placeholder outside the head's own forward.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .batch import sequence_loss

if TYPE_CHECKING:
    from .batch import Batch
    from .transformers import MTrainingAttention

__all__ = ["TILE_BYTES", "forward_loss", "tiled_sequence_loss"]

TILE_BYTES = 1 << 30
"""Budget of one tile's fp32 logits: 1 GiB (ArcticTraining's choice for tiled logits). The backward holds about four
tile-sized buffers at once (the logits, their fp32 copy, the log-softmax and its gradient), whatever the sequence
length: on an H200, hidden 896 and 151,936 ids in bf16, the loss's forward and backward peaked at 3.95 GiB for 128K
tokens (75 tiles), against 27.8 GiB for the full logits of 16K tokens."""


def forward_loss(
    model: nn.Module, batch: Batch, attention: MTrainingAttention, *, shards: int | None = None
) -> torch.Tensor:
    """This rank's loss of ``batch``, equal to ``sequence_loss(model(...).logits, labels, label_tokens)`` but without
    ``[B, n, vocab]`` logits.

    ``model``: a DeepSpeed engine or a transformers causal LM. The engine is called as a whole, so its own forward
    runs with the hooks it puts on its outputs (ZeRO's backward prologue fires when the gradient reaches the hidden
    states). The model returns the final-norm hidden states as ``hidden_states[-1]`` (transformers puts
    ``last_hidden_state`` there; ``-1`` asks for that one only, older versions return them all) and, with
    ``logits_to_keep`` an empty slice, ``[B, 0, vocab]`` logits.

    Returns:
        a scalar, fp32 (fp64 for an fp64 model), on the model's device.
    """
    device = model.device
    out = model(
        batch.input_ids.to(device),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
        mtraining=attention,
        logits_to_keep=slice(0, 0),
        output_hidden_states=-1,
    )
    head = getattr(model, "module", model).get_output_embeddings()  # a DeepSpeed engine holds the model as .module
    return tiled_sequence_loss(out.hidden_states[-1], head, batch.labels.to(device), batch.label_tokens, shards=shards)


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
    return _TiledHeadLoss.apply(hidden, lm_head.weight, labels, label_tokens, rows)


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
