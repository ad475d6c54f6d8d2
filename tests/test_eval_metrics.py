import pytest
import torch

from ds_mtraining.eval import metrics
from ds_mtraining.eval.metrics import (
    block_stats,
    causal_probs,
    index_recall,
    masked_recall,
    oracle_index,
    oracle_path,
    oracle_paths,
    relative_error,
)
from ds_mtraining.sparse import VerticalSlashIndex, index_to_dense_mask


def _probs(n=128, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, d, generator=g) * 2, torch.randn(n, d, generator=g) * 2
    return causal_probs(q, k, d**-0.5)


def test_recall_of_a_full_index_is_one():
    p = _probs()
    index = VerticalSlashIndex.dense(1, 1, 128, 16)
    r_all, r_last = index_recall(block_stats(p, 16, 32), index)
    assert r_all == pytest.approx(1.0, abs=1e-6) and r_last == pytest.approx(1.0, abs=1e-6)
    assert masked_recall(p, index_to_dense_mask(index, 128)[0, 0]) == pytest.approx(1.0, abs=1e-6)


def test_recall_matches_a_hand_computed_case():
    p = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.3, 0.5, 0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    # block 2: offset 0 covers keys {0,1} for rows 0-1 and keys {2,3} for rows 2-3; column 0 adds key 0 everywhere.
    index = VerticalSlashIndex.build(torch.tensor([[[0]]]), torch.tensor([[[0]]]), 2)
    # rows: 1, 1, 0.2 + 0.5, 0.1 + 0.3 + 0.4
    r_all, r_last = index_recall(block_stats(p, 2, 2), index)
    assert r_all == pytest.approx((1 + 1 + 0.7 + 0.8) / 4)
    assert r_last == pytest.approx((0.7 + 0.8) / 2)
    assert masked_recall(p, index_to_dense_mask(index, 4)[0, 0]) == pytest.approx(0.875)
    assert masked_recall(p, index_to_dense_mask(index, 4)[0, 0], rows=2) == pytest.approx(0.75)


def test_index_recall_matches_the_dense_mask_definition():
    p = _probs(seed=1)
    index = VerticalSlashIndex.build(torch.tensor([[[0, 5, 77, 100]]]), torch.tensor([[[2, 5]]]), 16)
    mask = index_to_dense_mask(index, 128)[0, 0]
    r_all, r_last = index_recall(block_stats(p, 16, 48), index)
    assert r_all == pytest.approx(masked_recall(p, mask), abs=1e-6)
    assert r_last == pytest.approx(masked_recall(p, mask, rows=48), abs=1e-6)


def test_oracle_path_is_exact_and_monotone():
    p = _probs(seed=2)
    stats = block_stats(p, 16, 32)
    path = oracle_path(stats, max_recall=0.99)
    assert path.recall[-1] >= 0.99
    assert bool((path.density.diff() > 0).all()) and bool((path.recall.diff() >= -1e-12).all())
    for step in (0, 5, len(path.recall) // 2, len(path.recall) - 1):
        index = oracle_index(path, step, 16)
        assert float(index.density(128)[0, 0]) == pytest.approx(float(path.density[step]))
        mask = index_to_dense_mask(index, 128)[0, 0]
        assert float(path.recall[step]) == pytest.approx(masked_recall(p, mask), abs=1e-6)
        assert float(path.recall_last[step]) == pytest.approx(masked_recall(p, mask, rows=32), abs=1e-6)


def _sequential_oracle(stats, max_recall):
    """The oracle's definition step by step, one head, in Python floats: (kinds, choices, densities, recalls,
    recalls over the last rows). At each step the candidate with the most uncovered mass per uncovered entry,
    an offset on a tie, with its gains and costs recomputed from the chosen set; the first on a tie within a kind."""
    t, tl, bs = stats.full, stats.last, stats.block_size
    nb, n = t.shape
    qb = torch.arange(nb)[:, None]
    rel = qb - (torch.arange(n) // bs)[None, :]  # [nb, N]: a column's block offset in each query block
    tile_entries = torch.full((nb, n), float(bs), dtype=torch.float64)
    tile_entries[rel == 0] = 0  # offset 0 comes first and covers the partial triangles
    offsets, columns = [0], []
    kinds, choices = [0], [0]

    def covered():
        keep = torch.zeros(nb, n, dtype=torch.bool)
        for s in offsets:
            keep |= rel == s
        keep[:, columns] |= rel[:, columns] >= 0
        return keep & (rel >= 0)

    def point():
        keep = covered()
        entries = nb * bs * (bs + 1) / 2 + float(tile_entries[keep].sum())
        return entries / (n * (n + 1) / 2), float(t[keep].sum()) / n, float(tl[keep].sum()) / stats.last_rows

    points = [point()]
    while points[-1][1] < max_recall:
        keep = covered()
        open_ = (rel >= 0) & ~keep
        best = None  # (ratio, kind, choice)
        for s in range(nb):
            if s in offsets:
                continue
            cells = open_ & (rel == s)
            cost = float(tile_entries[cells].sum())
            if cost > 0 and (best is None or float(t[cells].sum()) / cost > best[0]):
                best = (float(t[cells].sum()) / cost, 0, s)
        for j in range(n):
            if j in columns:
                continue
            cells = open_[:, j]
            cost = float(tile_entries[cells, j].sum())
            if cost > 0 and (best is None or float(t[cells, j].sum()) / cost > best[0]):
                best = (float(t[cells, j].sum()) / cost, 1, j)
        if best is None:
            break
        (offsets if best[1] == 0 else columns).append(best[2])
        kinds.append(best[1]), choices.append(best[2])
        points.append(point())
    return kinds, choices, *map(list, zip(*points, strict=True))


def test_batched_oracle_paths_follow_the_definition_head_by_head(monkeypatch):
    """Three heads of different sharpness and stopping recalls in one batch, the host checking for the end every
    4 steps (so heads end between checks): each head's path is the step-by-step definition's, choice by choice."""
    monkeypatch.setattr(metrics, "SYNC_EVERY", 4)
    g = torch.Generator().manual_seed(7)
    n, d, bs = 64, 8, 8
    stats = []
    for sharp in (0.5, 2.0, 4.0):
        q, k = torch.randn(n, d, generator=g) * sharp, torch.randn(n, d, generator=g) * sharp
        stats.append(block_stats(causal_probs(q, k, d**-0.5), bs, 16))
    goals = [0.9, 0.97, 0.8]
    paths = oracle_paths(stats, goals)
    for stat, goal, path in zip(stats, goals, paths, strict=True):
        kinds, choices, dens, rec, rec_last = _sequential_oracle(stat, goal)
        assert path.kind.tolist() == kinds and path.choice.tolist() == choices
        torch.testing.assert_close(path.density, torch.tensor(dens, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(path.recall, torch.tensor(rec, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(path.recall_last, torch.tensor(rec_last, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        assert path.recall[-1] >= goal and (len(rec) == 1 or path.recall[-2] < goal)
    assert len({len(p.recall) for p in paths}) == 3  # the heads ended at different steps


def test_oracle_density_at_a_recall_interpolates_its_path():
    path = oracle_path(block_stats(_probs(seed=4), 16, 32), max_recall=0.99)
    step = path.first_reaching(0.9)
    r0, r1 = float(path.recall[step - 1]), float(path.recall[step])
    d0, d1 = float(path.density[step - 1]), float(path.density[step])
    assert path.density_at(r1) == pytest.approx(d1)
    assert path.density_at((r0 + r1) / 2) == pytest.approx((d0 + d1) / 2)
    assert path.density_at(0.0) == pytest.approx(float(path.density[0]))
    assert path.density_at(1.5) == pytest.approx(float(path.density[-1]))


def test_oracle_beats_a_random_index_of_the_same_density():
    p = _probs(seed=3)
    path = oracle_path(block_stats(p, 16, 32), max_recall=0.95)
    step = path.first_reaching(0.9)
    random_index = VerticalSlashIndex.build(torch.randperm(128)[:20].view(1, 1, -1), torch.tensor([[[1, 3]]]), 16)
    dens = float(random_index.density(128)[0, 0])
    assert dens >= float(path.density[step]) or masked_recall(p, index_to_dense_mask(random_index, 128)[0, 0]) < 0.9


def test_relative_error():
    ref = torch.ones(1, 4, 2, 3)
    out = ref.clone()
    out[:, :, 1] *= 1.5
    assert relative_error(out, ref).tolist() == [[0.0, pytest.approx(0.5)]]
