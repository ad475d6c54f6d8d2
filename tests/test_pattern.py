"""``AttentionPattern``: the one carrier of the index, the documents and the length, checked against its definition."""

import pytest
import torch

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import ring_work
from ds_mtraining.sparse import AttentionPattern, Documents, VerticalSlashIndex, vertical_slash_attention
from ds_mtraining.sparse.index import index_to_dense_mask
from ds_mtraining.sparse.planted import planted_index


def _documents(lengths: list[int]) -> Documents:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return Documents.from_document_ids(ids[None])


def _index(n: int, heads: int = 3, seed: int = 0) -> VerticalSlashIndex:
    gen = torch.Generator().manual_seed(seed)
    return planted_index(1, heads, n, 16, density=0.3, sinks=2, columns=6, local_tokens=32, generator=gen)


def test_dense_mask_is_the_definition():
    """Causal, inside the query's document, and the index's test: each part built independently here."""
    n = 96
    index, documents = _index(n), _documents([40, 7, 49])
    mask = AttentionPattern(n, index, documents).dense_mask()
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    same_document = documents.starts[0][:, None] <= pos[None, :]
    expected = index_to_dense_mask(index, n) & causal & same_document
    assert torch.equal(mask, expected)
    assert torch.equal(AttentionPattern(n, documents=documents).dense_mask()[0, 0], causal & same_document)
    assert torch.equal(AttentionPattern(n).dense_mask()[0, 0], causal)


@pytest.mark.parametrize("lengths", [[96], [40, 7, 49], [1] * 12 + [84], [17, 16, 16, 47]])
def test_density_counts_the_dense_mask(lengths):
    """The vectorised in-document density equals the attended entries of the mask over the in-document causal ones."""
    n = sum(lengths)
    for seed in range(3):
        pattern = AttentionPattern(n, _index(n, seed=seed), _documents(lengths))
        mask = pattern.dense_mask().double()
        expected = mask.sum((-1, -2)) / pattern.documents.mask().double().sum((-1, -2))[:, None]
        torch.testing.assert_close(pattern.density(), expected, rtol=0, atol=1e-15)


def test_density_without_documents_is_the_index_density():
    n = 96
    index = _index(n)
    assert torch.equal(AttentionPattern(n, index).density(), index.density(n))
    assert torch.equal(AttentionPattern(n, index, _documents([n])).density(), index.density(n))


def test_with_index_keeps_length_and_documents():
    n = 64
    rows = AttentionPattern(n, documents=_documents([30, 34]))
    sparse = rows.with_index(_index(n))
    assert (sparse.seqlen, sparse.documents, sparse.block_size) == (n, rows.documents, 16)
    assert rows.index is None and rows.block_size is None


def test_starts_on_picks_rows_and_pads_with_their_own_documents():
    documents = _documents([5, 11])
    pattern = AttentionPattern(16, documents=documents)
    positions = torch.tensor([3, 15, 16, 17, 6])
    assert pattern.starts_on(positions, padded_len=18).tolist() == [[0, 5, 16, 17, 5]]
    assert pattern.starts_on(None) is documents.starts
    assert AttentionPattern(16).starts_on(positions) is None


def test_bad_patterns_are_refused_in_one_line():
    index = _index(64)
    with pytest.raises(ValueError, match="seqlen must be a positive int"):
        AttentionPattern(0, index)
    with pytest.raises(ValueError, match="must be a VerticalSlashIndex or None"):
        AttentionPattern(64, index.vertical)
    with pytest.raises(ValueError, match="must be a Documents"):
        AttentionPattern(64, index, documents=torch.zeros(1, 64, dtype=torch.long))
    with pytest.raises(ValueError, match="documents are for rows of 48 tokens but the pattern's seqlen is 64"):
        AttentionPattern(64, index, _documents([48]))
    with pytest.raises(ValueError, match=r"documents are \[B, N\] = \[2, 64\]"):
        AttentionPattern(64, index, Documents(torch.zeros(2, 64, dtype=torch.long)))
    with pytest.raises(ValueError, match="its density is 1 by definition"):
        AttentionPattern(64).density()
    with pytest.raises(ValueError, match="out of range"):
        AttentionPattern(32, index).validate()  # the index's offsets and columns reach past 32 tokens


def test_entry_points_take_only_a_pattern():
    """A bare index is refused with the fix; the pattern's length must be q's (one device) or the layout's (ring)."""
    n = 64
    q, k, v = (torch.randn(1, n, h, 8, dtype=torch.float64) for h in (3, 1, 1))
    index = _index(n)
    with pytest.raises(ValueError, match=r"wrap an index as AttentionPattern\(seqlen, index\)"):
        vertical_slash_attention(q, k, v, index)
    with pytest.raises(ValueError, match="the pattern is for rows of 128 tokens but q has 64"):
        vertical_slash_attention(q, k, v, AttentionPattern(128, documents=_documents([128])))
    layout = make_layout("striped", 2, n, block_size=16)
    with pytest.raises(ValueError, match="needs an AttentionPattern with an index"):
        ring_work(AttentionPattern(n), layout)
    with pytest.raises(ValueError, match="pattern is for rows of 80 tokens but the layout's are 64"):
        ring_work(AttentionPattern(80, _index(80)), layout)
