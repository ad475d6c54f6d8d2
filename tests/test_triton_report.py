"""``sparse.triton.report`` and ``estimator.triton.recall`` (the estimate report's density and recall on CUDA)
against the dense mask and the PyTorch path (CPU: through the Triton interpreter), in steps of 16 index entries and
4 rows, so the index's rows span several programs or steps and the observation rows several programs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ds_mtraining.estimator.spread.report import index_recall
from ds_mtraining.estimator.triton import recall as recall_kernels
from ds_mtraining.sparse import VerticalSlashIndex, index_to_dense_mask
from ds_mtraining.sparse.triton import report as density_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch):
    monkeypatch.setattr(density_kernels, "_BLOCK", 16)
    monkeypatch.setattr(recall_kernels, "_BLOCK", 16)
    monkeypatch.setattr(recall_kernels, "_ROWS", 4)


def _index(n: int, bs: int, kv: int, ks: int, seed: int) -> VerticalSlashIndex:
    gen = torch.Generator().manual_seed(seed)
    nb = -(-n // bs)
    return VerticalSlashIndex.build(
        torch.randint(-1, n, (2, 3, kv), generator=gen), torch.randint(-1, nb, (2, 3, ks), generator=gen), bs
    )


@pytest.mark.parametrize(
    "n, bs, kv, ks",
    [(1000, 64, 40, 9), (1024, 128, 70, 5), (100, 64, 30, 1), (4000, 64, 150, 40), (500, 64, 10, 4)],
    ids=["partial", "exact", "two-blocks", "wide", "one-column-step"],
)  # fmt: skip
def test_density_matches_the_dense_mask(n, bs, kv, ks):
    index = _index(n, bs, kv, ks, seed=n + kv)
    want = index_to_dense_mask(index, n).sum((-1, -2)).double() / (n * (n + 1) / 2)
    got = density_kernels.index_density(index.vertical.to(DEVICE), index.slash.to(DEVICE), n, bs).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (want < 1).any()  # not all dense: the columns' and offsets' terms count


@pytest.mark.parametrize("n, bs, m", [(1000, 64, 22), (2048, 128, 8)], ids=["partial", "exact"])
def test_recall_matches_the_pytorch_path(n, bs, m):
    """Random masses (a padded slice, as the evidence returns) and column attention zero after each row."""
    gen = torch.Generator().manual_seed(m)
    index = _index(n, bs, 60, 10, seed=m)
    nb = -(-n // bs)
    rows = torch.randperm(n, generator=gen)[:m].sort().values
    block_mass = torch.rand(2, 3, m, nb + 1, generator=gen)[..., :nb]
    causal = (index.vertical[:, :, None, :] <= rows[:, None]) & (index.vertical[:, :, None, :] >= 0)
    column_attn = torch.where(causal, torch.rand(2, 3, m, index.vertical.shape[-1], generator=gen), 0.0)
    want = index_recall(index, block_mass, column_attn, rows, n)  # CPU tensors: the PyTorch path
    got = recall_kernels.index_recall(
        *(x.to(DEVICE) for x in (index.vertical, index.offset_mask(n), block_mass, column_attn, rows)), bs
    ).cpu()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_recall_rejects_mismatched_shapes():
    index = _index(1000, 64, 20, 4, seed=1)
    vertical, offsets = index.vertical.to(DEVICE), index.offset_mask(1000).to(DEVICE)
    mass = torch.zeros(2, 3, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"column_attn \[B, Hq, m, Kv\] with Kv = 20"):
        recall_kernels.index_recall(
            vertical, offsets, mass, torch.zeros(2, 3, 8, 19, device=DEVICE), torch.arange(8), 64
        )
    with pytest.raises(ValueError, match=r"needs offsets \[B, Hq, nb\]"):
        recall_kernels.index_recall(vertical, offsets[..., :9], mass, torch.zeros(2, 3, 8, 20), torch.arange(8), 64)
