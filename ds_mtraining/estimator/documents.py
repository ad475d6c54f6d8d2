"""What the estimator reads from packed documents: the observation rows' document starts and every document's sinks.

A row attends only inside its document (``sparse.documents``), so its observation scores are masked there
(``observe.visible``), and every document keeps its attention sink: the first ``sink_tokens`` tokens of each
document are forced columns, like the whole row's sinks ``0 .. sink_tokens - 1`` (which are the first document's).
A document no longer than the forced local band (``max(local_blocks, 1) * block_size`` tokens) gets no sink column:
its queries reach most of it through the local tiles. That bounds the sink columns statically (no host sync):
a row holds at most ``N // (band + 1)`` longer documents. They are also capped at ``limit`` (the estimator's column
budget ``max_columns``) beyond the row's own sinks: with more, the longest documents keep their sinks (ties: the
earlier document), since a long document's queries lose the most without theirs; the others' queries keep what
the greedy finds for them and the local tiles.
"""

from __future__ import annotations

import torch

from ds_mtraining.sparse.index import PAD

__all__ = ["document_ends", "document_sinks", "sink_width"]


def document_ends(starts: torch.Tensor) -> torch.Tensor:
    """One past the last token of each token's document: LongTensor like ``starts`` ``[B, N]`` (valid
    ``Documents.starts``). A reverse running minimum of the next document's start, no loop over documents."""
    n = starts.shape[-1]
    pos = torch.arange(n, device=starts.device)
    # The next start after token j is the first position > j that starts a document (N past the last one).
    begins = torch.where(starts == pos, pos, n)
    after = torch.cat([begins[:, 1:], begins.new_full((starts.shape[0], 1), n)], dim=-1)
    return after.flip(-1).cummin(dim=-1).values.flip(-1)


def sink_width(seqlen: int, sink_tokens: int, block_size: int, local_blocks: int, limit: int) -> int:
    """Slots :func:`document_sinks` returns per row: ``sink_tokens`` for each document that can be longer than the
    local band, at most ``limit``."""
    band = max(local_blocks, 1) * block_size
    return max(0, min(limit, sink_tokens * (seqlen // (band + 1)), seqlen))


def document_sinks(
    starts: torch.Tensor, sink_tokens: int, block_size: int, local_blocks: int, limit: int
) -> torch.Tensor:
    """The sink columns of the documents after each row's first: LongTensor ``[B, sink_width(...)]``, -1 padded.

    Args:
        starts: ``Documents.starts`` ``[B, N]``.
        sink_tokens: sinks per document (the whole row's ``0 .. sink_tokens - 1`` are forced elsewhere).
        block_size, local_blocks: the index's tiles; documents of at most ``max(local_blocks, 1) * block_size``
            tokens get none, nor a sink that every query of its document reaches through the forced offsets.
        limit: most sink columns a row gets here (the estimator's column budget, ``max_columns``).

    With one document a row the result is all -1 (padding slots only): the index is the one without documents.
    """
    n = starts.shape[-1]
    pos = torch.arange(n, device=starts.device)
    ends = document_ends(starts)
    length = ends - starts
    sink = (pos >= sink_tokens) & (pos - starts < sink_tokens) & (length > max(local_blocks, 1) * block_size)
    # The document's last query (ends - 1) reaches key j through a forced tile when its block offset is below
    # max(local_blocks, 1); then every earlier query of the document does too.
    far = (ends - 1) // block_size - pos // block_size >= max(local_blocks, 1)
    # Longest document first, then the earlier position: a distinct integer key per token, ranked by topk.
    priority = torch.where(sink & far, length * (n + 1) + (n - pos), -1)
    top = priority.topk(sink_width(n, sink_tokens, block_size, local_blocks, limit), dim=-1)
    return torch.where(top.values >= 0, top.indices, PAD)
