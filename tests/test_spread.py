"""The "spread" estimator: its rows, the batched greedy against a one-pick-at-a-time loop, planted recovery."""

from __future__ import annotations

import pytest
import torch

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import LocalReducer, estimate_index
from ds_mtraining.estimator.observe import observation_attention, observation_logits, row_statistics
from ds_mtraining.estimator.spread.candidates import candidate_attention, candidate_columns
from ds_mtraining.estimator.spread.evidence import spread_evidence
from ds_mtraining.estimator.spread.greedy import GROWING, rounds, spread_select
from ds_mtraining.estimator.spread.rows import observation_rows, spread_rows
from ds_mtraining.estimator.spread.settings import SpreadSettings
from ds_mtraining.sparse.index import index_to_dense_mask
from ds_mtraining.sparse.planted import BASE, plant_head

BS = 64


def config(**settings) -> SparseAttentionConfig:
    """Spread settings: ``SpreadEstimator``'s keys go into the estimator, the others to the top level."""
    estimator = {key: settings.pop(key) for key in list(settings) if key in SpreadEstimator.model_fields}
    return SparseAttentionConfig(**{"block_size": BS, **settings}, estimator=SpreadEstimator(**estimator))


# ---------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlen, count, bs", [(8192, 128, 64), (8192, 64, 128), (5000, 100, 64), (300, 128, 64)])
def test_spread_rows(seqlen, count, bs):
    rows = spread_rows(seqlen, count, bs)
    assert rows.dtype == torch.long and rows[-1] == seqlen - 1
    assert torch.equal(rows, rows.unique()) and rows.min() >= 0
    if seqlen // count >= bs:
        # One row per equal segment, and the rows cover the in-block positions evenly.
        assert rows.numel() == count
        segment = rows * count // seqlen
        assert torch.equal(segment, torch.arange(count))
        lanes = torch.bincount(rows[:-1] % bs, minlength=bs)
        assert lanes.max() - lanes.min() <= 1 + count // bs
        assert (lanes > 0).sum() == min(bs, count - 1)


def _old_spread_rows(seqlen: int, count: int, bs: int) -> list[int]:
    """The rows as the estimator took them before they were known to be increasing: each segment's row by the
    rule of ``spread_rows``'s docstring, one at a time, then sorted and de-duplicated (``unique``)."""
    m = min(count, seqlen)
    rows = set()
    for i in range(m):
        start, end = i * seqlen // m, (i + 1) * seqlen // m - 1
        lanes = [p for p in range(start, end + 1) if p % bs == i * 37 % bs]
        rows.add(seqlen - 1 if i == m - 1 else (max(lanes) if lanes else end))
    return sorted(rows)


@pytest.mark.parametrize("bs", [16, 64, 128])
def test_spread_rows_are_strictly_increasing_by_construction(bs):
    """One row per disjoint segment: strictly increasing without a sort or ``unique`` (a host sync), and the same
    rows as before, for many lengths and counts (fewer tokens than rows, segments shorter than a block, ...)."""
    for seqlen in [*range(1, 300, 7), 1000, 4095, 4096, 5000, 8192, 131072]:
        for count in (1, 2, 3, 17, 64, 100, 128, 300, 1000):
            rows = spread_rows(seqlen, count, bs)
            assert rows.numel() == min(count, seqlen) and bool((rows.diff() > 0).all()), (seqlen, count)
            assert rows.tolist() == _old_spread_rows(seqlen, count, bs), (seqlen, count)


def test_observation_rows_are_the_spread_rows_then_the_tail():
    rows = observation_rows(8192, 128, 32, 64, torch.device("cpu"))
    assert torch.equal(rows, torch.cat([spread_rows(8192, 128, 64), torch.arange(8160, 8192)]))
    assert observation_rows(4096, 128, 0, 64)[-1] == 4095


# ---------------------------------------------------------------------------------------------------------
# The batched greedy against a sequential reference
# ---------------------------------------------------------------------------------------------------------


def reference_greedy(
    attn: torch.Tensor, rows: torch.Tensor, candidates: list[int], seqlen: int, cfg: SparseAttentionConfig
) -> tuple[set[int], set[int]]:
    """One head, one pick at a time, every quantity recounted from its definition (float64 ``attn`` ``[m, N]``).

    Same rules as ``estimator.spread``'s docstring: offsets' gain = sampled rows' residual tile mass x rows covered /
    rows that see the offset, per newly attended entry; columns' ratio = mean of the far, uncovered entries
    with the two largest dropped; stop at the coverage target; ties to offsets, then to lower indices.
    """
    bs, n = cfg.block_size, seqlen
    nb = -(-n // bs)
    rows_in = [min(bs, n - qb * bs) for qb in range(nb)]
    p = [int(r) for r in rows]
    m = len(p)
    forced_off = max(cfg.local_blocks, 1)
    offsets = set(range(min(forced_off, nb)))
    sinks = set(range(min(cfg.sink_tokens, n)))
    columns = set(sinks)

    def covered() -> float:
        total = 0.0
        for i, pi in enumerate(p):
            for j in range(pi + 1):
                if j in columns or (pi // bs - j // bs) in offsets:
                    total += float(attn[i, j])
        return total / m

    estimator = cfg.estimator
    while covered() < estimator.recall:
        best, best_ratio = None, 0.0
        if len(offsets) - forced_off < estimator.max_offsets:
            for s in range(forced_off, nb):
                if s in offsets:
                    continue
                seeing = [i for i, pi in enumerate(p) if pi // bs >= s]
                resid = sum(
                    float(attn[i, j])
                    for i in seeing
                    for j in range((p[i] // bs - s) * bs, min((p[i] // bs - s + 1) * bs, p[i] + 1))
                    if j not in columns
                )
                cost = sum(rows_in[qb] * bs for qb in range(s, nb))
                cost -= sum(rows_in[c // bs + s] for c in columns if c // bs + s < nb)
                if cost <= 0 or not seeing:
                    continue
                ratio = resid * (n - s * bs) / len(seeing) / cost
                if ratio > best_ratio:
                    best, best_ratio = ("offset", s), ratio
        if len(columns) - len(sinks) < estimator.max_columns:
            for c in candidates:
                if c in columns:
                    continue
                far = [
                    float(attn[i, c])
                    for i, pi in enumerate(p)
                    if pi - c >= estimator.exclusion and (pi // bs - c // bs) not in offsets
                ]
                cost = sum(rows_in[qb] for qb in range(c // bs + 1, nb) if (qb - c // bs) not in offsets)
                if len(far) <= 2 or cost <= 0:
                    continue
                ratio = (sum(far) - sum(sorted(far)[-2:])) / (len(far) - 2)
                if ratio > best_ratio:
                    best, best_ratio = ("column", c), ratio
        if best is None or best_ratio < estimator.min_ratio:
            break
        (offsets if best[0] == "offset" else columns).add(best[1])
    return columns, offsets


def random_attention(seqlen: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[1, N, heads, 16]`` whose attention has real columns and diagonals: planted heads plus noise."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    for h in range(heads):
        cols = torch.randperm(seqlen - 1, generator=gen)[:6] + 1
        diags = torch.randperm(seqlen // 2, generator=gen)[:3] + 5
        shares = torch.rand(9, generator=gen, dtype=torch.float64) * 0.08 + 0.01
        q, k = plant_head(
            seqlen,
            columns={int(c): float(s) for c, s in zip(cols, shares[:6], strict=True)},
            diagonals={0: 0.05, **{int(d): float(s) for d, s in zip(diags, shares[6:], strict=True)}},
            sink=0.05,
            seed=seed * 100 + h,
        )
        q = q + 0.5 * torch.randn(q.shape, generator=gen, dtype=torch.float64)
        qs.append(q)
        ks.append(k)
    return torch.stack(qs, dim=1)[None], torch.stack(ks, dim=1)[None]


CASES = [
    # seqlen, rows, config overrides: caps binding, a target never reached, a partial last block, a floor.
    (1024, 24, {"recall": 0.9, "max_columns": 8, "max_offsets": 3, "exclusion": 128, "sink_tokens": 16}),
    (1000, 32, {"recall": 0.999, "max_columns": 24, "max_offsets": 100, "exclusion": 64, "sink_tokens": 4}),
    (960, 16, {"recall": 0.95, "min_ratio": 2e-3, "local_blocks": 2, "exclusion": 0, "sink_tokens": 0}),
]


def one_device_attention(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """The rows' attention over all keys on one device: float32 ``[B, Hq, m, N]``."""
    reducer = LocalReducer.of(q)
    return observation_attention(q[:, rows], k, rows, reducer.keys, scale, reducer)


def _select_pieces(seqlen: int, count: int, cfg: SparseAttentionConfig, seed: int):
    q, k = random_attention(seqlen, 3, seed)
    rows = spread_rows(seqlen, count, cfg.block_size)
    attn = one_device_attention(q, k, rows, 1.0).double().float()
    pad = (-seqlen) % cfg.block_size
    evidence = spread_evidence(
        torch.nn.functional.pad(attn, (0, pad)),
        rows,
        torch.arange(seqlen + pad),
        seqlen,
        cfg.block_size,
        cfg.estimator.exclusion,
    )
    candidates = candidate_columns(evidence, rows, seqlen, SpreadSettings.of(cfg))
    row_max, row_sum = row_statistics(observation_logits(q[:, rows], k, rows, torch.arange(seqlen), 1.0))
    cand_attn = candidate_attention(
        q[:, rows], k, rows, torch.arange(seqlen), candidates, row_max, row_sum, 1.0, seqlen
    )
    return attn, rows, evidence, candidates, cand_attn


@pytest.mark.parametrize("case", range(len(CASES)))
def test_batched_greedy_one_at_a_time_equals_reference(case):
    seqlen, count, overrides = CASES[case]
    cfg = config(rows=count, **overrides)
    attn, rows, evidence, candidates, cand_attn = _select_pieces(seqlen, count, cfg, seed=case)
    settings = SpreadSettings.of(cfg)
    index = spread_select(evidence.block_mass, candidates, cand_attn, rows, seqlen, settings, schedule=(1,) * 400)
    for h in range(attn.shape[1]):
        cands = [int(c) for c in candidates[0, h] if c < seqlen]
        columns, offsets = reference_greedy(attn[0, h].double(), rows, cands, seqlen, cfg)
        got_cols = {int(c) for c in index.vertical[0, h] if c >= 0}
        got_offs = {int(o) for o in index.slash[0, h] if o >= 0}
        assert got_cols == columns, (h, sorted(got_cols ^ columns))
        assert got_offs == offsets, (h, sorted(got_offs ^ offsets))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_batched_rounds_stay_close_to_one_at_a_time(case):
    """Rounds of many picks (the default schedule) reach the target with about the same density."""
    seqlen, count, overrides = CASES[case]
    cfg = config(rows=count, **overrides)
    attn, rows, evidence, candidates, cand_attn = _select_pieces(seqlen, count, cfg, seed=10 + case)
    settings = SpreadSettings.of(cfg)
    one = spread_select(evidence.block_mass, candidates, cand_attn, rows, seqlen, settings, schedule=(1,) * 400)
    batched = spread_select(evidence.block_mass, candidates, cand_attn, rows, seqlen, settings)
    d_one, d_batched = one.density(seqlen), batched.density(seqlen)
    assert torch.all(d_batched <= d_one * 1.15 + 1e-3), (d_one, d_batched)
    mask_one, mask_batched = index_to_dense_mask(one, seqlen), index_to_dense_mask(batched, seqlen)
    obs_one = (attn * mask_one[:, :, rows]).sum(-1).mean(-1)
    obs_batched = (attn * mask_batched[:, :, rows]).sum(-1).mean(-1)
    assert torch.all(obs_batched >= obs_one - 0.02), (obs_one, obs_batched)
    assert torch.all(batched.vertical.ne(-1).sum(-1) - min(cfg.sink_tokens, seqlen) <= cfg.estimator.max_columns)


def diffuse_pieces(seqlen: int, count: int, cfg: SparseAttentionConfig, columns: int, seed: int):
    """``_select_pieces`` for one synthetic head shaped like SmolLM2's weak heads: a sink and the diagonal, then
    ``columns`` weak columns (weight 1 each, scattered) that each beat any offset per entry, and 20 diagonals on
    tile offsets (weight 15 each, ~1/3 per entry), for the mass the columns leave once capped. The rows' attention
    is built directly (normalised weights), not from q/k, so every share is exact."""
    gen = torch.Generator().manual_seed(seed)
    rows = spread_rows(seqlen, count, cfg.block_size)
    keys = torch.arange(seqlen)
    weight = torch.zeros(rows.numel(), seqlen, dtype=torch.float64)
    weight[:, torch.randperm(seqlen * 7 // 8, generator=gen)[:columns] + 8] = 1.0
    for d in range(4 * cfg.block_size, 44 * cfg.block_size, 2 * cfg.block_size):
        weight[keys[None, :] == rows[:, None] - d] = 15.0
    weight[:, 0] = 50.0
    weight[keys[None, :] == rows[:, None]] = 100.0
    attn = torch.where(keys[None, :] <= rows[:, None], weight, 0.0)
    attn = (attn / attn.sum(-1, keepdim=True)).float()[None, None]  # [1, 1, m, N]
    evidence = spread_evidence(attn, rows, keys, seqlen, cfg.block_size, cfg.estimator.exclusion)
    candidates = candidate_columns(evidence, rows, seqlen, SpreadSettings.of(cfg))
    real = candidates < seqlen
    cand_attn = attn[..., candidates.clamp(max=seqlen - 1)[0, 0]] * real[:, :, None, :]
    return attn, rows, evidence, candidates, cand_attn


@pytest.mark.parametrize(
    ("seqlen", "max_columns", "columns"), [(4096, 700, 1000), (8192, 2600, 4000)], ids=["fifth-round", "past-growing"]
)
def test_column_cap_still_buys_offsets_in_a_round_after_it(seqlen, max_columns, columns):
    """SmolLM2's weak heads at 16K (``2026-12-01-smollm2_weak_heads_cpu.md``): columns win every round until
    their cap; offsets ranked after the capping round's first column are dropped, so rounds that end with the cap
    stop far short of the target with the offsets unbought. The default schedule's round after the cap buys them:
    with the cap in the fifth growing round, and with a cap past the growing rounds' total (reached in the
    seventh round, after which a fixed schedule of six rounds would have stopped)."""
    count = 64
    cfg = config(rows=count, recall=0.9, max_columns=max_columns, tail_rows=0)
    settings = SpreadSettings.of(cfg)
    attn, rows, evidence, candidates, cand_attn = diffuse_pieces(seqlen, count, cfg, columns=columns, seed=0)
    inputs = (evidence.block_mass, candidates, cand_attn, rows, seqlen, settings)

    def observed(index) -> float:
        return float((attn * index_to_dense_mask(index, seqlen)[:, :, rows]).sum(-1).mean())

    schedule = rounds(max_columns)
    capping = next(r for r in range(len(schedule)) if sum(schedule[: r + 1]) >= max_columns)
    assert capping == len(schedule) - 2  # the cap falls in the last round but one
    upto_cap = spread_select(*inputs, schedule=schedule[: capping + 1])
    index = spread_select(*inputs)
    for i in (upto_cap, index):
        assert int(i.vertical.ne(-1).sum()) - cfg.sink_tokens == settings.max_columns
    assert observed(upto_cap) < settings.recall - 0.03 and int(upto_cap.slash.ne(-1).sum()) == 1  # offset 0 only
    assert observed(index) >= settings.recall
    # What it bought is the planted diagonals' offsets (and the diagonal tile), nothing else.
    bought = {int(o) for o in index.slash[0, 0] if o >= 0}
    assert len(bought) > 4 and bought <= set(range(4, 44, 2)) | {0}


def test_rounds_reach_the_column_cap_then_add_one():
    assert rounds(700) == rounds(2048) == rounds(2216) == (*GROWING, 1536) == (8, 32, 128, 512, 1536, 1536)
    assert rounds(2217) == (*GROWING, 1536, 1536)
    assert rounds(4096) == (*GROWING, 1536, 1536, 1536)
    for cap in (1, 64, 2000, 2216, 2217, 3752, 3753, 10_000):
        schedule = rounds(cap)
        assert sum(schedule[:-1]) >= cap  # reachable before the last round
        assert cap <= sum(GROWING) or cap > sum(schedule[:-2])  # past the growing rounds: in the last but one


# ---------------------------------------------------------------------------------------------------------
# Planted structure through the public function
# ---------------------------------------------------------------------------------------------------------

N = 2048
# Columns sit at least the exclusion (256) before the end: nearer ones have no far rows to be seen by.
PLANTED = [
    {"columns": (300, 777, 1500), "diagonals": (700, 1300)},
    {"columns": (128, 1088, 1600), "diagonals": (450, 1000)},
    {"columns": (200, 900, 1234), "diagonals": (333, 1777)},
    {"columns": (512, 1216, 1650), "diagonals": (1536, 1111)},
]
BAND = {0: 0.10, 9: 0.075, 40: 0.075}


@pytest.fixture(scope="module")
def planted():
    qs, ks = [], []
    for h, spec in enumerate(PLANTED):
        q, k = plant_head(
            N,
            columns=dict.fromkeys(spec["columns"], 0.14),
            diagonals={**BAND, **dict.fromkeys(spec["diagonals"], 0.125)},
            sink=0.08,
            seed=h,
        )
        qs.append(q)
        ks.append(k)
    return torch.stack(qs, dim=1)[None].float(), torch.stack(ks, dim=1)[None].float()


def test_planted_patterns_are_recovered_as_what_they_are(planted):
    """Far columns become columns, far diagonals and the local band become offsets, nothing else is bought:
    a diagonal's keys are each hit by one row (dropped as a spike), a column's rows are spread over many
    offsets (each too thin to pay for a whole band of tiles)."""
    q, k = planted
    # Tail rows off: their repair adds columns for what the greedy left uncovered in the last rows, such as the
    # sliver of a diagonal that crosses an offset not bought (test_tail_columns_* covers it).
    cfg = config(recall=0.97, tail_rows=0)
    index, report = estimate_index(q, k, cfg, softmax_scale=1.0, return_report=True)
    sinks = set(range(config().sink_tokens))
    for h, spec in enumerate(PLANTED):
        vertical = {int(c) for c in index.vertical[0, h] if c >= 0}
        slash = {int(o) for o in index.slash[0, h] if o >= 0}
        assert vertical == sinks | set(spec["columns"]), (h, sorted(vertical - sinks))
        # A diagonal at d crosses offset d // bs in (bs - d % bs) of every bs rows and the next offset in the
        # others: the offset holding most of it is bought, a sliver (4 rows in 64 for d = 700) may not be.
        lines = {o for d in spec["diagonals"] for o in {d // BS, -(-d // BS)}}
        main = {d // BS if d % BS <= BS // 2 else d // BS + 1 for d in spec["diagonals"]}
        assert {0, 1} | main <= slash <= {0, 1} | lines, (h, sorted(slash))
    assert report.recall.min() > 0.97


@pytest.mark.parametrize("tail", [32, 0])
def test_spread_report_matches_float64_reference(tail):
    """The observed recall the spread estimator reports: the mass its index holds over its own observation rows,
    from a float64 softmax and the dense mask (the statistics the estimate computed once, sliced to the rows)."""
    n, hq, hkv, count = 700, 4, 2, 40
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, n, hq, 32, generator=gen) * 2.0, torch.randn(1, n, hkv, 32, generator=gen) * 2.0
    cfg = config(rows=count, tail_rows=tail)
    index, report = estimate_index(q, k, cfg, return_report=True)
    rows = spread_rows(n, count, BS)
    logits = torch.einsum("bmhd,bnhd->bhmn", q[:, rows].double(), k.double().repeat_interleave(hq // hkv, 2))
    logits = logits.masked_fill(torch.arange(n) > rows[:, None], float("-inf")) * 32**-0.5
    inside = logits.softmax(-1) * index_to_dense_mask(index, n)[:, :, rows]
    torch.testing.assert_close(report.recall.double(), inside.sum((-1, -2)) / rows.numel(), atol=1e-5, rtol=0)
    assert 0.5 < report.recall.min() < 1.0  # an index that misses some mass: the comparison is not vacuous


def test_spread_beats_baseline_density_on_planted(planted):
    """At the same true recall the spread index is much sparser than the baseline's (which buys shadows)."""
    q, k = planted
    _, rs = estimate_index(q, k, config(), softmax_scale=1.0, return_report=True)
    _, rb = estimate_index(
        q, k, SparseAttentionConfig(block_size=BS, estimator=BaselineEstimator()), softmax_scale=1.0, return_report=True
    )
    assert torch.all(rs.recall >= 0.9)
    assert torch.all(rs.density < 0.75 * rb.density), (rs.density, rb.density)


def test_spread_is_deterministic_and_fits_the_index_contract(planted):
    q, k = planted
    a = estimate_index(q, k, config(), softmax_scale=1.0)
    b = estimate_index(q, k, config(), softmax_scale=1.0)
    assert torch.equal(a.vertical, b.vertical) and torch.equal(a.slash, b.slash)
    a.validate(N)


@pytest.mark.parametrize("seqlen", [1, 63, 200])
def test_short_sequences(seqlen):
    """Fewer tokens than rows, blocks or the exclusion distance: still a valid index, nothing crashes."""
    gen = torch.Generator().manual_seed(seqlen)
    q, k = torch.randn(1, seqlen, 4, 16, generator=gen), torch.randn(1, seqlen, 2, 16, generator=gen)
    index = estimate_index(q, k, config())
    index.validate(seqlen)
    density = index.density(seqlen)
    assert torch.all((density > 0) & (density <= 1))
    if seqlen <= BS:  # one block: offset 0 alone is the whole causal triangle
        assert torch.all(density == 1)


# ---------------------------------------------------------------------------------------------------------
# Tail rows
# ---------------------------------------------------------------------------------------------------------


def _needle_head(seqlen: int, needle: int, readers: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[1, N, 1, 129]``: a local band and a sink (``plant_head``), and one extra direction in which only
    the last ``readers`` rows and key ``needle`` are non-zero: those rows put about half their mass on it."""
    q, k = plant_head(seqlen, columns={}, diagonals={0: 0.6, 1: 0.3}, sink=0.05, seed=seed)
    q, k = torch.nn.functional.pad(q, (0, 1)), torch.nn.functional.pad(k, (0, 1))
    q[-readers:, -1] = 1.0
    k[needle] = 0.0
    k[needle, -1] = BASE
    return q[None, :, None].float(), k[None, :, None].float()


def _entries(rows: torch.Tensor) -> set[int]:
    return {int(x) for x in rows.flatten() if x >= 0}


def _tail_recall(index, q, k, count: int) -> torch.Tensor:
    seqlen = q.shape[1]
    tail = torch.arange(seqlen - count, seqlen)
    attn = one_device_attention(q, k, tail, 1.0)
    inside = index_to_dense_mask(index, seqlen)[:, :, tail]
    return (attn * inside).sum(-1).mean(-1)  # [B, Hq]


def test_tail_columns_add_a_needle_only_the_last_rows_read():
    seqlen, needle = 1024, 300
    q, k = _needle_head(seqlen, needle, readers=4, seed=0)
    with_tail = estimate_index(q, k, config(), softmax_scale=1.0)
    without = estimate_index(q, k, config(tail_rows=0), softmax_scale=1.0)
    assert torch.all((with_tail.vertical == needle).any(-1))
    assert not torch.any((without.vertical == needle).any(-1))  # the staggered rows alone miss it
    assert torch.all(_tail_recall(without, q, k, 32) < 0.95)
    assert torch.all(_tail_recall(with_tail, q, k, 32) >= config().estimator.recall - 0.01)
    # Nothing else changes: the repair only adds columns.
    assert _entries(with_tail.slash) == _entries(without.slash)
    added = _entries(with_tail.vertical) - _entries(without.vertical)
    assert needle in added and len(added) <= config().estimator.tail_columns


def test_tail_columns_respect_their_cap_and_leave_covered_tails_alone():
    q, k = _needle_head(1024, 300, readers=4, seed=1)
    capped = estimate_index(q, k, config(tail_columns=0), softmax_scale=1.0)
    without = estimate_index(q, k, config(tail_rows=0), softmax_scale=1.0)
    assert _entries(capped.vertical) == _entries(without.vertical)
    # No reader: the last rows are covered like the others, and nothing is added.
    q, k = _needle_head(1024, 300, readers=0, seed=1)
    without = estimate_index(q, k, config(tail_rows=0), softmax_scale=1.0)
    assert torch.all(_tail_recall(without, q, k, 32) >= config().estimator.recall)
    assert _entries(estimate_index(q, k, config(), softmax_scale=1.0).vertical) == _entries(without.vertical)
