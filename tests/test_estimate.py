"""Tests for the online budget approximation (``ds_mtraining.estimator``: the entry point and the baseline).

The main fixture plants a known vertical-slash structure in q/k (see :func:`ds_mtraining.sparse.planted.plant_head`) so the estimator's
choices can be checked exactly, and every recall is measured against float64 dense attention and
``index_to_dense_mask``, the reference of the index contract.
"""

from __future__ import annotations

import pytest
import torch

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig
from ds_mtraining.estimator import ESTIMATORS, EstimateReport, estimate_index
from ds_mtraining.estimator.baseline import slash_scores, vertical_scores
from ds_mtraining.estimator.select import select_by_recall
from ds_mtraining.sparse.index import VerticalSlashIndex, index_to_dense_mask
from ds_mtraining.sparse.planted import plant_head

BS = 64
N = 2048


def config(**settings) -> SparseAttentionConfig:
    """Baseline settings: ``BaselineEstimator``'s keys go into the estimator, the others to the top level."""
    estimator = {key: settings.pop(key) for key in list(settings) if key in BaselineEstimator.model_fields}
    return SparseAttentionConfig(
        **{"block_size": BS, "sink_tokens": 64, **settings}, estimator=BaselineEstimator(**estimator)
    )


# ---------------------------------------------------------------------------------------------------------
# Planted structure
# ---------------------------------------------------------------------------------------------------------


# Per-row shares: sink 0.08 + three columns 0.14 = 0.50 vertical; local band (d = 0, 9, 40) 0.25 + two far
# diagonals 0.125 = 0.50 slash. Each (batch, head) has its own positions. Head (0, 1) puts its columns on block
# boundaries: the 64 observation rows (one whole block) then see each column on 64 diagonals lying in ONE
# bs-wide band, whose pooled score (64 × 0.14) beats a real diagonal's (64 × 0.125): an estimator that pools
# diagonals before selecting turns those columns into slash offsets. Head (1, 1) has a far diagonal on a block
# multiple (d = 1536 crosses offset 24 only).
BAND = {0: 0.10, 9: 0.075, 40: 0.075}
SPECS = [
    [dict(columns=(300, 777, 1500), diagonals=(700, 1300)), dict(columns=(128, 1088, 1600), diagonals=(450, 1000))],
    [dict(columns=(200, 900, 1234), diagonals=(333, 1777)), dict(columns=(512, 1216, 1856), diagonals=(1536, 1111))],
]
COLUMN_SHARE, DIAGONAL_SHARE, SINK_SHARE = 0.14, 0.125, 0.08


def planted_offsets(diagonals) -> set[int]:
    """Block offsets a token diagonal's line crosses: ⌊d/bs⌋ and ⌊d/bs⌋+1 unless d is a multiple of bs."""
    return {o for d in diagonals for o in {d // BS, -(-d // BS)}}


def dense_attention(q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax in float64, ``[B, Hq, len(rows), N]`` (all rows by default); GQA by repeating k."""
    seqlen = q.shape[1]
    rows = torch.arange(seqlen) if rows is None else rows
    k = k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    logits = torch.einsum("bmhd,bnhd->bhmn", q.double()[:, rows], k) * scale
    causal = torch.arange(seqlen)[None, :] <= rows[:, None]
    return logits.masked_fill(~causal, float("-inf")).softmax(-1)


@pytest.fixture(scope="module")
def planted():
    """q, k ``[2, N, 2, 128]`` float32 with the SPECS structure, and their all-rows float64 attention."""
    qs, ks = [], []
    for b, heads in enumerate(SPECS):
        for h, spec in enumerate(heads):
            q, k = plant_head(
                N,
                columns={c: COLUMN_SHARE for c in spec["columns"]},
                diagonals={**BAND, **{d: DIAGONAL_SHARE for d in spec["diagonals"]}},
                sink=SINK_SHARE,
                seed=10 * b + h,
            )
            qs.append(q)
            ks.append(k)
    q = torch.stack(qs).view(2, 2, N, -1).transpose(1, 2).float().contiguous()
    k = torch.stack(ks).view(2, 2, N, -1).transpose(1, 2).float().contiguous()
    return q, k, dense_attention(q, k, 1.0)


def entries(row: torch.Tensor) -> set[int]:
    """The entries of one -1-padded index row, as a set."""
    return {int(x) for x in row if x >= 0}


def true_recall(attn: torch.Tensor, index: VerticalSlashIndex) -> torch.Tensor:
    """Mean over all rows of the softmax mass inside the index: float64 ``[B, Hq]``."""
    return (attn * index_to_dense_mask(index, attn.shape[-1])).sum(-1).mean(-1)


def test_planted_shares_precondition(planted):
    """The construction does what the other tests assume: every observation row sees the designed shares."""
    _, _, attn = planted
    rows = torch.arange(N - 64, N)

    def close(observed: torch.Tensor, share: float) -> None:
        torch.testing.assert_close(observed, torch.full_like(observed, share), atol=5e-3, rtol=0)

    for b, heads in enumerate(SPECS):
        for h, spec in enumerate(heads):
            a = attn[b, h, rows]
            close(a[:, 0], SINK_SHARE)
            for c in spec["columns"]:
                close(a[:, c], COLUMN_SHARE)
            for d, share in {**BAND, **dict.fromkeys(spec["diagonals"], DIAGONAL_SHARE)}.items():
                close(a[torch.arange(64), rows - d], share)


def test_planted_structure_lands_in_its_own_direction(planted):
    """Each direction holds 0.50 of every row; a target of 0.46 needs all of a direction's planted items
    (0.50 minus its smallest item, 0.14 or 0.075, is below 0.46) and nothing else. The estimator then picks
    exactly the planted columns as columns and exactly the planted diagonals (+ band) as slash offsets:
    neither direction buys the other's structure."""
    q, k, attn = planted
    index, report = estimate_index(
        q, k, config(column_recall=0.46, diagonal_recall=0.46), softmax_scale=1.0, return_report=True
    )
    sinks = set(range(64))
    for b, heads in enumerate(SPECS):
        for h, spec in enumerate(heads):
            vertical, slash = entries(index.vertical[b, h]), entries(index.slash[b, h])
            # Columns are columns, and the diagonals' observed keys (p_i − d) were not bought as columns.
            assert vertical == sinks | set(spec["columns"]), (b, h, sorted(vertical - sinks))
            # Diagonals (and the band: d = 9, 40 cross offsets 0 and 1) are offsets; the columns' diagonals
            # (which cross offsets around (N − 1 − c) // bs) were not bought as slash lines.
            assert slash == {0, 1} | planted_offsets(spec["diagonals"]), (b, h, sorted(slash))
    # The pattern holds on every row, not only on the 64 observed ones.
    assert true_recall(attn, index).min() > 0.99
    assert report.recall.min() > 0.99


def test_planted_structure_with_default_targets(planted):
    """Default targets (0.9 per direction) cannot be met by one direction's own structure, so each direction
    also buys the other's shadow, but nothing planted is missed: verticals-first-then-residual would leave
    the slash direction with nothing to find."""
    q, k, attn = planted
    index, report = estimate_index(q, k, config(), softmax_scale=1.0, return_report=True)
    columns, offsets = index.column_mask(N), index.offset_mask(N)
    for b, heads in enumerate(SPECS):
        for h, spec in enumerate(heads):
            assert columns[b, h, list(spec["columns"])].all()
            assert offsets[b, h, sorted({0, 1} | planted_offsets(spec["diagonals"]))].all()
    assert true_recall(attn, index).min() > 0.99
    assert report.recall.min() > 0.9


def reference_report(q, k, index: VerticalSlashIndex, last_q: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(recall, density) from float64 dense softmax of the observation rows and ``index_to_dense_mask``."""
    seqlen = q.shape[1]
    rows = torch.arange(max(seqlen - last_q, 0), seqlen)
    mask = index_to_dense_mask(index, seqlen)
    recall = (dense_attention(q, k, scale, rows) * mask[:, :, rows]).sum((-1, -2)) / len(rows)
    density = mask.sum((-1, -2)).double() / (seqlen * (seqlen + 1) / 2)
    return recall, density


def random_qk(b: int, n: int, hq: int, hkv: int, d: int = 32, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=gen) * 2.0
    k = torch.randn(b, n, hkv, d, generator=gen) * 2.0
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize(
    "n, hq, hkv, last_q, overrides",
    [
        pytest.param(1000, 3, 3, 64, {}, id="n-not-multiple-of-bs"),
        pytest.param(40, 2, 2, 64, {}, id="n-below-last_q"),
        pytest.param(517, 4, 2, 64, dict(column_recall=0.5, diagonal_recall=0.7), id="gqa-4-2"),
        pytest.param(300, 7, 1, 16, dict(block_size=128, local_blocks=2, sink_tokens=8), id="gqa-7-1-bs128"),
    ],
)
def test_report_matches_dense_reference(n, hq, hkv, last_q, overrides):
    q, k = random_qk(2, n, hq, hkv, seed=n)
    cfg = config(last_q=last_q, **overrides)
    index, report = estimate_index(q, k, cfg, return_report=True)
    index.validate(n)
    assert isinstance(report, EstimateReport)
    assert report.recall.dtype == torch.float32 and report.density.dtype == torch.float64
    assert report.recall.shape == report.density.shape == (2, hq)
    recall, density = reference_report(q, k, index, last_q, q.shape[-1] ** -0.5)
    torch.testing.assert_close(report.recall.double(), recall, atol=1e-5, rtol=0)
    torch.testing.assert_close(report.density, density, atol=1e-12, rtol=0)
    # Random q/k give nearly uniform attention, so the targets are met only just: recall >= target.
    assert (report.recall >= min(cfg.estimator.column_recall, cfg.estimator.diagonal_recall) - 1e-5).all()


def test_report_matches_dense_reference_planted(planted):
    q, k, _ = planted
    index, report = estimate_index(q, k, config(), softmax_scale=1.0, return_report=True)
    recall, density = reference_report(q, k, index, 64, 1.0)
    torch.testing.assert_close(report.recall.double(), recall, atol=1e-5, rtol=0)
    torch.testing.assert_close(report.density, density, atol=1e-12, rtol=0)


@pytest.mark.parametrize("hq, hkv", [pytest.param(4, 2, id="4-2"), pytest.param(7, 1, id="7-1")])
def test_gqa_equals_repeated_kv(hq, hkv):
    q, k = random_qk(2, 600, hq, hkv, seed=hq)
    cfg = config(column_recall=0.6, diagonal_recall=0.6)
    index = estimate_index(q, k, cfg)
    repeated = estimate_index(q, k.repeat_interleave(hq // hkv, dim=2), cfg)
    assert torch.equal(index.vertical, repeated.vertical)
    assert torch.equal(index.slash, repeated.slash)
    # Heads sharing a kv head still get their own index.
    assert not torch.equal(index.vertical[:, 0], index.vertical[:, 1])


# ---------------------------------------------------------------------------------------------------------
# Budgets and forced entries
# ---------------------------------------------------------------------------------------------------------


def chosen_columns(index: VerticalSlashIndex, sink_tokens: int) -> torch.Tensor:
    """Number of non-sink columns per head: LongTensor ``[B, Hq]``."""
    return (index.vertical >= sink_tokens).sum(-1)


def test_max_budget_keeps_the_strongest_planted_structures():
    """Six planted columns and five far diagonals, budgets of 4 and 3: the strongest ones are kept."""
    columns = {300: 0.06, 500: 0.07, 800: 0.08, 1100: 0.09, 1400: 0.10, 1700: 0.11}
    diagonals = {200: 0.05, 520: 0.06, 900: 0.07, 1250: 0.08, 1650: 0.09}
    q, k = plant_head(N, columns=columns, diagonals={0: 0.1, 10: 0.05, **diagonals}, sink=0.05, seed=3)
    q, k = q.float()[None, :, None], k.float()[None, :, None]
    index = estimate_index(q, k, config(max_columns=4, max_diagonals=3), softmax_scale=1.0)
    assert entries(index.vertical[0, 0]) == set(range(64)) | {800, 1100, 1400, 1700}
    # The band diagonal d = 10 (share 0.05) loses to the three strongest far ones: offset 1 is not bought.
    assert entries(index.slash[0, 0]) == {0} | planted_offsets([900, 1250, 1650])


def test_min_and_max_budgets_clip_the_count():
    q, k = random_qk(2, 700, 3, 3, seed=1)
    tight = estimate_index(q, k, config(max_columns=5, max_diagonals=2))
    assert (chosen_columns(tight, 64) == 5).all()  # uniform-ish attention needs far more than 5
    # At most 2 diagonals: at most 4 offsets besides offset 0.
    assert ((tight.slash >= 0).sum(-1) <= 5).all()
    generous = estimate_index(q, k, config(column_recall=0.01, min_columns=50, diagonal_recall=0.01, min_diagonals=0))
    assert (chosen_columns(generous, 64) == 50).all()  # sinks alone meet 0.01; the minimum forces 50


def test_select_by_recall_counts_exactly():
    """The selection itself: credit for forced candidates, the fewest top ones reaching the target, clipping,
    ties to the lower index, -1 padding."""
    scores = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 0.5, 0.0]]])
    # forced = 1: candidate 0 (3.0) credited; ranking of the rest: 2 (2.0), 3 (2.0, tie -> later), 1, 4, 5.
    pick = lambda target, lo=0, hi=10: select_by_recall(scores, 1, target, minimum=lo, maximum=hi)[0, 0].tolist()
    assert pick(3.0) == [-1, -1, -1, -1, -1]  # the forced mass already reaches it
    assert pick(5.0) == [2, -1, -1, -1, -1]
    assert pick(5.5) == [2, 3, -1, -1, -1]
    assert pick(8.0) == [2, 3, 1, -1, -1]
    assert pick(100.0) == [2, 3, 1, 4, 5]  # never reached: everything free
    assert pick(100.0, hi=2) == [2, 3]
    assert pick(3.0, lo=4) == [2, 3, 1, 4, -1]
    assert pick(3.0, lo=9) == [2, 3, 1, 4, 5]  # the minimum is clipped to what exists


def test_slash_scores_match_a_loop():
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 9, 10, 17])
    attn = torch.rand(2, 3, 4, 20, generator=gen)
    attn = torch.where(torch.arange(20)[None, :] <= rows[:, None], attn, 0.0)
    expected = torch.zeros(2, 3, 20, dtype=torch.float64)
    for i, p in enumerate(rows.tolist()):
        for d in range(p + 1):
            expected[..., d] += attn[:, :, i, p - d]
    torch.testing.assert_close(slash_scores(attn, rows, torch.arange(20), 20), expected)


def test_scores_of_key_shards_add_up_to_the_whole():
    """On a ring each rank scores the keys it holds (whole blocks, in any order, padding past the end): the shards'
    column scores add up exactly, their diagonal scores to the one-device ones up to fp64 rounding."""
    gen = torch.Generator().manual_seed(1)
    n, bs, rows = 45, 4, torch.tensor([3, 9, 10, 17, 30, 44])
    attn = torch.rand(2, 3, rows.numel(), n, generator=gen)
    attn = torch.where(torch.arange(n)[None, :] <= rows[:, None], attn, 0.0)
    whole_v, whole_s = vertical_scores(attn, torch.arange(n), n), slash_scores(attn, rows, torch.arange(n), n)
    padded = torch.nn.functional.pad(attn, (0, 3))  # 48 keys: 12 blocks, the last 3 keys padding
    blocks = torch.randperm(12, generator=gen).view(3, 4)  # three shards of four blocks each
    parts_v, parts_s = torch.zeros_like(whole_v), torch.zeros_like(whole_s)
    for shard in blocks:
        keys = (shard[:, None] * bs + torch.arange(bs)).flatten()
        parts_v += vertical_scores(padded[..., keys], keys, n)
        parts_s += slash_scores(padded[..., keys], rows, keys, n)
    assert torch.equal(parts_v, whole_v)
    torch.testing.assert_close(parts_s, whole_s, rtol=1e-15, atol=0)


def test_sinks_and_local_blocks_are_forced():
    q, k = random_qk(1, 1000, 2, 2, seed=5)
    index = estimate_index(q, k, config(sink_tokens=100, local_blocks=3, column_recall=0.01, diagonal_recall=0.01))
    # The forced entries hold more than 1 % of the mass, so nothing else is chosen.
    for h in range(2):
        assert entries(index.vertical[0, h]) == set(range(100))
        assert entries(index.slash[0, h]) == {0, 1, 2}
    # Forced entries never exceed the sequence.
    short = estimate_index(*random_qk(1, 40, 2, 2), config(sink_tokens=64, local_blocks=3))
    short.validate(40)
    assert entries(short.vertical[0, 0]) == set(range(40))
    assert entries(short.slash[0, 0]) == {0}


# ---------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------


def test_deterministic():
    q, k = random_qk(2, 900, 4, 2, seed=7)
    first, r1 = estimate_index(q, k, config(), return_report=True)
    second, r2 = estimate_index(q, k, config(), return_report=True)
    assert torch.equal(first.vertical, second.vertical) and torch.equal(first.slash, second.slash)
    assert torch.equal(r1.recall, r2.recall) and torch.equal(r1.density, r2.density)


@pytest.mark.parametrize("data", ["random", "planted"])
def test_higher_recall_target_never_shrinks_the_index(data, planted):
    if data == "random":
        q, k = random_qk(2, 800, 2, 2, seed=11)
        scale = None
    else:
        q, k, _ = planted
        scale = 1.0
    n = q.shape[1]
    previous = None
    for target in (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0):
        index = estimate_index(q, k, config(column_recall=target, diagonal_recall=target), softmax_scale=scale)
        masks = index.column_mask(n), index.offset_mask(n)
        if previous is not None:
            for old, new in zip(previous, masks):
                assert (new | ~old).all(), f"target {target} dropped an entry"
            assert (index.density(n) >= previous_density).all()
        previous, previous_density = masks, index.density(n)


def test_low_precision_inputs_are_computed_in_fp32():
    q, k = random_qk(1, 500, 2, 1, seed=2, dtype=torch.bfloat16)
    low = estimate_index(q, k, config(column_recall=0.7, diagonal_recall=0.7))
    ref = estimate_index(q.float(), k.float(), config(column_recall=0.7, diagonal_recall=0.7))
    assert torch.equal(low.vertical, ref.vertical) and torch.equal(low.slash, ref.slash)


def test_no_grad():
    q, k = random_qk(1, 200, 2, 2)
    q.requires_grad_(True)
    index, report = estimate_index(q, k, config(), return_report=True)
    assert not report.recall.requires_grad


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def test_registry_has_baseline():
    assert "baseline" in ESTIMATORS


SHAPE = (1, 64, 4, 16)


@pytest.mark.parametrize(
    "q_shape, k_shape, dtype, overrides, error, match",
    [
        pytest.param(SHAPE, (1, 64, 3, 16), torch.float32, {}, ValueError, "multiple of kv heads", id="gqa"),
        pytest.param(SHAPE, (1, 65, 4, 16), torch.float32, {}, ValueError, "must agree on B, N and D", id="len"),
        pytest.param(SHAPE, (1, 64, 4, 8), torch.float32, {}, ValueError, "must agree on B, N and D", id="dim"),
        pytest.param((1, 64, 4), (1, 64, 4), torch.float32, {}, ValueError, "4-D tensor", id="rank"),
        pytest.param(SHAPE, SHAPE, torch.int64, {}, TypeError, "floating dtype", id="dtype"),
        pytest.param(SHAPE, SHAPE, torch.float32, {"pattern": "dense"}, ValueError, "need no index", id="dense"),
    ],
)
def test_bad_inputs_raise_clear_errors(q_shape, k_shape, dtype, overrides, error, match):
    q = torch.ones(q_shape, dtype=dtype)
    k = torch.ones(k_shape, dtype=dtype)
    with pytest.raises(error, match=match):
        estimate_index(q, k, config(**overrides))


def test_unknown_estimator_lists_the_registered_ones():
    # The config's discriminated union already refuses unknown strategies; a config built without validation must
    # still fail.
    with pytest.raises(ValueError, match="does not match any of the expected tags"):
        SparseAttentionConfig(estimator={"strategy": "oracle"})
    bad = config().model_copy(update={"estimator": BaselineEstimator.model_construct(strategy="oracle")})
    with pytest.raises(ValueError, match=r"unknown estimator 'oracle'; registered: \['baseline', 'spread'\]"):
        estimate_index(torch.ones(SHAPE), torch.ones(SHAPE), bad)


def test_bad_scale_raises():
    q, k = random_qk(1, 64, 2, 2)
    with pytest.raises(ValueError, match="softmax_scale"):
        estimate_index(q, k, config(), softmax_scale=0.0)
