"""The vertical-slash index: the one contract between estimator, kernels, ring and tests.

For batch ``b`` and query head ``h`` with block size ``bs``::

    attend(q, k) = (k <= q) and (k in vertical[b, h] or (q // bs - k // bs) in slash[b, h])

``vertical`` holds key *token* positions, ``slash`` holds *block* offsets. Both are padded with -1. The index
is kept in a canonical form by construction: every row sorted ascending with unique entries and the -1
padding at the end, and offset 0 (the local diagonal tile) always present in ``slash``. Canonicalisation is
vectorised and stays on the tensors' device, so building an index never synchronises with the host.

Packed documents (``sparse.documents``) narrow the test to keys of the query's own document; the index itself
does not change: ``sparse.pattern.AttentionPattern`` carries the two together (docs/design.md, "Packed documents").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .backends import triton_kernels, uses_triton

if TYPE_CHECKING:
    from .triton.kernel_index import KernelIndex

PAD = -1


def _canonical_rows(x: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending, drop duplicates, move -1 padding to the end. ``x``: LongTensor ``[..., K]``."""
    big = torch.iinfo(torch.long).max
    x = torch.where(x < 0, big, x).sort(dim=-1).values
    keep = x != big
    keep[..., 1:] &= x[..., 1:] != x[..., :-1]
    return _compact_rows(x, keep)


def _compact_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The ``keep`` entries of each row moved to the front in order, -1 after them. ``x``: LongTensor ``[..., K]``.

    A prefix count, not a sort: the dropped entries land in a spare last slot that is cut off.
    """
    width = x.shape[-1]
    slot = torch.where(keep, keep.cumsum(-1) - 1, width)
    out = torch.full((*x.shape[:-1], width + 1), PAD, dtype=x.dtype, device=x.device)
    return out.scatter_(-1, slot, torch.where(keep, x, PAD))[..., :width].contiguous()


@dataclass(frozen=True)
class VerticalSlashIndex:
    """Per (batch, query head) vertical columns and slash block offsets; see the module docstring.

    Attributes:
        vertical: LongTensor ``[B, Hq, Kv]``, key token positions, padded with -1 (``Kv`` may be 0).
        slash: LongTensor ``[B, Hq, Ks]``, non-negative block offsets, padded with -1; always contains 0.
        block_size: tile size ``bs`` the slash offsets refer to.

    Construct with :meth:`build`, which canonicalises (sorts, de-duplicates, adds offset 0); the
    constructor only checks that its inputs already have that form's shapes and dtypes.
    """

    vertical: torch.Tensor
    slash: torch.Tensor
    block_size: int
    # Kernel forms by tile count (``kernel_index``): built on first use, shared by every later call on this index.
    _kernel_forms: dict[int, KernelIndex] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vertical", "slash"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 3:
                got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"VerticalSlashIndex.{name} must be a LongTensor [B, Hq, K]; got {got}")
        if self.vertical.shape[:2] != self.slash.shape[:2]:
            raise ValueError(
                f"VerticalSlashIndex: vertical {tuple(self.vertical.shape)} and slash {tuple(self.slash.shape)} "
                "must agree on [B, Hq]"
            )
        if self.slash.shape[-1] == 0:
            raise ValueError("VerticalSlashIndex.slash needs at least one entry (offset 0); use build()")
        if self.vertical.device != self.slash.device:
            raise ValueError(f"vertical is on {self.vertical.device} but slash is on {self.slash.device}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"VerticalSlashIndex.block_size must be a positive int; got {self.block_size!r}")

    @classmethod
    def build(
        cls, vertical: torch.Tensor, slash: torch.Tensor, block_size: int, *, ascending: bool = False
    ) -> VerticalSlashIndex:
        """Canonical index from any -1-padded ``vertical [B, Hq, Kv]`` and ``slash [B, Hq, Ks]``.

        Rows may be unsorted and hold duplicates; offset 0 is added to every slash row (one more slot).

        ``ascending=True`` is the caller's promise that the rows are already ascending and distinct apart from
        -1 holes, and that every slash row holds offset 0 (what a selection over sorted candidates produces):
        the holes are squeezed out without the sort, the widths are kept. Like ``torch.sparse_coo_tensor``'s
        ``is_coalesced``, it is not checked (that would synchronise with the host); a broken promise gives an
        invalid index (``validate`` finds it).
        """
        vertical = torch.as_tensor(vertical, dtype=torch.long)
        slash = torch.as_tensor(slash, dtype=torch.long, device=vertical.device)
        if ascending:
            return cls(_compact_rows(vertical, vertical >= 0), _compact_rows(slash, slash >= 0), block_size)
        zero = torch.zeros(*slash.shape[:-1], 1, dtype=torch.long, device=slash.device)
        return cls(_canonical_rows(vertical), _canonical_rows(torch.cat([zero, slash], dim=-1)), block_size)

    def with_columns(self, columns: torch.Tensor) -> VerticalSlashIndex:
        """This index with the -1-padded ``columns [B, Hq, K]`` added to its vertical set (the slash set kept);
        the vertical rows widen by ``K``. On CUDA a Triton merge into the canonical rows (one launch), elsewhere a
        sort of the concatenation."""
        if columns.dim() != 3 or columns.shape[:2] != self.vertical.shape[:2]:
            raise ValueError(
                f"with_columns: columns must be [B, Hq, K] = [{self.batch}, {self.heads}, K] like the index; got "
                f"{tuple(columns.shape)}"
            )
        columns = columns.to(self.vertical.dtype)
        if uses_triton(self.device):
            vertical = triton_kernels().columns.merge_columns(self.vertical, columns)
        else:
            vertical = _canonical_rows(torch.cat([self.vertical, columns], dim=-1))
        return VerticalSlashIndex(vertical, self.slash, self.block_size)

    def keep_columns(self, keep: torch.Tensor) -> VerticalSlashIndex:
        """This index with only the columns where ``keep`` (Bool ``[B, Hq, Kv]``, like ``vertical``) holds: canonical
        rows of the same width, the slash set shared; device ops only, no host sync."""
        if keep.shape != self.vertical.shape:
            raise ValueError(
                f"keep_columns: keep must be [B, Hq, Kv] {tuple(self.vertical.shape)}; got {tuple(keep.shape)}"
            )
        big = torch.iinfo(torch.long).max
        vertical = torch.where(keep & (self.vertical >= 0), self.vertical, big).sort(-1).values
        return VerticalSlashIndex(torch.where(vertical == big, -1, vertical), self.slash, self.block_size)

    @classmethod
    def dense(cls, batch: int, heads: int, seqlen: int, block_size: int, device=None) -> VerticalSlashIndex:
        """The index that attends every causal entry (all block offsets, no columns)."""
        nblocks = -(-seqlen // block_size)
        slash = torch.arange(nblocks, device=device).expand(batch, heads, nblocks).contiguous()
        vertical = torch.empty(batch, heads, 0, dtype=torch.long, device=device)
        return cls(vertical, slash, block_size)

    @property
    def batch(self) -> int:
        return self.vertical.shape[0]

    @property
    def heads(self) -> int:
        return self.vertical.shape[1]

    @property
    def device(self) -> torch.device:
        return self.vertical.device

    def num_blocks(self, seqlen: int) -> int:
        return -(-seqlen // self.block_size)

    def kernel_index(self, seqlen: int) -> KernelIndex:
        """This index in the Triton kernels' per-tile form for ``seqlen`` tokens (the global length when the calls
        run on ring shards): built once per tile count and cached here, so the forward, the backward, every ring step
        and an activation checkpoint's recomputation share one conversion (as ``BlockMask`` keeps its kernel form).

        Device ops only, no host sync (``sparse.triton.kernel_index.prepare_index``). The index's tensors must not
        be changed in place after the first call. Needs Triton installed (only its kernels read this form).
        """
        nb = self.num_blocks(seqlen)
        form = self._kernel_forms.get(nb)
        if form is None:
            # Importing sparse.triton imports Triton: on first use, so CPU-only installs can import this module.
            from .triton.kernel_index import prepare_index

            form = self._kernel_forms[nb] = prepare_index(self, seqlen)
        return form

    def validate(self, seqlen: int) -> None:
        """Check the entries against a sequence of ``seqlen`` tokens (synchronises with the host).

        Raises ValueError naming the offending entry when a column is outside ``[0, seqlen)``, an offset
        is outside ``[0, ceil(seqlen / block_size))``, or the rows are not in canonical form.
        """
        if _canonical_rows(self.vertical).ne(self.vertical).any() or _canonical_rows(self.slash).ne(self.slash).any():
            raise ValueError("VerticalSlashIndex rows are not canonical (sorted, unique, -1 last); use build()")
        if self.slash[..., 0].ne(0).any():
            raise ValueError("VerticalSlashIndex.slash must contain offset 0 in every row; use build()")
        for name, t, hi in (("vertical", self.vertical, seqlen), ("slash", self.slash, self.num_blocks(seqlen))):
            bad = t >= hi
            if bad.any():
                b, h, i = (int(x) for x in bad.nonzero()[0])
                raise ValueError(
                    f"VerticalSlashIndex.{name}[{b}, {h}, {i}] = {int(t[b, h, i])} is out of range for "
                    f"seqlen={seqlen}, block_size={self.block_size}: entries must be < {hi}"
                )

    def column_mask(self, seqlen: int) -> torch.Tensor:
        """BoolTensor ``[B, Hq, seqlen]``: True at key positions in the vertical set."""
        mask = torch.zeros(self.batch, self.heads, seqlen + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(-1, torch.where(self.vertical < 0, seqlen, self.vertical), True)
        return mask[..., :seqlen]

    def offset_mask(self, seqlen: int) -> torch.Tensor:
        """BoolTensor ``[B, Hq, num_blocks]``: True at block offsets in the slash set."""
        nb = self.num_blocks(seqlen)
        mask = torch.zeros(self.batch, self.heads, nb + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(-1, torch.where(self.slash < 0, nb, self.slash.clamp(max=nb)), True)
        return mask[..., :nb]

    def density(self, seqlen: int) -> torch.Tensor:
        """Fraction of the ``seqlen (seqlen + 1) / 2`` causal entries attended, per head: float64 ``[B, Hq]``, exact.

        O(B · Hq · (seqlen + Kv)) without materialising the mask; on CUDA one Triton launch (``sparse.triton.report``)
        instead of ~20 small ops (the training job's report asks for it in every layer). No host sync. Inside packed
        documents: ``AttentionPattern(seqlen, index, documents).density()``.
        """
        if uses_triton(self.device):
            return triton_kernels().report.index_density(self.vertical, self.slash, seqlen, self.block_size)
        bs, nb = self.block_size, self.num_blocks(seqlen)
        last = seqlen - (nb - 1) * bs  # size of the (possibly partial) last block
        offsets = self.offset_mask(seqlen).double()  # [B, H, nb]
        # Entries of the slash tiles at offset o: full tiles for o >= 1, the causal triangles for o = 0.
        # No item assignment into these device tensors: a Python scalar written into a CUDA tensor is a
        # host-to-device copy that synchronises (and breaks CUDA-graph capture); the report runs every step.
        o = torch.arange(nb, device=self.device, dtype=torch.float64)
        triangles = (nb - 1) * bs * (bs + 1) / 2 + last * (last + 1) / 2
        per_offset = torch.where(o == 0, triangles, (nb - 1 - o) * bs * bs + last * bs)
        slash_entries = (offsets * per_offset).sum(-1)
        # A column c (block cb) is counted for every query block cb + o (o >= 1) whose offset o is not chosen:
        # bs rows each, except the partial last block.
        not_chosen = (1.0 - offsets) * (o >= 1)
        cum = not_chosen.cumsum(-1)  # cum[..., m] = #unchosen offsets in [1, m]
        valid = self.vertical >= 0
        cb = torch.where(valid, self.vertical, 0) // bs
        reach = nb - 1 - cb  # largest offset a column in block cb can see
        count = cum.gather(-1, reach) * bs - not_chosen.gather(-1, reach) * (bs - last) * (reach >= 1)
        column_entries = torch.where(valid, count, 0.0).sum(-1)
        return (slash_entries + column_entries) / (seqlen * (seqlen + 1) / 2)

    def __repr__(self) -> str:
        return (
            f"VerticalSlashIndex(batch={self.batch}, heads={self.heads}, vertical={self.vertical.shape[-1]}, "
            f"slash={self.slash.shape[-1]}, block_size={self.block_size}, device={self.device})"
        )


def index_to_dense_mask(index: VerticalSlashIndex, seqlen: int) -> torch.Tensor:
    """The dense mask of ``index``: BoolTensor ``[B, Hq, seqlen, seqlen]`` (query, key). Reference and tests only
    (inside packed documents: ``AttentionPattern.dense_mask``)."""
    pos = torch.arange(seqlen, device=index.device)
    q, k = pos[:, None], pos[None, :]
    offset = q // index.block_size - k // index.block_size  # [N, N], >= 0 where causal
    columns = index.column_mask(seqlen)[:, :, None, :]
    offsets = index.offset_mask(seqlen)
    slash = offsets.gather(-1, offset.clamp(min=0).reshape(1, 1, -1).expand(index.batch, index.heads, -1))
    return (k <= q) & (columns | slash.view(index.batch, index.heads, seqlen, seqlen))
