"""``sparse.triton.columns.merge_columns`` (``VerticalSlashIndex.with_columns`` on CUDA) against the sort-based
canonicalisation of the concatenation (CPU: through the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ds_mtraining.sparse.index import VerticalSlashIndex, _canonical_rows
from ds_mtraining.sparse.triton import columns as kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _canonical(rows: int, width: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Canonical rows of up to ``width`` distinct positions below ``n`` (row r holds about r / rows of them)."""
    x = torch.rand(rows, n, generator=gen).argsort(-1)[:, :width]
    count = torch.randint(0, width + 1, (rows, 1), generator=gen)
    x = torch.where(torch.arange(width) < count, x, -1)
    return _canonical_rows(x)


@pytest.mark.parametrize("chunk", [None, 16], ids=["default-chunk", "row-in-chunks-of-16"])
@pytest.mark.parametrize("ka, kb", [(40, 7), (300, 64), (0, 5), (12, 0)])
def test_merge_equals_sorting_the_concatenation(monkeypatch, chunk, ka, kb):
    """New columns in any order, with -1s, repeats and columns the row already holds; rows from empty to full."""
    if chunk is not None:
        monkeypatch.setattr(kernels, "_CHUNK", chunk)
    gen = torch.Generator().manual_seed(ka * 100 + kb)
    n, rows = 512, 6
    row = _canonical(rows, ka, n, gen)
    new = torch.randint(-1, n, (rows, kb), generator=gen)
    if ka and kb:
        new[:, 0] = torch.where(row[:, 0] >= 0, row[:, 0], new[:, 0])  # already in the row
        new[:, -1] = new[:, 0]  # a repeat
    want = _canonical_rows(torch.cat([row, new], dim=-1))
    got = kernels.merge_columns(row.to(DEVICE), new.to(DEVICE)).cpu()
    assert torch.equal(got, want)


def test_merge_of_more_columns_than_one_launch_takes(monkeypatch):
    """Past ``_NEW`` new columns the merge runs in launches of that many (here 8: four launches for 30), each
    merging into the last one's canonical rows; repeats across launches and columns the row holds count once."""
    monkeypatch.setattr(kernels, "_NEW", 8)
    gen = torch.Generator().manual_seed(5)
    row = _canonical(4, 20, 128, gen)
    new = torch.randint(-1, 128, (4, 30), generator=gen)
    new[:, 25] = new[:, 2]  # a repeat in another launch
    new[:, 12] = torch.where(row[:, 0] >= 0, row[:, 0], new[:, 12])  # already in the row
    launches = []
    kernel = kernels._merge_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(kernels, "_merge_kernel", Counted())
    want = _canonical_rows(torch.cat([row, new], dim=-1))
    assert torch.equal(kernels.merge_columns(row.to(DEVICE), new.to(DEVICE)).cpu(), want)
    assert len(launches) == 4


def test_index_with_columns_on_the_kernel_path():
    """The index method gives the same index through the kernel as through the sort (batch and heads kept)."""
    gen = torch.Generator().manual_seed(3)
    vertical = _canonical(6, 30, 256, gen).view(2, 3, 30)
    index = VerticalSlashIndex.build(vertical, torch.zeros(2, 3, 1, dtype=torch.long), 64)
    new = torch.randint(-1, 256, (2, 3, 9), generator=gen)
    want = index.with_columns(new)  # CPU tensors: the sort
    got = VerticalSlashIndex(kernels.merge_columns(index.vertical.to(DEVICE), new.to(DEVICE)).cpu(), index.slash, 64)
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)
    if DEVICE == "cuda":  # the method itself takes the kernel on CUDA tensors
        on_gpu = VerticalSlashIndex(index.vertical.cuda(), index.slash.cuda(), 64).with_columns(new.cuda())
        assert torch.equal(on_gpu.vertical.cpu(), want.vertical)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="must be LongTensors of the same leading shape"):
        kernels.merge_columns(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="must be LongTensors"):
        kernels.merge_columns(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.int32))
