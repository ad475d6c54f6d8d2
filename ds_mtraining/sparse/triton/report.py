"""The estimate report's density per head on CUDA (``VerticalSlashIndex.density``), one launch and a sum.

In PyTorch it is a chain of small ops over ``[B, Hq, nb]`` (an offset mask, cumulative sums, gathers), and the
training job asks for it in every layer of every step. The kernel reads the index's canonical rows (the slash row
is sorted, so how many offsets up to a given one are chosen is a binary search of it), a program per chunk of
columns. (The report's recall is the estimator's: ``estimator.triton.recall``.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .columns import count_below

__all__ = ["index_density"]

_BLOCK = 128  # index entries (columns, offsets) per step


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
