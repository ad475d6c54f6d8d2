"""The data path of a training step: token sequences -> this rank's model inputs, and the sequence loss.

Labels are shifted once on the whole sequence (``labels[i] = tokens[i + 1]``, the last ``-100``), *before* any
sharding, so a shard's labels stay with their inputs wherever the layout puts them; the model is called without
labels and the loss is computed here. With sequence parallelism the ids are padded with the pad id, labels with
``-100`` and position ids continue past the end (padding is after every real token, so causal attention never
lets a real token see it), then cut with the mesh's layout: each rank gets ``Layout.local_len / U`` tokens and
their true global positions (RoPE).

Packed documents (``mtraining.data.document_masking``; docs/design.md, "Packed documents"): given the per-token
document ids, the position ids restart at 0 at each document's first token and at the row's first token, a label
whose target lies in the next document is ``-100``, and the batch carries the whole rows' ``Documents`` for the
attention (a shard's position ids do not mark documents: the ring needs the whole rows'). The separator belongs to the document it ends (``data.packing``): the last real
token learns to predict it, and the separator itself predicts nothing, since what follows is unrelated text. Both
are computed on the whole sequence, before sharding, like the labels.

Loss: every rank returns ``(sum of its tokens' cross-entropy) / (label tokens in the whole sequence)``. Summed
over the sequence-parallel group that is the single-process token mean, and so are the gradients: DeepSpeed
sums gradients over the SP ranks (it averages over DP x SP and multiplies back by SP, see
``integration/deepspeed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data.packing import position_ids
from ..parallel.layout import Layout
from ..parallel.mesh import Mesh, MeshCoordinates
from ..sparse.documents import Documents

IGNORE = -100
"""Label of positions without a target (the last token, padding, a packed document's last token)."""


@dataclass(frozen=True)
class Batch:
    """Model inputs of one micro-batch on this rank.

    Attributes:
        input_ids, labels, position_ids: LongTensor ``[B, n]`` (``n`` = this rank's tokens); with packed documents
            the position ids restart at each document, which is how the attention finds them.
        label_tokens: label tokens of the whole sequence (all ranks), the loss's denominator.
        layout: the layout the tokens were cut with (``None`` without sequence parallelism).
        documents: the packed documents of the whole rows (``[B, N]``, the same on every rank; ``None``: each row
            is one sequence), which the forward hands the attention (``integration.loss.forward_loss``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    label_tokens: int
    layout: Layout | None = None
    documents: Documents | None = None

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def make_batch(
    tokens: torch.Tensor,
    *,
    mesh: Mesh | MeshCoordinates | None,
    layout: Layout | None,
    pad_id: int,
    documents: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> Batch:
    """``tokens`` ``[B, N]`` (the whole sequences, identical on every rank of a sequence-parallel group) -> this
    rank's :class:`Batch`, cut by ``mesh`` (or its picklable ``coordinates``); ``mesh``/``layout`` ``None`` keeps
    the whole sequence. ``documents``: integer ``[B, N]``, each token's document id (``PackedSequences.documents``),
    to keep positions and labels inside the documents; ``None``: each row is one sequence. ``labels``: integer
    ``[B, N]``, the targets unshifted (transformers' convention: position t's label is what t - 1 predicts;
    ``IGNORE`` masks one, e.g. a prompt); ``None``: the tokens, every next token a target."""
    b, n = tokens.shape
    if labels is not None and labels.shape != tokens.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match tokens {tuple(tokens.shape)}: one a token")
    targets = tokens if labels is None else labels.to(tokens.dtype)
    labels = torch.cat([targets[:, 1:], tokens.new_full((b, 1), IGNORE)], dim=1)
    rows = None
    if documents is None:
        positions = torch.arange(n).expand(b, n)
    else:
        if documents.shape != tokens.shape:
            raise ValueError(
                f"documents {tuple(documents.shape)} must match tokens {tuple(tokens.shape)}: one id a token"
            )
        positions = position_ids(documents)
        labels[:, :-1].masked_fill_(documents[:, 1:] != documents[:, :-1], IGNORE)
        rows = Documents.from_document_ids(documents.long())
    label_tokens = int((labels != IGNORE).sum())
    if mesh is None or mesh.sp_size == 1:
        return Batch(tokens, labels, positions, label_tokens, documents=rows)
    if layout is None or layout.seqlen != n:
        raise ValueError(f"a sequence-parallel batch of {n} tokens needs its layout (got {layout})")
    pad = layout.padded_len - n
    ids = torch.cat([tokens, tokens.new_full((b, pad), pad_id)], dim=1)
    labels = torch.cat([labels, labels.new_full((b, pad), IGNORE)], dim=1)
    # The padding continues the last sequence's positions: it comes after every real token, so no real token sees it.
    positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(pad)], dim=1)
    ids, labels, positions = (mesh.shard(x, layout) for x in (ids, labels, positions))
    return Batch(ids.contiguous(), labels.contiguous(), positions.contiguous(), label_tokens, layout, rows)


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor, label_tokens: int) -> torch.Tensor:
    """This rank's share of the token-mean cross-entropy: ``Σ_local CE / label_tokens`` (fp32, or fp64 logits' fp64)."""
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum") / label_tokens
