"""The vertical-slash index as flash-attn-4's block-sparse lists, and the per-entry test its ``mask_mod`` applies.

Plain PyTorch (device ops, no host sync): the CPU tests check here that the lists and the test together attend
exactly the index's entries; the kernels' side (``benchmarks.flash4.ways``) only hands the lists to flash-attn-4.
flash-attn-4 (``flash_attn.cute``) walks, per (batch, query head, query block), a list of "full" key blocks (every
entry attended, no masking) and a list of "mask" key blocks (its ``mask_mod`` decides each entry), and for the
backward the transposed lists per key block. Its SM90 backward needs key blocks of its key tile, 128, so the index's
block size must be 128.

Two parts, as the kernels run them:

- **slash**: key blocks ``i - o`` of query block ``i`` for the index's offsets ``o <= i``; the diagonal (``o = 0``)
  is a mask block (causal), the others are full.
- **columns**: each query head's vertical columns gathered into ``[B, C, Hq, D]`` key/value rows (``C`` = the widest
  head's columns rounded up to whole blocks; padding sits at position ``N``, past every query). Query block ``i`` lists
  the column blocks holding a column at or before its last row. A block is full when every column in it lies before
  the query block and none lies in a slash tile the query block already attends; otherwise a mask block, where an
  entry counts iff the column is at or before the query and its block offset is not in the slash set
  (:func:`column_attended`, the ``mask_mod``'s rule written in PyTorch).

Gathering per query head (not per KV head) keeps each head's columns its own; the slash part keeps GQA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ds_mtraining.sparse.index import VerticalSlashIndex

BLOCK = 128
"""Block size of both lists: flash-attn-4's SM90 backward needs the sparse key block to equal its 128-key tile."""


class BlockLists(NamedTuple):
    """One direction's lists, int32 on the index's device, entries packed left (only ``[..., :cnt]`` is read).

    Forward (rows = query blocks, entries = key blocks) or backward (rows = key blocks, entries = query blocks):
    ``mask_cnt [B, Hq, R]``, ``mask_idx [B, Hq, R, Lm]``, ``full_cnt [B, Hq, R]``, ``full_idx [B, Hq, R, Lf]``.
    """

    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor


class ColumnBlocks(NamedTuple):
    """The columns part (see the module docstring).

    positions ``[B, Hq, C]`` int64: the key position of each gathered column (``N`` for padding), for the gather;
    aux ``(positions int32 [B, Hq, C], blocked int32 [B, Hq, 2 * nb])``: what the ``mask_mod`` reads, ``blocked[q_block
    - column_block + nb]`` being 1 where that offset is in the slash set (0 for negative offsets);
    forward / backward: the lists over the ``C / 128`` column blocks.
    """

    positions: torch.Tensor
    aux: tuple[torch.Tensor, torch.Tensor]
    forward: BlockLists
    backward: BlockLists


def _check(index: VerticalSlashIndex, seqlen: int) -> int:
    if index.block_size != BLOCK:
        raise ValueError(
            f"flash-attn-4's block-sparse backward needs 128-token blocks; the index has block_size="
            f"{index.block_size} (estimate with block_size=128, or use the Triton kernels)"
        )
    return index.num_blocks(seqlen)


def _compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count [..., R], entries [..., R, L])`` of a boolean ``[..., R, L]``: the true positions, ascending, packed
    left (the rest ``L - 1``, never read)."""
    width = keep.shape[-1]
    pos = torch.arange(width, device=keep.device)
    entries = torch.where(keep, pos, width).sort(dim=-1).values.clamp(max=width - 1)
    return keep.sum(-1).to(torch.int32), entries.to(torch.int32).contiguous()


def slash_lists(index: VerticalSlashIndex, seqlen: int) -> tuple[BlockLists, BlockLists]:
    """The slash part's forward and backward lists for ``seqlen`` tokens (diagonal: mask block; other offsets: full).

    Forward row ``i``: full entries ``i - o`` for the offsets ``1 <= o <= i``. Backward row ``j``: full entries
    ``j + o`` for the offsets ``1 <= o <= nb - 1 - j``. Ascending; ``Ks - 1`` wide (the index's offsets but 0).
    """
    nb = _check(index, seqlen)
    dev = index.device
    rows = torch.arange(nb, device=dev)
    # Canonical: offset 0 first, ascending, -1 padding last; at most nb - 1 offsets besides 0 (flash-attn-4 refuses
    # lists wider than the blocks they index).
    far = index.slash[..., 1:nb]
    big = torch.iinfo(torch.long).max
    far_sorted = torch.where(far < 0, big, far).contiguous()
    b, h = index.batch, index.heads
    # Offsets o in [1, r] for r = i (forward) and r = nb - 1 - j (backward): a prefix of the sorted offsets.
    fwd_cnt = torch.searchsorted(far_sorted, rows.expand(b, h, nb).contiguous(), right=True)
    bwd_cnt = fwd_cnt.flip(-1)
    width = max(far.shape[-1], 1)
    far = torch.nn.functional.pad(far, (0, width - far.shape[-1]), value=0)
    # Ascending key blocks as FlexAttention's BlockMask keeps them: entry t of row i is i - (the (cnt - 1 - t)-th
    # offset).
    t = torch.arange(width, device=dev)
    reverse = (fwd_cnt[..., None] - 1 - t).clamp(min=0)  # [B, Hq, nb, width]
    fwd_idx = (rows[:, None] - far[:, :, None, :].expand(b, h, nb, width).gather(-1, reverse)).clamp(0, nb - 1)
    bwd_idx = (rows[:, None] + far[:, :, None, :]).clamp(0, nb - 1)
    diag_cnt = torch.ones(b, h, nb, dtype=torch.int32, device=dev)
    diag_idx = rows.view(1, 1, nb, 1).expand(b, h, nb, 1).to(torch.int32).contiguous()
    forward = BlockLists(diag_cnt, diag_idx, fwd_cnt.to(torch.int32), fwd_idx.to(torch.int32).contiguous())
    backward = BlockLists(diag_cnt, diag_idx, bwd_cnt.to(torch.int32), bwd_idx.to(torch.int32).contiguous())
    return forward, backward


def column_blocks(index: VerticalSlashIndex, seqlen: int) -> ColumnBlocks:
    """The columns part for ``seqlen`` tokens: gathered positions, the ``mask_mod``'s tensors and both lists."""
    nb = _check(index, seqlen)
    dev = index.device
    b, h = index.batch, index.heads
    cb = max(1, -(-index.vertical.shape[-1] // BLOCK))
    width = cb * BLOCK
    vertical = torch.nn.functional.pad(index.vertical, (0, width - index.vertical.shape[-1]), value=-1)
    valid = vertical >= 0
    positions = torch.where(valid, vertical, seqlen)  # canonical rows: valid columns first, ascending
    offsets = index.offset_mask(seqlen)  # [B, Hq, nb]
    blocked = torch.cat([torch.zeros_like(offsets), offsets], -1).to(torch.int32)
    # hits[b, h, i, j]: columns of column block j that query block i reaches in a slash tile it attends.
    col_block = positions // BLOCK  # nb for padding
    slash = index.slash
    target = col_block[..., :, None] + slash[..., None, :]  # [B, Hq, C, Ks]: query block reaching c at offset o
    ok = valid[..., None] & (slash[..., None, :] >= 0) & (target < nb)
    flat = torch.where(ok, target * cb + (torch.arange(width, device=dev) // BLOCK)[:, None], nb * cb)
    hits = torch.zeros(b, h, nb * cb + 1, dtype=torch.int32, device=dev)
    hits.scatter_add_(-1, flat.flatten(-2), ok.flatten(-2).to(torch.int32))
    hits = hits[..., :-1].view(b, h, nb, cb)
    # Per column block: its first column's block, the number of valid columns, its last column.
    per_block = positions.view(b, h, cb, BLOCK)
    first = per_block[..., 0] // BLOCK  # [B, Hq, cb]; nb for an empty block
    filled = valid.view(b, h, cb, BLOCK).all(-1)
    last = torch.where(valid, positions, -1).view(b, h, cb, BLOCK).amax(-1)
    i = torch.arange(nb, device=dev)[:, None]
    listed = first[..., None, :] <= i  # [B, Hq, nb, cb]
    full = listed & filled[..., None, :] & (last[..., None, :] < i * BLOCK) & (hits == 0)
    masked = listed & ~full
    forward = BlockLists(*_compact(masked), *_compact(full))
    backward = BlockLists(*_compact(masked.transpose(-1, -2)), *_compact(full.transpose(-1, -2)))
    aux = (positions.to(torch.int32).contiguous(), blocked.contiguous())
    return ColumnBlocks(positions.contiguous(), aux, forward, backward)


class JoinedBlocks(NamedTuple):
    """Both parts over one key sequence ``[keys padded to nb * 128 | gathered columns]`` (``kernels.joined_attention``).

    columns ``[B, Hq, C]`` int64: the gathered columns' key positions (as ``ColumnBlocks.positions``); aux ``(positions
    int32 [B, Hq, nb * 128 + C], blocked)``: ``positions`` is the identity on the keys; forward lists per query block
    (the slash part's, then the columns' shifted by ``nb``), backward lists per key block (the keys', then the
    columns').
    """

    columns: torch.Tensor
    aux: tuple[torch.Tensor, torch.Tensor]
    forward: BlockLists
    backward: BlockLists


def _concat_entries(a: BlockLists, b: BlockLists, shift: int) -> BlockLists:
    """Row by row ``a``'s entries then ``b``'s shifted by ``shift``, packed left."""
    out = []
    for ca, ia, cb, ib in (
        (a.mask_cnt, a.mask_idx, b.mask_cnt, b.mask_idx),
        (a.full_cnt, a.full_idx, b.full_cnt, b.full_idx),
    ):
        wa, wb = ia.shape[-1], ib.shape[-1]
        ta, tb = torch.arange(wa, device=ia.device), torch.arange(wb, device=ib.device)
        slots = torch.cat(
            [
                torch.where(ta < ca[..., None], ta, wa + wb),
                torch.where(tb < cb[..., None], ca[..., None] + tb, wa + wb),
            ],
            -1,
        )
        merged = torch.zeros(*ia.shape[:-1], wa + wb + 1, dtype=torch.int32, device=ia.device)
        merged.scatter_(-1, slots.long(), torch.cat([ia, ib + shift], -1))
        out += [ca + cb, merged[..., : wa + wb].contiguous()]
    return BlockLists(*out)


def _stack_rows(a: BlockLists, b: BlockLists) -> BlockLists:
    """``a``'s rows then ``b``'s, the lists padded to one width."""
    out = []
    for ca, ia, cb, ib in (
        (a.mask_cnt, a.mask_idx, b.mask_cnt, b.mask_idx),
        (a.full_cnt, a.full_idx, b.full_cnt, b.full_idx),
    ):
        w = max(ia.shape[-1], ib.shape[-1])
        ia, ib = (torch.nn.functional.pad(x, (0, w - x.shape[-1])) for x in (ia, ib))
        out += [torch.cat([ca, cb], -1).contiguous(), torch.cat([ia, ib], -2).contiguous()]
    return BlockLists(*out)


def joined_blocks(index: VerticalSlashIndex, seqlen: int) -> JoinedBlocks:
    """Both parts as one call's lists for ``seqlen`` tokens (see :class:`JoinedBlocks`)."""
    nb = _check(index, seqlen)
    sfwd, sbwd = slash_lists(index, seqlen)
    cols = column_blocks(index, seqlen)
    identity = torch.arange(nb * BLOCK, dtype=torch.int32, device=index.device).expand(index.batch, index.heads, -1)
    positions = torch.cat([identity, cols.aux[0]], -1).contiguous()
    return JoinedBlocks(
        cols.positions,
        (positions, cols.aux[1]),
        _concat_entries(sfwd, cols.forward, nb),
        _stack_rows(sbwd, cols.backward),
    )


def joined_attended(q: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """The joined call's ``mask_mod`` rule for one (batch, head): causal on the keys, :func:`column_attended` on the
    gathered columns (``key >= nb * 128``). Arguments as :func:`column_attended`, over the joined sequence."""
    nb = blocked.shape[-1] // 2
    return column_attended(q, key, positions, blocked) | ((key < nb * BLOCK) & (positions[key] <= q))


def column_table(index: VerticalSlashIndex, seqlen: int, positions: torch.Tensor) -> torch.Tensor:
    """:func:`column_attended` per (query block, gathered column): int32 ``[B, Hq, nb, C]``, 1 where attended.

    The rule does not depend on the row inside the query block: a column in the query's own block is always in the
    diagonal slash tile (offset 0 is always chosen), so the causal test only matters where it is already excluded.
    A ``mask_mod`` reading this table loads one value per entry instead of two dependent ones.
    """
    nb = _check(index, seqlen)
    qb = torch.arange(nb, device=index.device)[:, None]
    pb = (positions // BLOCK)[..., None, :]  # [B, Hq, 1, C]
    offset = (qb - pb).clamp(min=0, max=nb - 1)
    chosen = index.offset_mask(seqlen)[..., None].expand(-1, -1, -1, positions.shape[-1]).gather(-2, offset)
    return ((pb < qb) & ~chosen).to(torch.int32).contiguous()


def column_attended(
    q: torch.Tensor, column: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor
) -> torch.Tensor:
    """The ``mask_mod``'s rule for one (batch, head), in PyTorch: whether query ``q`` attends gathered column
    ``column``. ``q``, ``column``: integer tensors that broadcast; ``positions [C]``, ``blocked [2 * nb]`` from
    :class:`ColumnBlocks`' aux. The kernel evaluates the same expression per entry of a mask block."""
    pos = positions[column]
    nb = blocked.shape[-1] // 2
    return (pos <= q) & (blocked[q // BLOCK - pos // BLOCK + nb] == 0)


def lists_to_dense(lists: BlockLists, rows: int, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, full)`` booleans ``[B, Hq, rows, entries]`` marking each row's listed blocks (tests, reports)."""
    out = []
    for cnt, idx in ((lists.mask_cnt, lists.mask_idx), (lists.full_cnt, lists.full_idx)):
        b, h = cnt.shape[:2]
        dense = torch.zeros(b, h, rows, entries + 1, dtype=torch.bool, device=cnt.device)
        live = torch.arange(idx.shape[-1], device=cnt.device) < cnt[..., None]
        dense.scatter_(-1, torch.where(live, idx.long(), entries), True)
        out.append(dense[..., :entries])
    return out[0], out[1]
