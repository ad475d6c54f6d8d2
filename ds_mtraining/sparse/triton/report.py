"""The estimate report's numbers per head on CUDA: the index's exact density (``VerticalSlashIndex.density``)
and the observation rows' recall of it (``sparse.spread.index_recall``), one launch each.

In PyTorch both are chains of small ops over ``[B, Hq, m, Kv]`` and ``[B, Hq, nb]`` (an offset mask, shears,
gathers, ``where``s, sums): at 128K tokens on an H200 (16 heads, 128 rows, ~2200 columns) the report added
0.34 ms to a 1.80 ms estimate, and the training job asks for it in every layer of every step. Both kernels read
the index's canonical rows directly: the slash row is sorted, so whether a tile's offset is chosen, and how many
offsets up to a given one are, is a binary search of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .columns import count_below

__all__ = ["index_density", "index_recall"]

_BLOCK = 256  # row entries per step


@triton.jit(do_not_specialize=["nb", "seqlen", "bs"])  # cast to fp64 below: runtime values, even when 1
def _density_kernel(VERT, SLASH, OUT, kv, ks, nb, seqlen, bs, steps, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    VERT += g * kv
    SLASH += g * ks
    last = (seqlen - (nb - 1) * bs).to(tl.float64)  # rows of the (possibly partial) last block
    fbs = bs.to(tl.float64)
    triangles = (nb - 1) * fbs * (fbs + 1) / 2 + last * (last + 1) / 2
    total = tl.zeros([BLOCK], dtype=tl.float64)
    # Offset o covers the causal triangles for o = 0, else nb - 1 - o full tiles and one of the last block's.
    for s0 in range(0, ks, BLOCK):
        o = tl.load(SLASH + s0 + tl.arange(0, BLOCK), mask=s0 + tl.arange(0, BLOCK) < ks, other=-1)
        fo = o.to(tl.float64)
        entries = tl.where(o == 0, triangles, (nb - 1 - fo) * fbs * fbs + last * fbs)
        total += tl.where((o >= 0) & (o < nb), entries, 0.0)
    # A column in key block cb counts bs rows for each offset 1 .. nb - 1 - cb that is not chosen (the last
    # block's rows for the largest).
    has_zero = (tl.load(SLASH) == 0).to(tl.int64)
    for c0 in range(0, kv, BLOCK):
        c = tl.load(VERT + c0 + tl.arange(0, BLOCK), mask=c0 + tl.arange(0, BLOCK) < kv, other=-1)
        reach = nb - 1 - tl.where(c >= 0, c, 0) // bs
        at = count_below(SLASH, ks, reach, steps)  # chosen offsets below reach
        held = tl.load(SLASH + at, mask=at < ks, other=-1) == reach
        free = reach - (at + held.to(tl.int64) - has_zero)  # offsets 1 .. reach not chosen
        count = free.to(tl.float64) * fbs - tl.where((reach >= 1) & ~held, fbs - last, 0.0)
        total += tl.where(c >= 0, count, 0.0)
    tl.store(OUT + g, tl.sum(total, 0) / (seqlen.to(tl.float64) * (seqlen + 1) / 2))


@triton.jit(do_not_specialize=["nb", "bs"])
def _recall_kernel(
    VERT, SLASH, MASS, ATTN, ROWS, OUT,
    m, nb, kv, ks, bs, steps,
    s_mg, s_mi, s_ag, s_ai,
    BLOCK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    VERT += g * kv
    SLASH += g * ks
    MASS += g * s_mg + i * s_mi
    ATTN += g * s_ag + i * s_ai
    row_block = tl.load(ROWS + i) // bs
    total = tl.zeros([BLOCK], dtype=tl.float64)
    # The row's tile at offset o is its key block row_block - o: the evidence's mass there.
    for s0 in range(0, ks, BLOCK):
        o = tl.load(SLASH + s0 + tl.arange(0, BLOCK), mask=s0 + tl.arange(0, BLOCK) < ks, other=-1)
        ok = (o >= 0) & (o < nb) & (o <= row_block)
        total += tl.load(MASS + row_block - o, mask=ok, other=0.0).to(tl.float64)
    # A column adds its attention where the row's tile at it is not one of those (after the row: 0 already).
    for c0 in range(0, kv, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        c = tl.load(VERT + j, mask=j < kv, other=-1)
        tile = row_block - tl.where(c >= 0, c, 0) // bs
        at = count_below(SLASH, ks, tile, steps)
        under = (tile >= 0) & (tl.load(SLASH + at, mask=at < ks, other=-1) == tile)
        total += tl.load(ATTN + j, mask=(c >= 0) & ~under, other=0.0).to(tl.float64)
    tl.store(OUT + g * m + i, tl.sum(total, 0))


def _canonical_rows_of(vertical: torch.Tensor, slash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The index's rows as ``[G, K]`` contiguous LongTensors, and the binary search's steps over a slash row."""
    g = vertical.shape[0] * vertical.shape[1]
    ks = slash.shape[-1]
    return vertical.reshape(g, -1).contiguous(), slash.reshape(g, ks).contiguous(), ks.bit_length()


def index_density(vertical: torch.Tensor, slash: torch.Tensor, seqlen: int, block_size: int) -> torch.Tensor:
    """``VerticalSlashIndex(vertical, slash, block_size).density(seqlen)``: float64 ``[B, Hq]``.

    Args:
        vertical, slash: the index's canonical rows, LongTensors ``[B, Hq, Kv]`` and ``[B, Hq, Ks]`` (ascending,
            distinct, -1 after; ``Ks >= 1``).
    """
    batch, heads = vertical.shape[:2]
    vert, sl, steps = _canonical_rows_of(vertical, slash)
    out = torch.empty(batch * heads, dtype=torch.float64, device=vertical.device)
    if out.numel():
        nb = triton.cdiv(seqlen, block_size)
        _density_kernel[(out.numel(),)](
            vert, sl, out, vert.shape[-1], sl.shape[-1], nb, seqlen, block_size, steps, BLOCK=_BLOCK
        )
    return out.view(batch, heads)


def index_recall(
    vertical: torch.Tensor,
    slash: torch.Tensor,
    block_mass: torch.Tensor,
    column_attn: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``sparse.spread.index_recall``: the rows' attention mass inside the index, mean over the rows, float32
    ``[B, Hq]``.

    Args:
        vertical, slash: the index's canonical rows, as for :func:`index_density`.
        block_mass: float32 ``[B, Hq, m, nb]``, the rows' mass per key block (the last dimension contiguous).
        column_attn: float32 ``[B, Hq, m, Kv]``, the rows' attention at ``vertical``'s columns, 0 where a column
            is after the row (likewise).
        rows: LongTensor ``[m]``, the rows' positions.
    """
    batch, heads, m, nb = block_mass.shape
    kv = vertical.shape[-1]
    if column_attn.shape != (batch, heads, m, kv) or rows.shape != (m,) or vertical.shape[:2] != (batch, heads):
        raise ValueError(
            f"index_recall: block_mass [B, Hq, m, nb] = {tuple(block_mass.shape)} needs column_attn [B, Hq, m, Kv] "
            f"with Kv = {kv} (the index's columns) and rows [m]; got {tuple(column_attn.shape)} and "
            f"{tuple(rows.shape)}"
        )
    vert, sl, steps = _canonical_rows_of(vertical, slash)
    mass, attn = block_mass.flatten(0, 1), column_attn.flatten(0, 1)
    if mass.stride(-1) != 1 or attn.stride(-1) != 1:
        mass, attn = mass.contiguous(), attn.contiguous()
    out = torch.empty(batch * heads, m, dtype=torch.float64, device=block_mass.device)
    if out.numel():
        _recall_kernel[(batch * heads, m)](
            vert, sl, mass, attn, rows.contiguous(), out,
            m, nb, kv, sl.shape[-1], block_size, steps,
            mass.stride(0), mass.stride(1), attn.stride(0), attn.stride(1),
            BLOCK=_BLOCK,
        )  # fmt: skip
    return out.mean(-1).float().view(batch, heads)
