"""The estimator with packed documents: observation rows score only their own document's keys, every long
document keeps its sinks, and one document a row is the estimate without documents.

Planted heads (``sparse.planted.plant_head``) are built per document and concatenated: each document's queries put
a known share on its own columns, and, without the documents' mask, on the other documents' columns as well.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from test_ring import check_distributed_estimate

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import ESTIMATORS, estimate_index
from ds_mtraining.estimator.documents import document_ends, document_sinks, sink_width
from ds_mtraining.estimator.observe import normalise, observation_logits, row_statistics
from ds_mtraining.estimator.spread.evidence import spread_evidence
from ds_mtraining.parallel.comm import new_ring_groups
from ds_mtraining.sparse import AttentionPattern
from ds_mtraining.sparse.documents import Documents
from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.planted import plant_head

CONFIGS = [
    pytest.param(
        SparseAttentionConfig(sink_tokens=4, estimator=SpreadEstimator(rows=64, exclusion=64, max_columns=40)),
        id="spread",
    ),
    pytest.param(
        SparseAttentionConfig(
            sink_tokens=4, estimator=BaselineEstimator(column_recall=0.9, diagonal_recall=0.9, last_q=64)
        ),
        id="baseline",
    ),
]


def _documents(lengths: list[int], batch: int = 1) -> Documents:
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return Documents(Documents.from_cu_seqlens(cu, int(cu[-1])).starts.expand(batch, -1).contiguous())


def _planted(lengths: list[int], columns: list[dict[int, float]], heads: int = 2):
    """q, k ``[1, N, heads, 128]`` float32: document ``d`` a planted head of its own (its key 0 a sink, its
    ``columns[d]`` at positions relative to its start, a local diagonal), and its Documents."""
    parts = [
        [plant_head(n, columns=cols, diagonals={0: 0.2, 1: 0.1}, sink=0.2, seed=10 * d + h) for h in range(heads)]
        for d, (n, cols) in enumerate(zip(lengths, columns, strict=True))
    ]
    q = torch.cat([torch.stack([p[0] for p in doc], dim=1) for doc in parts])[None].float()
    k = torch.cat([torch.stack([p[1] for p in doc], dim=1) for doc in parts])[None].float()
    return q, k, _documents(lengths)


def _columns(index: VerticalSlashIndex) -> list[list[set[int]]]:
    return [[{int(c) for c in row if c >= 0} for row in head] for head in index.vertical]


def _trimmed(index: VerticalSlashIndex, width: int) -> torch.Tensor:
    """The vertical rows cut to ``width``, after checking that what is cut is padding only."""
    assert bool((index.vertical[..., width:] == -1).all())
    return index.vertical[..., :width]


def test_document_ends_and_sinks():
    """Ends are one past each document; sinks go to the documents longer than the local band, longest first."""
    starts = _documents([100, 30, 200, 70]).starts  # documents at 0, 100, 130, 330; N = 400
    ends = document_ends(starts)[0]
    assert ends[0] == 100 and ends[99] == 100 and ends[100] == 130 and ends[130] == 330 and ends[399] == 400
    sinks = document_sinks(starts, sink_tokens=2, block_size=64, local_blocks=1, limit=40)[0]
    # The 30-token document is inside the band; the first document's sinks are the row's own (forced elsewhere).
    assert sinks.shape == (sink_width(400, 2, 64, 1, 40),)
    assert sinks[:4].tolist() == [130, 131, 330, 331]  # longest (200) first, then 70
    assert bool((sinks[4:] == -1).all())
    capped = document_sinks(starts, sink_tokens=2, block_size=64, local_blocks=1, limit=3)[0]
    assert capped.tolist() == [130, 131, 330]
    single = document_sinks(torch.zeros_like(starts), sink_tokens=2, block_size=64, local_blocks=1, limit=40)
    assert bool((single == -1).all())


@pytest.mark.parametrize("config", CONFIGS)
def test_one_document_a_row_is_the_estimate_without_documents(config):
    """starts == 0: the same columns, offsets and report; the index only carries the (empty) sink slots."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 600, 4, 32, generator=gen), torch.randn(2, 600, 2, 32, generator=gen)
    plain, plain_report = estimate_index(q, k, config, return_report=True)
    one = Documents(torch.zeros(2, 600, dtype=torch.long))
    index, report = estimate_index(q, k, config, return_report=True, pattern=AttentionPattern(600, documents=one))
    assert torch.equal(_trimmed(index, plain.vertical.shape[-1]), plain.vertical)
    assert torch.equal(index.slash, plain.slash)
    assert torch.equal(report.recall, plain_report.recall)
    assert torch.equal(report.density, plain_report.density)


@pytest.mark.parametrize("config", CONFIGS)
def test_the_report_density_counts_inside_the_documents(config):
    """The report's density is the share of the in-document causal entries the index attends inside the
    documents (the dense mask's count), not the plain contract's."""
    q, k, documents = _planted([300, 17, 200, 251], [{100: 0.3}, {}, {50: 0.25}, {150: 0.3}])
    q, k = q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1)
    # Row 1 packs other documents than row 0: 65 tokens, then 64-token ones that each cross a block start.
    starts = torch.cat([documents.starts, _documents([65, *[64] * 8, 191]).starts])
    documents = Documents(starts)
    n = starts.shape[1]
    rows = AttentionPattern(n, documents=documents)
    index, report = estimate_index(q, k, config, softmax_scale=1.0, return_report=True, pattern=rows)
    pattern = rows.with_index(index)
    attended = pattern.dense_mask().sum((-1, -2)).double()
    expected = attended / documents.mask().sum((-1, -2)).double()[:, None]
    torch.testing.assert_close(report.density, expected, rtol=0, atol=0)
    assert torch.equal(report.density, pattern.density())
    assert bool((report.density != index.density(n)).all())  # the plain contract's count would differ


def test_observation_logits_stay_inside_the_document():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 2, 16, generator=gen), torch.randn(2, 300, 1, 16, generator=gen)
    starts = _documents([120, 180], batch=2).starts
    rows = torch.tensor([10, 119, 120, 200, 299])
    logits = observation_logits(q, k, rows, torch.arange(300), 0.25, starts[:, rows])
    keys = torch.arange(300)
    seen = (keys <= rows[:, None]) & (keys >= starts[:, rows][..., None])  # [B, m, n]
    assert bool(torch.isinf(logits[~seen[:, None].expand_as(logits)]).all())
    assert bool(torch.isfinite(logits[seen[:, None].expand_as(logits)]).all())


@pytest.mark.parametrize("config", CONFIGS)
def test_another_documents_key_is_never_chosen(config):
    """Key 40 of document 0 dominates every logit of document 1's queries, whose rows are most of the observation
    rows; document 0's own queries are flat. Without documents it is chosen; with them it is not."""
    n, cut = 1024, 256
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, n, 2, 32, generator=gen) * 0.01
    k = torch.randn(1, n, 1, 32, generator=gen) * 0.01
    q[:, cut:, :, 0] = 1.0
    k[:, 40, :, 0] = 30.0
    documents = _documents([cut, n - cut])
    plain = estimate_index(q, k, config, softmax_scale=1.0)
    assert all(40 in head for head in _columns(plain)[0])
    index = estimate_index(q, k, config, softmax_scale=1.0, pattern=AttentionPattern(n, documents=documents))
    assert all(40 not in head for head in _columns(index)[0])
    assert all({cut, cut + 1, cut + 2, cut + 3} <= head for head in _columns(index)[0])  # the document's sinks


@pytest.mark.parametrize("config", CONFIGS)
def test_planted_columns_per_document_are_recovered(config):
    """Each document's planted columns are found at its start plus their offset (where observation rows see
    them), every document keeps its sinks, and every other chosen column is seen by an observation row inside its
    document."""
    lengths = [700, 500, 800]
    columns = [{300: 0.3}, {100: 0.25, 200: 0.2}, {400: 0.3}]
    q, k, documents = _planted(lengths, columns)
    n = sum(lengths)
    index = estimate_index(q, k, config, softmax_scale=1.0, pattern=AttentionPattern(n, documents=documents))
    starts = documents.starts[0]
    planted = {0 + 300, 700 + 100, 700 + 200, 1200 + 400}
    sinks = {s + t for s in (0, 700, 1200) for t in range(config.sink_tokens)}
    strategy = ESTIMATORS[config.estimator.strategy]
    rows = strategy.rows(n, strategy.settings(config), q.device)

    def observed(c: int) -> bool:  # some observation row sees key c inside its document
        return bool(((rows >= c) & (starts[rows] <= c)).any())

    # The spread rows cover every document; the baseline's last rows only the last one.
    found = {c for c in planted if observed(c)}
    assert found == (planted if config.estimator.strategy == "spread" else {1200 + 400})
    for head in _columns(index)[0]:
        assert found <= head and sinks <= head
        assert all(observed(c) for c in head - sinks), sorted(c for c in head - sinks if not observed(c))


def test_documents_of_another_shape_are_refused():
    """A pattern (or its documents) for other rows than q's, and a pattern that already has an index."""
    q, k = torch.randn(1, 128, 2, 16), torch.randn(1, 128, 1, 16)
    short = _documents([64, 32])  # [1, 96]
    with pytest.raises(ValueError, match=r"the pattern is for rows of 96 tokens, the rows have 128"):
        estimate_index(q, k, SparseAttentionConfig(), pattern=AttentionPattern(96, documents=short))
    with pytest.raises(ValueError, match=r"documents are for rows of 96 tokens but the pattern's seqlen is 128"):
        AttentionPattern(128, documents=short)
    with pytest.raises(
        ValueError, match=r"\[2, 128\] but estimate_index's q \(the whole rows\) has batch=1, seqlen=128"
    ):
        estimate_index(q, k, SparseAttentionConfig(), pattern=AttentionPattern(128, documents=_documents([64, 64], 2)))
    index = estimate_index(q, k, SparseAttentionConfig())
    with pytest.raises(ValueError, match=r"pattern must be the rows' AttentionPattern without an index"):
        estimate_index(q, k, SparseAttentionConfig(), pattern=AttentionPattern(128, index))


def test_the_attention_handle_estimates_inside_the_documents(monkeypatch):
    """``MTrainingAttention.attend`` hands its pattern's documents to the estimator as well as to the attention."""
    from ds_mtraining.integration import transformers
    from ds_mtraining.parallel import context

    seen = []

    def spy(*args, pattern=None, **kwargs):
        seen.append(pattern)
        return estimate_index(*args, pattern=pattern, **kwargs)

    monkeypatch.setattr(context, "estimate_index", spy)
    q, k, v = torch.randn(1, 256, 2, 16), torch.randn(1, 256, 1, 16), torch.randn(1, 256, 1, 16)
    documents = _documents([100, 156])
    pattern = AttentionPattern(256, documents=documents)
    transformers.MTrainingAttention(SparseAttentionConfig()).attend(0, q, k, v, 0.25, pattern)
    assert len(seen) == 1 and seen[0] is pattern and seen[0].documents is documents


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_evidence_kernels_with_documents():
    """The Triton statistics, evidence (spread rows and tail rows) and candidate kernels equal the PyTorch path
    inside documents, fp32 (through the interpreter on CPU)."""
    pytest.importorskip("triton")
    from ds_mtraining.estimator.spread.rows import observation_rows
    from ds_mtraining.estimator.triton import evidence as kernels

    n, bs, hq, hkv, d, m, tail = 384, 64, 4, 2, 64, 12, 8
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(2, n, hq, d, generator=gen) * 2.0).to(DEVICE)
    k = torch.randn(2, n, hkv, d, generator=gen).to(DEVICE)
    starts = torch.cat([_documents([100, 60, 224]).starts, _documents([250, 134]).starts]).to(DEVICE)
    rows = observation_rows(n, m, tail, bs, DEVICE)
    keys = torch.arange(n, device=DEVICE)
    q_obs, row_starts = q[:, rows], starts[:, rows]
    logits = observation_logits(q_obs, k, rows, keys, 0.125, row_starts)
    row_max, row_sum = row_statistics(logits)
    expected = spread_evidence(normalise(logits, row_max, row_sum), rows, keys, n, bs, 64, tail)
    got_max, got_sum = kernels.row_statistics(q_obs, k, rows, keys, 0.125, row_starts)
    torch.testing.assert_close(got_max, row_max, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sum, row_sum, rtol=1e-5, atol=0)
    got = kernels.spread_evidence(q_obs, k, rows, keys, row_max, row_sum, 0.125, n, bs, 64, tail, row_starts)
    for name, a, b in zip(("block_mass", "column_sum", "column_top", "tail_sum"), got, expected.__dict__.values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # The candidates' attention: the dense attention's entries at them (one device: a key's column is itself).
    candidates = torch.arange(0, n, 7, device=DEVICE).expand(2, hq, -1).contiguous()
    attn = normalise(logits, row_max, row_sum)[:, :, :m]
    reference = attn.gather(-1, candidates[:, :, None].expand(-1, -1, m, -1))
    kernel = kernels.candidate_attention(
        q_obs[:, :m], k, rows[:m], candidates, candidates, row_max[..., :m], row_sum[..., :m], 0.125, row_starts[:, :m]
    )
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-6)


def test_whole_spread_estimate_through_the_kernels_with_documents(monkeypatch):
    """The spread estimate with every step on its Triton kernels (the interpreter on CPU: ``uses_triton`` forced)
    gives the PyTorch path's index and report inside documents, fp32."""
    pytest.importorskip("triton")
    import ds_mtraining.sparse.index as index_module
    from ds_mtraining.estimator.spread import candidates, evidence, greedy, report, tail

    q, k, documents = _planted([300, 200, 268], [{100: 0.3}, {50: 0.25}, {150: 0.3}])
    config = SparseAttentionConfig(
        sink_tokens=4, estimator=SpreadEstimator(rows=32, exclusion=64, max_columns=16, max_offsets=8)
    )
    pattern = AttentionPattern(q.shape[1], documents=documents)
    expected, expected_report = estimate_index(q, k, config, softmax_scale=1.0, return_report=True, pattern=pattern)
    for module in (candidates, evidence, greedy, report, tail, index_module):
        monkeypatch.setattr(module, "uses_triton", lambda device: True)
    q, k, documents = q.to(DEVICE), k.to(DEVICE), Documents(documents.starts.to(DEVICE))
    pattern = AttentionPattern(q.shape[1], documents=documents)
    index, got_report = estimate_index(q, k, config, softmax_scale=1.0, return_report=True, pattern=pattern)
    assert torch.equal(index.vertical.cpu(), expected.vertical)
    assert torch.equal(index.slash.cpu(), expected.slash)
    torch.testing.assert_close(got_report.recall.cpu(), expected_report.recall, atol=1e-6, rtol=0)
    assert {100, 300, 350, 500, 650} <= {int(c) for c in index.vertical[0, 0] if c >= 0}


def _distributed_worker(rank: int, world: int) -> None:
    groups = new_ring_groups(list(range(world)), None)
    lengths = [700, 500, 300]
    q, k, documents = _planted(lengths, [{300: 0.3}, {100: 0.25, 350: 0.2}, {200: 0.3}], heads=2)
    configs = [
        SparseAttentionConfig(sink_tokens=4, estimator=SpreadEstimator(rows=48, exclusion=64, max_columns=40)),
        SparseAttentionConfig(
            block_size=128,
            sink_tokens=2,
            local_blocks=2,
            estimator=BaselineEstimator(column_recall=0.9, diagonal_recall=0.9, last_q=100, max_columns=50),
        ),
    ]
    for config in configs:
        check_distributed_estimate(q, k, config, 1.0, groups, world, AttentionPattern(q.shape[1], documents=documents))


@pytest.mark.parametrize("world", [pytest.param(2, id="ring-2"), pytest.param(3, id="ring-3")])
def test_distributed_estimate_with_documents_equals_single_device(world):
    run_distributed(world, _distributed_worker, timeout=240)


def _chosen_problem(lengths_per_row: list[list[int]], seed: int):
    """The greedy's problem on random evidence for rows packed with these documents (one list per batch row, equal
    totals), random candidates, and random chosen columns and offsets on top of the forced ones."""
    from ds_mtraining.estimator.spread import greedy
    from ds_mtraining.estimator.spread.rows import spread_rows
    from ds_mtraining.estimator.spread.settings import SpreadSettings

    gen = torch.Generator().manual_seed(seed)
    starts = torch.cat([_documents(lengths).starts for lengths in lengths_per_row])
    batch, n = starts.shape
    config = SparseAttentionConfig(sink_tokens=4, estimator=SpreadEstimator(rows=24, exclusion=64))
    settings, bs, heads, kc = SpreadSettings.of(config), config.block_size, 2, 40
    nb = -(-n // bs)
    rows = spread_rows(n, 24, bs)
    picked = torch.rand(batch, heads, n - 4, generator=gen).argsort(-1)[..., : kc - 8] + 4
    candidates = torch.cat([torch.arange(4).expand(batch, heads, 4), picked.sort(-1).values], -1)
    candidates = torch.cat([candidates, torch.full((batch, heads, 4), n)], -1)  # padding
    block_mass = torch.rand(batch, heads, rows.numel(), nb, generator=gen)
    cand_attn = torch.rand(batch, heads, rows.numel(), kc, generator=gen)
    p = greedy._problem(block_mass, candidates, cand_attn, rows, n, settings, torch.float64, starts)
    p.chosen_col.logical_or_(torch.rand(p.chosen_col.shape, generator=gen) < 0.3).logical_and_(p.cand < n)
    p.chosen_off.logical_or_(torch.rand(p.chosen_off.shape, generator=gen) < 0.3)
    return p, settings, starts, heads


@pytest.mark.parametrize(
    "lengths_per_row",
    [
        pytest.param([[700]], id="one-document"),
        pytest.param([[1, 63, 64, 65, 200, 1, 306], [129, 127, 64, 380]], id="1-bs-1-bs-bs+1-mixed-B2"),
    ],
)
def test_greedy_costs_count_the_entries_inside_documents(lengths_per_row):
    """Every column's and offset's cost from the greedy's closed form equals the entries counted one by one from
    the definition: a column's rows of its document in unchosen tiles below its block; an offset's rows whose key
    block at that offset holds keys of their document (``bs`` entries each), minus the chosen columns' entries
    in those tiles. Documents of 1, bs - 1, bs, bs + 1 tokens and mixed, two batch rows with their own."""
    from ds_mtraining.estimator.spread import greedy

    p, settings, starts, heads = _chosen_problem(lengths_per_row, seed=len(lengths_per_row[0]))
    col_cost, off_cost = greedy._costs(p, settings)
    bs, n, nb = settings.block_size, starts.shape[1], p.chosen_off.shape[1]
    i = torch.arange(n)
    for g in range(p.cand.shape[0]):
        start = starts[g // heads]
        for slot, c in enumerate(p.cand[g].tolist()):
            if c >= n:
                continue
            offset = i // bs - c // bs
            rows = (start == start[c]) & (offset >= 1) & ~p.chosen_off[g, offset.clamp(0, nb - 1)]
            assert col_cost[g, slot] == rows.sum(), (g, c)
        chosen = [c for c, ok in zip(p.cand[g].tolist(), p.chosen_col[g].tolist()) if ok]
        for s in range(1, nb):
            tiles = bs * int((i // bs - s >= start // bs).sum())
            inside = sum(int(((start == start[c]) & (i // bs - c // bs == s)).sum()) for c in chosen)
            assert off_cost[g, s] == tiles - inside, (g, s)


def _greedy_inputs(monkeypatch, lengths: list[int], config: SparseAttentionConfig) -> tuple:
    """What ``estimate_index`` hands the greedy (``spread.greedy.select``'s arguments) on planted documents."""
    from ds_mtraining.estimator.spread import strategy

    captured = []
    real = strategy.select

    def capture(*args):
        captured.append(args)
        return real(*args)

    monkeypatch.setattr(strategy, "select", capture)
    columns = [{n // 3: 0.3} for n in lengths]
    q, k, documents = _planted(lengths, columns)
    estimate_index(q, k, config, softmax_scale=1.0, pattern=AttentionPattern(q.shape[1], documents=documents))
    (args,) = captured
    return args


@pytest.mark.parametrize("rounds", [1, 3])
def test_triton_greedy_scores_equal_torch_scores_inside_documents(monkeypatch, rounds):
    """The Triton rounds' ratios and forecasts (costs, column gains and offset scales counted inside documents)
    against the PyTorch rounds', on the greedy's real inputs from packed planted documents (the interpreter on
    CPU)."""
    pytest.importorskip("triton")
    from ds_mtraining.estimator.spread import greedy
    from ds_mtraining.estimator.triton import greedy as kernels

    config = SparseAttentionConfig(sink_tokens=4, estimator=SpreadEstimator(rows=48, exclusion=64, max_columns=24))
    block_mass, candidates, cand_attn, rows, seqlen, settings, _, starts = _greedy_inputs(
        monkeypatch, [300, 65, 64, 240, 131], config
    )
    schedule = (4, 8, 16)[:rounds]
    before = greedy._problem(block_mass, candidates, cand_attn, rows, seqlen, settings, torch.float64, starts)
    greedy._rounds(before, rows, seqlen, settings, schedule[:-1])
    want_ratio, want_forecast, _ = greedy._scores(
        before, greedy._geometry(before, rows, seqlen, settings), seqlen, settings
    )
    inputs = (block_mass, candidates, cand_attn, rows)
    p = greedy._problem(*(x.to(DEVICE) for x in inputs), seqlen, settings, torch.float32, starts.to(DEVICE))
    _, _, got_ratio, got_forecast = kernels.greedy_rounds(p, rows.to(DEVICE), seqlen, settings, schedule)
    eligible = want_ratio > float("-inf")
    assert eligible.sum() > 10, "the round must have eligible entries"
    assert torch.equal(got_ratio.cpu() > float("-inf"), eligible)
    scale = want_ratio[eligible].abs().max()
    torch.testing.assert_close(got_ratio.cpu()[eligible], want_ratio[eligible], rtol=1e-12, atol=1e-12 * scale)
    torch.testing.assert_close(got_forecast.cpu()[eligible], want_forecast[eligible], rtol=1e-12, atol=1e-15)
