"""The Triton greedy (``estimator.triton.greedy``) against the PyTorch rounds (CPU: through the Triton interpreter).

Both run the same rules on the same fp32-exact inputs with fp64 sums, so the chosen columns and offsets must be
the same sets (the PyTorch rounds are themselves checked against a one-at-a-time loop in ``test_spread.py``).
Deliberate bugs in the ordering rule, the covered mass or the carries change picks here. Small terms that rarely
change a pick (an offset cost's correction for a partial last query block: 96 searched cases without a changed
pick) are pinned by comparing every entry's score of a round instead. Not pinned: a column cost's correction for
the partial block, which only decides whether a column whose sole free tile is that block is eligible at all.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ds_mtraining.estimator.spread import greedy
from ds_mtraining.estimator.spread.greedy import spread_select
from ds_mtraining.estimator.spread.settings import SpreadSettings
from ds_mtraining.estimator.triton import greedy as kernels
from ds_mtraining.sparse.index import VerticalSlashIndex
from tests.test_spread import CASES, _select_pieces, config, diffuse_pieces

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=["launch defaults", "many programs per head"])
def launch(request, monkeypatch):
    """Also split every pass over several programs per head at these small shapes: chunks of 16 candidates (key
    blocks' candidates cut at chunk edges, carried over chunks 2 at a time), tiles of 16 offsets, 16 ranked ratios
    per program."""
    if request.param == "many programs per head":
        monkeypatch.setattr(kernels, "_TILE", 128)
        monkeypatch.setattr(kernels, "_CARRIED", 2)
        monkeypatch.setattr(kernels, "_RANKED", 16)


def _both(seqlen: int, count: int, cfg, seed: int, schedule=None) -> tuple[VerticalSlashIndex, VerticalSlashIndex]:
    _, rows, evidence, candidates, cand_attn = _select_pieces(seqlen, count, cfg, seed)
    inputs = [x.to(DEVICE) for x in (evidence.block_mass, candidates, cand_attn, rows)]
    settings = SpreadSettings.of(cfg)
    want = spread_select(*inputs, seqlen, settings, schedule, backend="torch")
    got = spread_select(*inputs, seqlen, settings, schedule, backend="triton")
    return got, want


def _assert_same(got: VerticalSlashIndex, want: VerticalSlashIndex) -> None:
    assert torch.equal(got.slash, want.slash), (got.slash ^ want.slash).nonzero()
    assert torch.equal(got.vertical, want.vertical), "columns differ"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_rounds_equal_torch_rounds(case):
    """Caps binding, a target never reached, a partial last block, a ratio floor (``test_spread.CASES``)."""
    seqlen, count, overrides = CASES[case]
    cfg = config(rows=count, **{"max_columns": 40, **overrides})  # Kc = 2 x cap: a short interpreted sort
    got, want = _both(seqlen, count, cfg, seed=20 + case)
    assert want.vertical.ne(-1).sum() > cfg.sink_tokens, "the case must choose columns"
    _assert_same(got, want)


def test_triton_rounds_equal_torch_rounds_defaults_and_short_rounds():
    """Default knobs at block 64 but the column cap (many picks per round, bounded by the forecast), and one pick
    per round."""
    cfg = config(rows=48, exclusion=128, max_columns=48)
    got, want = _both(1536, 48, cfg, seed=7)
    _assert_same(got, want)
    cfg = config(rows=24, recall=0.95, max_columns=6, exclusion=128)
    got, want = _both(1024, 24, cfg, seed=8, schedule=(1,) * 12)
    _assert_same(got, want)


def test_triton_rounds_equal_torch_rounds_after_the_column_cap():
    """A diffuse head whose columns reach their cap in the third of four rounds (``test_spread``'s weak-head case,
    scaled down): the round after the cap buys offsets in both."""
    cfg = config(rows=32, recall=0.9, max_columns=20, tail_rows=0)
    _, rows, evidence, candidates, cand_attn = diffuse_pieces(3072, 32, cfg, columns=60, seed=1)
    inputs = [x.to(DEVICE) for x in (evidence.block_mass, candidates, cand_attn, rows)]
    settings, schedule = SpreadSettings.of(cfg), (2, 8, 32, 32)
    want = spread_select(*inputs, 3072, settings, schedule, backend="torch")
    got = spread_select(*inputs, 3072, settings, schedule, backend="triton")
    assert int(want.vertical.ne(-1).sum()) - cfg.sink_tokens == cfg.estimator.max_columns
    assert int(want.slash.ne(-1).sum()) > 4, "the last round must buy offsets"
    _assert_same(got, want)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("rounds", [1, 3])
def test_triton_scores_equal_torch_scores(case, rounds):
    """Every entry's ratio and forecast of a round, not only the picks: the first round (from the forced entries)
    and the third (after two rounds of picks). Pins the terms that rarely change a pick, such as an offset cost's
    correction for a partial last query block (CASES[1]: 1000 tokens in blocks of 64)."""
    seqlen, count, overrides = CASES[case]
    cfg = config(rows=count, **{"max_columns": 40, **overrides})
    _, rows, evidence, candidates, cand_attn = _select_pieces(seqlen, count, cfg, seed=30 + case)
    inputs = [x.to(DEVICE) for x in (evidence.block_mass, candidates, cand_attn)]
    rows = rows.to(DEVICE)
    schedule = (4, 8, 16)[:rounds]  # small rounds: the third still has eligible entries in every case
    settings = SpreadSettings.of(cfg)
    before = greedy._problem(*inputs, rows, seqlen, settings, torch.float64, None)
    greedy._rounds(before, rows, seqlen, settings, schedule[:-1])
    geometry = greedy._geometry(before, rows, seqlen, settings)
    want_ratio, want_forecast, _ = greedy._scores(before, geometry, seqlen, settings)
    p = greedy._problem(*inputs, rows, seqlen, settings, torch.float32, None)
    _, _, got_ratio, got_forecast = kernels.greedy_rounds(p, rows, seqlen, settings, schedule)
    eligible = want_ratio > float("-inf")
    assert eligible.any(), "the round must have eligible entries"
    assert torch.equal(got_ratio > float("-inf"), eligible)
    # fp64 up to summation order; a column's ratio subtracts its two spikes from its sum, so near-zero ratios carry
    # the sum's rounding: absolute slack at 1e-12 of the largest. A dropped cost term moves ratios by >= 1e-4.
    scale = want_ratio[eligible].abs().max()
    torch.testing.assert_close(got_ratio[eligible], want_ratio[eligible], rtol=1e-12, atol=1e-12 * scale)
    # Forecasts matter for eligible entries only (a chosen offset's own residual is computed differently, unused).
    torch.testing.assert_close(got_forecast[eligible], want_forecast[eligible], rtol=1e-12, atol=1e-15)


def test_backend_errors(monkeypatch):
    """An unknown backend, and the Triton one for CPU tensors outside the interpreter, name the problem and the fix."""
    seqlen, count, overrides = CASES[0]
    cfg = config(rows=count, **overrides)
    _, rows, evidence, candidates, cand_attn = _select_pieces(seqlen, count, cfg, seed=0)
    inputs = (evidence.block_mass, candidates, cand_attn, rows, seqlen, SpreadSettings.of(cfg))
    with pytest.raises(ValueError, match="backend must be 'auto', 'triton' or 'torch'; got 'cuda'"):
        spread_select(*inputs, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors .*use backend='torch'"):
        spread_select(*inputs, backend="triton")
