"""The estimate report's numbers per head on CUDA: the index's exact density (``VerticalSlashIndex.density``)
and the observation rows' recall of it (``sparse.spread.index_recall``), one launch each (and a sum).

In PyTorch both are chains of small ops over ``[B, Hq, m, Kv]`` and ``[B, Hq, nb]`` (an offset mask, shears,
gathers, ``where``s, sums): at 128K tokens on an H200 (16 heads, 128 rows, ~2200 columns) the report added
0.34 ms to a 1.80 ms estimate, and the training job asks for it in every layer of every step. The density reads
the index's canonical rows (the slash row is sorted, so how many offsets up to a given one are chosen is a binary
search of it), a program per chunk of columns; the recall tiles rows x columns and looks each tile's offset up in
the offset mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .columns import count_below

__all__ = ["index_density", "index_recall"]

_BLOCK = 128  # index entries (columns, offsets) per step
_ROWS = 16  # observation rows per program of the recall


@triton.jit(do_not_specialize=["nb", "seqlen", "bs"])  # cast to fp64 below: runtime values, even when 1
def _density_kernel(VERT, SLASH, OUT, kv, ks, nb, seqlen, bs, steps, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    VERT += g * kv
    SLASH += g * ks
    last = (seqlen - (nb - 1) * bs).to(tl.float64)  # rows of the (possibly partial) last block
    fbs = bs.to(tl.float64)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    if chunk == 0:
        # Offset o covers the causal triangles for o = 0, else nb - 1 - o full tiles and one of the last block's.
        triangles = (nb - 1) * fbs * (fbs + 1) / 2 + last * (last + 1) / 2
        for s0 in range(0, ks, BLOCK):
            o = tl.load(SLASH + s0 + tl.arange(0, BLOCK), mask=s0 + tl.arange(0, BLOCK) < ks, other=-1)
            entries = tl.where(o == 0, triangles, (nb - 1 - o.to(tl.float64)) * fbs * fbs + last * fbs)
            total += tl.where((o >= 0) & (o < nb), entries, 0.0)
    # A column in key block cb counts bs rows for each offset 1 .. nb - 1 - cb that is not chosen (the last
    # block's rows for the largest).
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(VERT + j, mask=j < kv, other=-1)
    reach = nb - 1 - tl.where(c >= 0, c, 0) // bs
    at = count_below(SLASH, ks, reach, steps)  # chosen offsets below reach
    held = tl.load(SLASH + at, mask=at < ks, other=-1) == reach
    has_zero = (tl.load(SLASH) == 0).to(tl.int64)
    free = reach - (at + held.to(tl.int64) - has_zero)  # offsets 1 .. reach not chosen
    count = free.to(tl.float64) * fbs - tl.where((reach >= 1) & ~held, fbs - last, 0.0)
    total += tl.where(c >= 0, count, 0.0)
    tl.store(OUT + g * tl.num_programs(1) + chunk, tl.sum(total, 0))


@triton.jit
def _recall_kernel(
    VERT, OFFSETS, MASS, ATTN, ROWS, OUT,
    m, nb, kv, bs,
    s_off, s_mg, s_mi, s_ag, s_ai,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = (i < m)[:, None]
    VERT += g * kv
    OFFSETS += g * s_off
    MASS += g * s_mg + i[:, None].to(tl.int64) * s_mi
    ATTN += g * s_ag + i[:, None].to(tl.int64) * s_ai
    row_block = (tl.load(ROWS + i, mask=i < m, other=0) // bs)[:, None]
    total = tl.zeros([BLOCK_R, BLOCK], dtype=tl.float64)
    # The row's tile at offset o is its key block row_block - o: the evidence's mass there.
    for o0 in range(0, nb, BLOCK):
        o = o0 + tl.arange(0, BLOCK)
        chosen = (tl.load(OFFSETS + o, mask=o < nb, other=0) != 0)[None, :]
        ok = live & chosen & (o[None, :] <= row_block)
        total += tl.load(MASS + row_block - o[None, :], mask=ok, other=0.0).to(tl.float64)
    # A column adds its attention where the row's tile at it is not one of those (after the row: 0 already).
    for c0 in range(0, kv, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        c = tl.load(VERT + j, mask=j < kv, other=-1)[None, :]
        tile = row_block - tl.where(c >= 0, c, 0) // bs
        real = live & (c >= 0)
        under = tl.load(OFFSETS + tile, mask=real & (tile >= 0), other=0) != 0
        total += tl.load(ATTN + j[None, :], mask=real & ~under, other=0.0).to(tl.float64)
    tl.store(OUT + g * m + i, tl.sum(total, 1), mask=i < m)


def index_density(vertical: torch.Tensor, slash: torch.Tensor, seqlen: int, block_size: int) -> torch.Tensor:
    """``VerticalSlashIndex(vertical, slash, block_size).density(seqlen)``: float64 ``[B, Hq]``.

    Args:
        vertical, slash: the index's canonical rows, LongTensors ``[B, Hq, Kv]`` and ``[B, Hq, Ks]`` (ascending,
            distinct, -1 after; ``Ks >= 1``).
    """
    batch, heads, kv = vertical.shape
    count, ks = batch * heads, slash.shape[-1]
    vert, sl = vertical.reshape(count, kv).contiguous(), slash.reshape(count, ks).contiguous()
    chunks = max(1, triton.cdiv(kv, _BLOCK))  # a program per chunk of columns; the first adds the offsets
    entries = torch.empty(count, chunks, dtype=torch.float64, device=vertical.device)
    if count:
        _density_kernel[(count, chunks)](
            vert, sl, entries, kv, ks, triton.cdiv(seqlen, block_size), seqlen, block_size, ks.bit_length(),
            BLOCK=_BLOCK,
        )  # fmt: skip
    return (entries.sum(-1) / (seqlen * (seqlen + 1) / 2)).view(batch, heads)


def index_recall(
    vertical: torch.Tensor,
    offsets: torch.Tensor,
    block_mass: torch.Tensor,
    column_attn: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``sparse.spread.index_recall``: the rows' attention mass inside the index, mean over the rows, float32
    ``[B, Hq]``.

    Args:
        vertical: the index's canonical column rows, LongTensor ``[B, Hq, Kv]`` (ascending, -1 after).
        offsets: bool ``[B, Hq, nb]``, its block offsets (``VerticalSlashIndex.offset_mask``; may be a slice with
            a padded row stride).
        block_mass: float32 ``[B, Hq, m, nb]``, the rows' mass per key block (the last dimension contiguous).
        column_attn: float32 ``[B, Hq, m, Kv]``, the rows' attention at ``vertical``'s columns, 0 where a column
            is after the row (likewise).
        rows: LongTensor ``[m]``, the rows' positions.
    """
    batch, heads, m, nb = block_mass.shape
    kv = vertical.shape[-1]
    if column_attn.shape != (batch, heads, m, kv) or rows.shape != (m,) or offsets.shape != (batch, heads, nb):
        raise ValueError(
            f"index_recall: block_mass [B, Hq, m, nb] = {tuple(block_mass.shape)} needs offsets [B, Hq, nb], "
            f"column_attn [B, Hq, m, Kv] with Kv = {kv} (the index's columns) and rows [m]; got "
            f"{tuple(offsets.shape)}, {tuple(column_attn.shape)} and {tuple(rows.shape)}"
        )
    count = batch * heads
    vert, offsets = vertical.reshape(count, kv).contiguous(), offsets.reshape(count, nb)
    mass, attn = block_mass.flatten(0, 1), column_attn.flatten(0, 1)
    if offsets.stride(-1) != 1 or mass.stride(-1) != 1 or attn.stride(-1) != 1:
        offsets, mass, attn = offsets.contiguous(), mass.contiguous(), attn.contiguous()
    out = torch.empty(count, m, dtype=torch.float64, device=block_mass.device)
    if out.numel():
        _recall_kernel[(count, triton.cdiv(m, _ROWS))](
            vert, offsets.view(torch.int8), mass, attn, rows.contiguous(), out,
            m, nb, kv, block_size,
            offsets.stride(0), mass.stride(0), mass.stride(1), attn.stride(0), attn.stride(1),
            BLOCK_R=_ROWS, BLOCK=_BLOCK,
        )  # fmt: skip
    return out.mean(-1).float().view(batch, heads)
