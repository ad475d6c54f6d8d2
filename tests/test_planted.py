import pytest
import torch

from ds_mtraining.sparse.planted import planted_index


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
