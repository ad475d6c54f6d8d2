import pytest
import torch

from ds_mtraining.sparse import VerticalSlashIndex, index_to_dense_mask


def _brute_force_mask(vertical: list[int], slash: list[int], bs: int, n: int) -> torch.Tensor:
    """docs/design.md's formula, one entry at a time."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(q + 1):
            mask[q, k] = k in vertical or (q // bs - k // bs) in slash
    return mask


def test_build_canonicalises():
    vertical = torch.tensor([[[7, -1, 3, 7, 0]]])
    slash = torch.tensor([[[2, -1, 2, 5]]])
    index = VerticalSlashIndex.build(vertical, slash, 4)
    assert index.vertical.tolist() == [[[0, 3, 7, -1, -1]]]
    assert index.slash.tolist() == [[[0, 2, 5, -1, -1]]]  # offset 0 added, duplicate dropped


def test_build_matches_set_semantics_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    vertical = torch.randint(-1, 12, (3, 4, 9), generator=gen)  # many duplicates and pads
    index = VerticalSlashIndex.build(vertical, torch.randint(-1, 5, (3, 4, 6), generator=gen), 4)
    for row, got in zip(vertical.flatten(0, 1).tolist(), index.vertical.flatten(0, 1).tolist(), strict=True):
        want = sorted(set(row) - {-1})
        assert got == want + [-1] * (len(row) - len(want))


def test_build_of_ascending_rows_skips_the_sort_and_equals_the_sorting_build():
    gen = torch.Generator().manual_seed(1)
    chosen = torch.rand(3, 4, 40, generator=gen) < 0.3  # what a selection over ascending candidates leaves
    candidates = torch.sort(torch.randperm(500, generator=gen)[:40]).values.expand(3, 4, -1)
    vertical = torch.where(chosen, candidates, -1)
    offsets = torch.rand(3, 4, 16, generator=gen) < 0.4
    offsets[..., 0] = True
    slash = torch.where(offsets, torch.arange(16), -1)
    got = VerticalSlashIndex.build(vertical, slash, 8, ascending=True)
    want = VerticalSlashIndex.build(vertical, slash, 8)
    assert torch.equal(got.vertical, want.vertical)
    # The sorting build prepends offset 0 (one more slot, always padding here); ascending=True keeps the widths.
    assert torch.equal(got.slash, want.slash[..., :16]) and (want.slash[..., 16:] == -1).all()
    broken = VerticalSlashIndex.build(vertical.flip(-1), slash, 8, ascending=True)  # the promise is not checked...
    with pytest.raises(ValueError, match="not canonical"):
        broken.validate(500)  # ...but validate finds what it broke


def test_with_columns_adds_to_the_vertical_set_only():
    index = VerticalSlashIndex.build(torch.tensor([[[7, 3]], [[1, -1]]]), torch.tensor([[[2]], [[1]]]), 4)
    added = index.with_columns(torch.tensor([[[5, 3, -1]], [[-1, -1, 0]]]))
    assert added.vertical.tolist() == [[[3, 5, 7, -1, -1]], [[0, 1, -1, -1, -1]]]  # 3 was there: counted once
    assert added.slash.tolist() == index.slash.tolist()
    with pytest.raises(ValueError, match=r"\[B, Hq, K\] = \[2, 1, K\]"):
        index.with_columns(torch.tensor([[5, 3]]))


def test_keep_columns_keeps_the_chosen_columns_in_canonical_rows():
    index = VerticalSlashIndex.build(torch.tensor([[[7, 3, 12]], [[1, -1, -1]]]), torch.tensor([[[2]], [[1]]]), 4)
    kept = index.keep_columns(index.vertical % 2 == 1)  # [[3, 7, 12]] -> 3, 7; [[1, -1, -1]] -> 1
    assert kept.vertical.tolist() == [[[3, 7, -1]], [[1, -1, -1]]]
    assert kept.slash is index.slash
    kept.validate(16)
    assert index.keep_columns(torch.zeros_like(index.vertical, dtype=torch.bool)).vertical.eq(-1).all()
    with pytest.raises(ValueError, match=r"keep must be \[B, Hq, Kv\]"):
        index.keep_columns(torch.ones(2, 1, 2, dtype=torch.bool))


@pytest.mark.parametrize("n,bs", [(37, 8), (64, 16), (5, 16)], ids=["partial-last-block", "exact", "one-block"])
def test_dense_mask_matches_formula(n, bs):
    gen = torch.Generator().manual_seed(n)
    nb = -(-n // bs)
    vertical = torch.randint(-1, n, (2, 3, 6), generator=gen)
    slash = torch.randint(-1, nb, (2, 3, 3), generator=gen)
    index = VerticalSlashIndex.build(vertical, slash, bs)
    mask = index_to_dense_mask(index, n)
    for b in range(2):
        for h in range(3):
            v = [int(x) for x in index.vertical[b, h] if x >= 0]
            s = [int(x) for x in index.slash[b, h] if x >= 0]
            assert torch.equal(mask[b, h], _brute_force_mask(v, s, bs, n))


@pytest.mark.parametrize("n,bs", [(1000, 64), (1024, 128), (77, 64)], ids=["partial", "exact", "short"])
def test_density_is_exact(n, bs):
    gen = torch.Generator().manual_seed(n)
    nb = -(-n // bs)
    index = VerticalSlashIndex.build(
        torch.randint(-1, n, (2, 4, 40), generator=gen), torch.randint(-1, nb, (2, 4, 5), generator=gen), bs
    )
    mask = index_to_dense_mask(index, n)
    expected = mask.sum((-1, -2)).double() / (n * (n + 1) / 2)
    torch.testing.assert_close(index.density(n), expected, rtol=0, atol=1e-12)
    assert torch.equal(VerticalSlashIndex.dense(2, 4, n, bs).density(n), torch.ones(2, 4, dtype=torch.float64))


def test_validate_names_the_bad_entry():
    index = VerticalSlashIndex.build(torch.tensor([[[3, 130]]]), torch.tensor([[[1]]]), 64)
    with pytest.raises(ValueError, match=r"vertical\[0, 0, 1\] = 130 .* seqlen=100"):
        index.validate(100)
    index = VerticalSlashIndex.build(torch.tensor([[[3]]]), torch.tensor([[[2]]]), 64)
    with pytest.raises(ValueError, match=r"slash\[0, 0, 1\] = 2 .* entries must be < 2"):
        index.validate(100)
    unsorted = VerticalSlashIndex(torch.tensor([[[5, 3]]]), torch.tensor([[[0]]]), 64)
    with pytest.raises(ValueError, match="not canonical"):
        unsorted.validate(100)
    no_diagonal = VerticalSlashIndex(torch.tensor([[[3]]]), torch.tensor([[[1]]]), 64)
    with pytest.raises(ValueError, match="offset 0"):
        no_diagonal.validate(100)


def test_constructor_rejects_bad_tensors():
    with pytest.raises(ValueError, match="LongTensor"):
        VerticalSlashIndex(torch.zeros(1, 1, 2), torch.zeros(1, 1, 1, dtype=torch.long), 64)
    with pytest.raises(ValueError, match="agree on"):
        VerticalSlashIndex(torch.zeros(1, 2, 2, dtype=torch.long), torch.zeros(1, 1, 1, dtype=torch.long), 64)
    with pytest.raises(ValueError, match="block_size"):
        VerticalSlashIndex(torch.zeros(1, 1, 2, dtype=torch.long), torch.zeros(1, 1, 1, dtype=torch.long), 0)
