"""``AttentionPattern``: which keys each query attends, the one object every attention entry point takes.

For rows of ``seqlen`` tokens, query ``q`` of row ``b`` and head ``h`` attends key ``k`` iff::

    k <= q                                         (causal)
    and k >= documents.starts[b, q]                (inside the query's document; with documents)
    and the index attends (q, k) for head h        (with an index: VerticalSlashIndex's vertical-slash test)

A pattern without an index is dense causal attention (inside the documents); one without documents treats each row
as one sequence. It plays the part of FlexAttention's ``BlockMask`` (``torch/nn/attention/flex_attention.py``): the
one-device attention, the naive reference, the masked fallback, the ring, the estimator, the density, the dense
mask, the ring's work model and the balancing simulator all take it, so a pattern feature is added here and in the
kernels, not in every signature. The index's kernel form is built on first use and cached on the index
(``kernel_index``), so the forward, the backward, every ring step, an activation checkpoint's recomputation and every
pattern over the same index share one conversion; the index must not be changed in place after that. The documents
reach the kernels as their starts (per launch a cast and an O(B · N / bs) search, ``sparse.triton.document_tiles``).
The dk/dv pass reads the same form by key tile, so there is no transposed copy to keep (FlexAttention's
``BlockMask`` keeps one because its kernels walk explicit block lists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .documents import Documents
from .index import VerticalSlashIndex, index_to_dense_mask

if TYPE_CHECKING:
    from .triton.kernel_index import KernelIndex

__all__ = ["AttentionPattern"]


@dataclass(frozen=True, eq=False)
class AttentionPattern:
    """Which keys each query attends over rows of ``seqlen`` tokens; see the module docstring.

    Attributes:
        seqlen: tokens per row ``N`` (on a ring, the whole rows' length, not a shard's).
        index: the vertical-slash index ``[B, Hq, ·]`` (block offsets in ``index.block_size`` tiles), or ``None``
            for dense causal attention.
        documents: the packed documents of each row (``Documents`` ``[B, N]``), or ``None`` for one sequence a row.

    The constructor checks shapes and devices only (no host sync); :meth:`validate` checks the values.
    """

    seqlen: int
    index: VerticalSlashIndex | None = None
    documents: Documents | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seqlen, int) or isinstance(self.seqlen, bool) or self.seqlen <= 0:
            raise ValueError(f"AttentionPattern.seqlen must be a positive int; got {self.seqlen!r}")
        if self.index is not None and not isinstance(self.index, VerticalSlashIndex):
            raise ValueError(
                f"AttentionPattern.index must be a VerticalSlashIndex or None; got {type(self.index).__name__}"
            )
        if self.documents is None:
            return
        if not isinstance(self.documents, Documents):
            raise ValueError(
                f"AttentionPattern.documents must be a Documents (sparse.documents) or None; got "
                f"{type(self.documents).__name__}"
            )
        if self.documents.seqlen != self.seqlen:
            raise ValueError(
                f"documents are for rows of {self.documents.seqlen} tokens but the pattern's seqlen is {self.seqlen}: "
                "build the Documents from the same (whole) rows"
            )
        if self.index is not None:
            self.documents.check_rows(self.index.batch, self.seqlen, "the pattern's index", self.index.device)

    @property
    def block_size(self) -> int | None:
        """The index's tile size, ``None`` for a dense pattern."""
        return None if self.index is None else self.index.block_size

    def with_index(self, index: VerticalSlashIndex | None) -> AttentionPattern:
        """This pattern's length and documents with ``index`` (an estimate's result)."""
        return AttentionPattern(self.seqlen, index, self.documents)

    def check(self, batch: int, heads: int, device: torch.device, what: str) -> None:
        """Check that this pattern fits ``batch`` rows and ``heads`` query heads on ``device``; raises ValueError
        naming ``what`` (the caller and its tensor) and the fix. Metadata only: no host sync."""
        if self.documents is not None:
            self.documents.check_rows(batch, self.seqlen, what, device)
        if self.index is None:
            return
        if (self.index.batch, self.index.heads) != (batch, heads):
            raise ValueError(
                f"the pattern's index is for batch={self.index.batch}, heads={self.index.heads} but {what} has "
                f"batch={batch}, query heads={heads}; the index is per query head"
            )
        if self.index.device != device:
            raise ValueError(f"the pattern's index is on {self.index.device} but {what} is on {device}; move it")

    def validate(self) -> None:
        """Check the index's entries against ``seqlen`` and the documents' starts (``VerticalSlashIndex.validate``,
        ``Documents.validate``); synchronises with the host. Raises ValueError naming the first bad entry."""
        if self.index is not None:
            self.index.validate(self.seqlen)
        if self.documents is not None:
            self.documents.validate()

    def kernel_index(self, seqlen: int | None = None) -> KernelIndex:
        """The index in the Triton kernels' form for ``seqlen`` tokens (default: the pattern's; a ring passes its
        padded length), converted once (``VerticalSlashIndex.kernel_index``). Needs an index and Triton."""
        if self.index is None:
            raise ValueError("a dense pattern has no kernel index")
        return self.index.kernel_index(self.seqlen if seqlen is None else seqlen)

    def starts_on(self, positions: torch.Tensor | None, padded_len: int | None = None) -> torch.Tensor | None:
        """The document starts of the query rows at global ``positions`` (LongTensor ``[n]``, e.g.
        ``Layout.positions_on``; ``None``: every row in order): LongTensor ``[B, n]`` of global positions, or
        ``None`` without documents. Rows past ``seqlen`` (a layout's padding, up to ``padded_len``) start their own
        document: they attend only themselves. No host sync."""
        if self.documents is None or positions is None:
            return None if self.documents is None else self.documents.starts
        docs = self.documents.starts
        pad = torch.arange(self.seqlen, padded_len or self.seqlen, device=docs.device).expand(docs.shape[0], -1)
        return torch.cat([docs, pad], dim=1)[:, positions.to(docs.device)]

    def dense_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """The pattern as a BoolTensor ``[B, Hq, N, N]`` (query, key): a dense pattern's is ``[B, 1, N, N]`` (``[1, 1,
        N, N]`` on ``device`` without documents). Reference and tests only: O(N²) memory."""
        n = self.seqlen
        if self.index is not None:
            mask = index_to_dense_mask(self.index, n)
            return mask if self.documents is None else mask & self.documents.mask()[:, None]
        if self.documents is not None:
            return self.documents.mask()[:, None]
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]

    def density(self) -> torch.Tensor:
        """Fraction of the causal entries attended, per head: float64 ``[B, Hq]``, exact, no host sync.

        Without documents, of the ``N (N + 1) / 2`` causal entries (``VerticalSlashIndex.density``). With documents,
        of the in-document causal entries ``Σ_documents L (L + 1) / 2`` of each row, the share the index attends
        inside them (:meth:`dense_mask`), so that it compares with whole sequences and with the kernels' work
        (``parallel.work``); one document a row gives the value without documents, bit for bit. Vectorised, no
        loop over documents, no N x N mask (see ``_document_density``). Needs an index (a dense pattern's is 1).
        """
        if self.index is None:
            raise ValueError("a dense pattern attends every causal entry: its density is 1 by definition")
        if self.documents is None:
            return self.index.density(self.seqlen)
        return _document_density(self.index, self.seqlen, self.documents)

    def __repr__(self) -> str:
        docs = "none" if self.documents is None else f"[{self.documents.batch}, {self.documents.seqlen}]"
        return f"AttentionPattern(seqlen={self.seqlen}, index={self.index!r}, documents={docs})"


def _document_density(index: VerticalSlashIndex, seqlen: int, documents: Documents) -> torch.Tensor:
    """:meth:`AttentionPattern.density` inside ``documents``: float64 ``[B, Hq]``.

    Per query block ``i`` (``Documents.blocks``): the diagonal tile (offset 0, always chosen) holds every in-document
    causal entry of its rows, and only the ``carried[i]`` rows of the document that starts before the block, at
    ``s = first[i]`` in block ``sb = s // bs``, attend anything else (keys ``s .. i·bs - 1``):
    - slash tiles: the chosen offsets ``1 .. i - sb - 1`` are whole key tiles inside the document (``bs`` keys a
      row); offset ``i - sb``, if chosen, is the tile holding ``s``: its keys ``s .. (sb + 1)·bs - 1``.
    - a column ``c`` (block ``cb``) is attended by the query blocks ``cb + 1 .. last`` whose first row is in its
      document (``last``: the last block whose ``first <= c``, a binary search of the non-decreasing ``first``),
      where the offset ``i - cb`` is not chosen. The blocks before ``last`` lie wholly in the document (``bs`` rows
      each), block ``last`` with its ``carried[last]`` rows.
    Counts of chosen offsets come from one prefix sum of the offset mask, so it is O(B · Hq · (nb + Kv · log nb))
    beside the blocks' O(B · N). Every count is an integer held in float64: the sums are exact.
    """
    bs, nb, heads, batch = index.block_size, index.num_blocks(seqlen), index.heads, index.batch
    blocks = documents.blocks(bs)
    first, carried = blocks.first, blocks.carried  # [B, nb]
    chosen = index.offset_mask(seqlen).double()  # [B, H, nb]
    # chosen_upto[..., m]: chosen offsets in 1 .. m (offset 0, the diagonal, counted apart).
    chosen_upto = chosen.cumsum(-1) - chosen[..., :1]

    def at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """``x [B, H, nb]`` at the offsets ``i [B, ·, M]`` (broadcast over heads): ``[B, H, M]``."""
        return x.gather(-1, i.expand(-1, heads, -1))

    start_block = first // bs
    gap = (torch.arange(nb, device=index.device) - start_block)[:, None]  # [B, 1, nb]; 0 where none is carried
    edge_keys = ((start_block + 1) * bs - first)[:, None].double()  # keys of the tile holding the start
    per_row = bs * at(chosen_upto, (gap - 1).clamp(min=0)) + edge_keys * at(chosen, gap)
    slash = (carried[:, None] * per_row).sum(-1)

    valid = index.vertical >= 0
    column = index.vertical.clamp(min=0)  # [B, H, Kv]
    flat = column.reshape(batch, -1)
    last = (torch.searchsorted(first.contiguous(), flat, right=True) - 1).view_as(column)
    reach = last - column // bs  # the column's document reaches offsets 1 .. reach
    inner = (reach - 1).clamp(min=0)  # offsets of the query blocks wholly inside the document
    unchosen = inner - chosen_upto.gather(-1, inner)
    edge_rows = carried.gather(-1, last.reshape(batch, -1)).view_as(column)
    count = bs * unchosen + edge_rows * (1.0 - chosen.gather(-1, reach.clamp(min=0)))
    columns = torch.where(valid & (reach >= 1), count, 0.0).sum(-1)

    attended = blocks.diagonal.sum(-1)[:, None] + slash + columns
    return attended / documents.causal_entries()[:, None]
