import pytest
import torch

from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.planted import _Coverage, planted_index


@pytest.mark.parametrize("n,bs,density", [(8192, 64, 0.05), (16384, 128, 0.1), (4000, 64, 0.2)])
def test_planted_index_reaches_its_density(n, bs, density):
    gen = torch.Generator().manual_seed(0)
    index = planted_index(
        2, 3, n, bs, density=density, sinks=16, columns=32, local_tokens=256, band_tokens=256, generator=gen
    )
    index.validate(n)
    got = index.density(n)
    assert (got >= density).all(), got
    assert (got <= density + 2 / (n // bs)).all(), got  # passed by at most one offset (≈ 2 / blocks)
    assert (index.vertical[..., :16] == torch.arange(16)).all()  # sinks
    local = 256 // bs
    assert (index.slash[..., :local] == torch.arange(local)).all()  # the local band


def test_planted_index_rejects_bad_density():
    with pytest.raises(ValueError, match="density"):
        planted_index(1, 1, 1024, 64, density=0.0)


def _grown_by_whole_index(seqlen, bs, density, sinks, columns, local_tokens, band_tokens, seed):
    """The planted index of one head grown as the module did before its incremental count: the whole index's
    density recomputed after every offset (``VerticalSlashIndex.density``)."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-seqlen // bs)
    local, band = max(1, min(nb, local_tokens // bs)), max(1, band_tokens // bs)
    cols = torch.randint(0, seqlen, (columns,), generator=gen)
    vertical = torch.cat([torch.arange(sinks).clamp(max=seqlen - 1), cols])
    slash = torch.full((nb,), -1, dtype=torch.long)
    slash[:local] = torch.arange(local)
    taken = local

    def dense_enough():
        return VerticalSlashIndex.build(vertical[None, None], slash[None, None], bs).density(seqlen).item() >= density

    while taken < nb and not dense_enough():
        start = int(torch.randint(local, max(local + 1, nb - band + 1), (1,), generator=gen))
        for offset in range(start, min(nb, start + band)):
            if taken == nb or dense_enough():
                break
            if not (slash[:taken] == offset).any():
                slash[taken] = offset
                taken += 1
    return VerticalSlashIndex.build(vertical[None, None], slash[None, None], bs)


@pytest.mark.parametrize(
    "n,bs,density,sinks,columns",
    [(8192, 64, 0.05, 16, 32), (4000, 64, 0.2, 16, 300), (3001, 128, 0.3, 8, 900), (1000, 64, 0.9, 4, 50)],
)
def test_incremental_count_grows_the_index_the_whole_index_density_grows(n, bs, density, sinks, columns):
    """The count kept as offsets are added gives the very index that recomputing the whole index's density after each
    offset gives (partial last blocks, duplicate and same-block columns, densities the columns alone nearly reach)."""
    got = planted_index(1, 1, n, bs, density=density, sinks=sinks, columns=columns, local_tokens=256,
                        band_tokens=256, generator=torch.Generator().manual_seed(7))  # fmt: skip
    want = _grown_by_whole_index(n, bs, density, sinks, columns, 256, 256, seed=7)
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)


def test_coverage_equals_the_index_density_after_every_offset():
    gen = torch.Generator().manual_seed(3)
    for n, bs in ((777, 64), (1024, 128), (5000, 64)):
        nb = -(-n // bs)
        vertical = torch.cat([torch.randint(0, n, (40,), generator=gen), torch.tensor([0, 0, n - 1, -1])])
        coverage = _Coverage(vertical, range(2), bs, n)
        offsets = [0, 1]
        for offset in torch.randperm(nb, generator=gen).tolist():
            if offset in offsets:
                continue
            coverage.add(offset)
            offsets.append(offset)
            want = VerticalSlashIndex.build(vertical[None, None], torch.tensor([[offsets]]), bs).density(n).item()
            assert coverage.density() == want, (n, bs, len(offsets))
