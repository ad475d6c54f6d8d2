"""The observation rows' recall of an estimated index on CUDA (``estimator.spread.report.index_recall``), one
launch and a mean.

In PyTorch it is a chain of small ops over ``[B, Hq, m, Kv]`` and ``[B, Hq, nb]`` (an offset mask, shears, gathers,
``where``s, sums): at 128K tokens on an H200 (16 heads, 128 rows, ~2200 columns) the report, this and the density
(``sparse.triton.report``), added 0.34 ms to a 1.80 ms estimate, and the training job asks for it in every layer of
every step. The kernel tiles rows x columns and looks each tile's offset up in the offset mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["index_recall"]

_BLOCK = 128  # index entries (columns, offsets) per step
_ROWS = 16  # observation rows per program


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


def index_recall(
    vertical: torch.Tensor,
    offsets: torch.Tensor,
    block_mass: torch.Tensor,
    column_attn: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``estimator.spread.report.index_recall``: the rows' attention mass inside the index, mean over the rows, float32
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
