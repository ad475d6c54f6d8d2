"""``estimator.triton.candidates.column_ratio`` (the candidate columns' ratio on CUDA) against the PyTorch
expression in ``estimator.spread.candidates.candidate_columns``, bit for bit (CPU: through the Triton interpreter),
in key chunks of 64 so rows span several programs and end inside one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ds_mtraining.estimator.spread.candidates import far_rows
from ds_mtraining.estimator.spread.rows import spread_rows
from ds_mtraining.estimator.spread.spikes import SPIKES
from ds_mtraining.estimator.triton import candidates as kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n, m, sinks, exclusion", [(1000, 24, 4, 64), (700, 40, 0, 256), (512, 8, 64, 0)])
def test_ratio_equals_the_pytorch_expression(monkeypatch, n, m, sinks, exclusion):
    monkeypatch.setattr(kernels, "_KEYS", 64)
    gen = torch.Generator().manual_seed(n + m)
    rows = spread_rows(n, m, 64)
    column_sum = torch.rand(2, 3, n, generator=gen) * 5
    column_top = column_sum * torch.rand(2, 3, n, generator=gen)
    seen = far_rows(rows, torch.arange(n), exclusion)
    want = torch.where(seen > SPIKES, (column_sum - column_top) / (seen - SPIKES).clamp(min=1), -1.0)[..., sinks:]
    got = kernels.column_ratio(column_sum.to(DEVICE), column_top.to(DEVICE), rows.to(DEVICE), sinks, exclusion)
    assert torch.equal(got.cpu(), want)
    assert (want == -1).any() and (want > 0).any()  # keys too late to be seen, and keys with a ratio


def test_ratio_rejects_mismatched_inputs():
    x = torch.zeros(1, 2, 100, device=DEVICE)
    rows = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[B, Hq, N\] alike"):
        kernels.column_ratio(x, x[..., :99], rows, 4, 16)
    with pytest.raises(ValueError, match="0 <= sinks <= N"):
        kernels.column_ratio(x, x, rows, 101, 16)
