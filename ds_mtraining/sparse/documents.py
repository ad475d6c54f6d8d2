"""Packed documents: which tokens of a row belong together, so attention never crosses a document boundary.

A row of ``N`` tokens holds contiguous documents. They are carried as one per-token tensor, the position of the first
token of each token's document (``Documents.starts``): the attention test is then a single comparison,
``k >= starts[b, q]``, that needs no search and works as well on a ring shard's rows as on a whole row. For query
``q`` and key ``k`` of row ``b``::

    attend(q, k) = starts[b, q] <= k <= q  and  (the index's own vertical-slash test)

The constructors are vectorised (a comparison and a running maximum), with no loop over documents.
``from_position_ids`` and ``from_document_ids`` never synchronise with the host, so they can run in every layer;
``from_cu_seqlens`` checks its values, which synchronises once (build it where the batch is built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DocumentBlocks", "Documents"]


def _starts_from_flags(is_start: torch.Tensor) -> torch.Tensor:
    """Document starts from a Bool ``[B, N]`` marking each document's first token (token 0 always counts as one)."""
    pos = torch.arange(is_start.shape[-1], device=is_start.device)
    first = is_start.clone()
    first[..., :1] = True
    # A token's document starts at the last flagged position at or before it: a running maximum.
    return torch.where(first, pos, 0).cummax(dim=-1).values


def _check_rows(x: torch.Tensor, name: str, expected: str) -> None:
    """The constructors' shape and dtype check (metadata only: no host sync)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.is_floating_point() or x.is_complex():
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"Documents.{name}: expected an integer tensor {expected}; got {got}")


@dataclass(frozen=True)
class DocumentBlocks:
    """The documents seen from the tile grid of ``block_size`` rows (``Documents.blocks``), ``nb = ceil(N / bs)``.

    Starts never decrease and a start is at most its row, so every row of query block ``i`` whose document starts
    before the block starts it where the block's first row does, at ``first[b, i]``. Only those *carried* rows
    attend keys outside the block's diagonal tile; every other row's document starts inside the block.

    Attributes:
        first: LongTensor ``[B, nb]``, the start of the document of each block's first row (non-decreasing).
        carried: float64 ``[B, nb]``, rows of block ``i`` in the document carried in from before it (those whose
            start is ``first[b, i] < i · bs``; 0 when the first row starts a document). Integer-valued.
        diagonal: float64 ``[B, nb]``, in-document causal entries of each block's diagonal tile: row ``r`` keeps
            keys ``max(starts[b, r], i · bs) .. r``. Integer-valued.
    """

    first: torch.Tensor
    carried: torch.Tensor
    diagonal: torch.Tensor


@dataclass(frozen=True)
class Documents:
    """The documents packed into each row, as the start of every token's document.

    Attributes:
        starts: LongTensor ``[B, N]``: ``starts[b, i]`` is the position of the first token of token ``i``'s
            document. Valid (``validate``) when ``starts[b, 0] == 0`` and every ``starts[b, i]`` is ``i`` (a new
            document) or ``starts[b, i - 1]`` (the same one); it is then non-decreasing and ``<= i``.

    One row with a single document (``starts == 0``) is plain causal attention.
    """

    starts: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.starts, torch.Tensor) or self.starts.dtype != torch.long or self.starts.dim() != 2:
            s = self.starts
            got = f"{s.dtype} tensor of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"Documents.starts must be a LongTensor [B, N]; got {got}")

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> Documents:
        """Documents from packed position ids ``[B, N]`` (integer): a document starts at token 0 and wherever a
        position id is not its predecessor's plus one.

        This is transformers' rule for packed rows (``masking_utils.find_packed_sequence_indices``): ids restarting
        at 0 (``DataCollatorWithFlattening``) and ids of models whose positions start elsewhere both work, and every
        input gives valid documents. No host sync.
        """
        _check_rows(position_ids, "from_position_ids", "[B, N] of position ids")
        is_start = torch.ones_like(position_ids, dtype=torch.bool)
        is_start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        return cls(_starts_from_flags(is_start))

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor) -> Documents:
        """Documents from per-token document ids ``[B, N]`` (integer; ``data.packing.PackedSequences.documents``):
        a document starts wherever the id changes. No host sync."""
        _check_rows(document_ids, "from_document_ids", "[B, N] of document ids")
        is_start = torch.ones_like(document_ids, dtype=torch.bool)
        is_start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        return cls(_starts_from_flags(is_start))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, seqlen: int) -> Documents:
        """Documents from cumulative document lengths, flash-attention's ``cu_seqlens``.

        Args:
            cu_seqlens: integer ``[D + 1]`` for one row (flash-attention's varlen form, and transformers'
                ``cu_seq_lens_q`` of a flattened batch), or ``[B, D + 1]`` with one row each: ``0 = c_0 <= c_1 <= ...
                <= c_D = seqlen``, document ``d`` being tokens ``[c_d, c_{d+1})``. Rows with fewer documents repeat
                ``seqlen`` at the end (empty documents are allowed anywhere).
            seqlen: tokens per row ``N``.

        Raises ValueError naming the first bad entry (this reads the values: one host sync).
        """
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
            cu_seqlens = cu_seqlens[None]
        _check_rows(cu_seqlens, "from_cu_seqlens", "[D + 1] or [B, D + 1] of cumulative lengths")
        cu = cu_seqlens.long()
        problems = (
            (cu[:, 0] != 0, "must start at 0"),
            (cu[:, -1] != seqlen, f"must end at seqlen={seqlen}"),
            (cu[:, 1:] < cu[:, :-1], "must not decrease"),
        )
        for bad, rule in problems:
            if bad.any():
                row = int(bad.nonzero()[0, 0])
                raise ValueError(f"Documents.from_cu_seqlens: row {row} ({cu[row].tolist()}) {rule}")
        pos = torch.arange(seqlen, device=cu.device).expand(cu.shape[0], seqlen).contiguous()
        # Token i is in the last document whose start is <= i (right=True steps over empty documents).
        doc = torch.searchsorted(cu, pos, right=True) - 1
        return cls(cu.gather(-1, doc))

    @property
    def batch(self) -> int:
        return self.starts.shape[0]

    @property
    def seqlen(self) -> int:
        return self.starts.shape[1]

    @property
    def device(self) -> torch.device:
        return self.starts.device

    def check_rows(self, batch: int, seqlen: int, what: str, device: torch.device | None = None) -> None:
        """Check that these documents are for ``batch`` rows of ``seqlen`` tokens, ``starts`` ``[batch, seqlen]``
        (and on ``device``, if given); raises ValueError naming the mismatch and the fix.

        Args:
            batch: rows ``B`` of the tensor the documents go with.
            seqlen: tokens per row ``N``: the whole rows' length (a ring shard's caller passes the global one).
            what: the caller and that tensor, as the error names them (e.g. ``"vertical_slash_attention's q"``).
            device: where ``starts`` must be; ``None`` skips the check.

        Metadata only: no host sync, so every layer can call it.
        """
        if (self.batch, self.seqlen) != (batch, seqlen):
            raise ValueError(
                f"documents are [B, N] = [{self.batch}, {self.seqlen}] but {what} has batch={batch}, "
                f"seqlen={seqlen}: build the Documents from the same rows (Documents.from_position_ids(position_ids))"
            )
        if device is not None and self.device != device:
            raise ValueError(
                f"documents are on {self.device} but {what} is on {device}: move them there "
                "(Documents(documents.starts.to(device)))"
            )

    def validate(self) -> None:
        """Check the invariants of ``starts`` (synchronises with the host); raises ValueError naming the first bad
        token."""
        pos = torch.arange(self.seqlen, device=self.device)
        before = torch.cat([self.starts.new_zeros(self.batch, 1), self.starts[:, :-1]], dim=-1)
        bad = (self.starts != pos) & ((self.starts != before) | (pos == 0))
        if bad.any():
            b, i = (int(x) for x in bad.nonzero()[0])
            expected = "0" if i == 0 else f"{i} (a new document) or starts[{b}, {i - 1}] = {int(before[b, i])}"
            raise ValueError(f"Documents.starts[{b}, {i}] = {int(self.starts[b, i])}: expected {expected}")

    def causal_entries(self) -> torch.Tensor:
        """In-document causal entries of each row, ``Σ_documents L (L + 1) / 2``: float64 ``[B]``, exact (an int64
        sum over the rows: row ``q`` has ``q - starts[q] + 1`` keys). No host sync."""
        pos = torch.arange(self.seqlen, device=self.device)
        return (pos - self.starts + 1).sum(-1).double()

    def blocks(self, block_size: int) -> DocumentBlocks:
        """The documents per query block of ``block_size`` rows (:class:`DocumentBlocks`); O(B · N), vectorised,
        no host sync. The rows past ``N`` in a partial last block are not counted."""
        b, n, bs = self.batch, self.seqlen, block_size
        nb = -(-n // bs)
        block = torch.arange(nb, device=self.device)
        first = self.starts[:, block * bs]  # [B, nb]
        # Pad the rows to whole blocks (with the last start, then masked out) so each block is one row of a view.
        padded = torch.cat([self.starts, self.starts[:, -1:].expand(b, nb * bs - n)], 1).view(b, nb, bs)
        rows = torch.arange(nb * bs, device=self.device).view(nb, bs)
        real = rows < n
        carried = ((padded == first[..., None]) & real).sum(-1).double() * (first < block * bs)
        row_start = torch.maximum(padded, (block * bs)[None, :, None])
        diagonal = torch.where(real, rows - row_start + 1, 0).sum(-1).double()
        return DocumentBlocks(first, carried, diagonal)

    def mask(self) -> torch.Tensor:
        """Causal attention inside each document: BoolTensor ``[B, N, N]`` (query, key). Reference and CPU only."""
        pos = torch.arange(self.seqlen, device=self.device)
        return (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] >= self.starts[:, :, None])

    def __repr__(self) -> str:
        return f"Documents(batch={self.batch}, seqlen={self.seqlen}, device={self.device})"
