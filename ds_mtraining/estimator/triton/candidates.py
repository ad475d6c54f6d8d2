"""The spread estimator's column ratio (``estimator.spread.candidates.candidate_columns`` on CUDA) in one launch.

Each free key's ratio is the mean of its far entries with the ``SPIKES`` largest dropped; how many observation rows
are far enough behind a key comes from a binary search of the sorted rows. In PyTorch the same is a search over
all keys, a subtraction, a clamp, a division, a ``where`` and a slice: about seven passes over ``[B, Hq, N]``
before the top-k. The kernel writes the ratio row that the top-k reads, contiguous, in fp32 with the same
IEEE division, so the candidates are the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds_mtraining.sparse.triton.columns import count_below

from ..spread.spikes import SPIKES

__all__ = ["column_ratio"]

_KEYS = 1024  # keys per program


@triton.jit
def _ratio_kernel(
    SUM, TOP, ROWS, OUT, n, sinks, m, exclusion, steps, stride, SPIKES: tl.constexpr, BLOCK: tl.constexpr
):
    g = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = n - sinks
    ok = j < width
    key = sinks + j.to(tl.int64)
    far_sum = tl.load(SUM + g * stride + key, mask=ok, other=0.0)
    top = tl.load(TOP + g * stride + key, mask=ok, other=0.0)
    seen = m - count_below(ROWS, m, key + exclusion, steps)  # rows at least `exclusion` behind the key
    ratio = tl.math.div_rn(far_sum - top, tl.maximum(seen - SPIKES, 1).to(tl.float32))
    tl.store(OUT + g * width + j, tl.where(seen > SPIKES, ratio, -1.0), mask=ok)


def column_ratio(
    column_sum: torch.Tensor, column_top: torch.Tensor, rows: torch.Tensor, sinks: int, exclusion: int
) -> torch.Tensor:
    """The free columns' ratio: float32 ``[B, Hq, N - sinks]`` for keys ``sinks .. N - 1``, -1 where at most
    ``SPIKES`` rows see the key from ``exclusion`` behind.

    Args:
        column_sum, column_top: float32 ``[B, Hq, N]`` (``estimator.spread.evidence.SpreadEvidence``, summed over shards).
        rows: LongTensor ``[m]``, the observation rows, ascending.
        sinks: the forced first columns (``<= N``); exclusion: the evidence's exclusion distance.
    """
    batch, heads, n = column_sum.shape
    if column_top.shape != column_sum.shape or rows.dim() != 1 or not 0 <= sinks <= n:
        raise ValueError(
            f"column_ratio: column_sum and column_top must be [B, Hq, N] alike and rows [m] with 0 <= sinks <= N; "
            f"got {tuple(column_sum.shape)}, {tuple(column_top.shape)}, rows {tuple(rows.shape)}, sinks {sinks}"
        )
    count, width = batch * heads, n - sinks
    sums, tops = column_sum.reshape(count, n).contiguous(), column_top.reshape(count, n).contiguous()
    out = torch.empty(batch, heads, width, dtype=torch.float32, device=column_sum.device)
    if count and width:
        m = rows.numel()
        _ratio_kernel[(count, triton.cdiv(width, _KEYS))](
            sums, tops, rows.contiguous(), out, n, sinks, m, exclusion, m.bit_length(), n,
            SPIKES=SPIKES, BLOCK=_KEYS,
        )  # fmt: skip
    return out
