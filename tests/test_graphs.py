"""``estimator.graphs``: the key a captured estimate is cached under, the cache object, and the CPU fallback (CUDA
replay itself is checked on a GPU by ``tests/gpu/test_gpu_estimator.py``: graph vs op by op on changing inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ds_mtraining.config import ESTIMATOR_CONFIGS, BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import GraphCache, LocalReducer, estimate_index
from ds_mtraining.estimator.estimate import estimate
from ds_mtraining.estimator.graphs import config_key
from ds_mtraining.estimator.spread.settings import SpreadSettings


def test_config_key_tells_every_knob_apart():
    """A graph captured for one setting must never be replayed for another: every field changes the key, the
    estimator's own settings included (of either strategy)."""
    base = SparseAttentionConfig()
    changed = {"block_size": 128, "estimator": BaselineEstimator(), "sink_tokens": 8, "local_blocks": 2}
    for name, value in changed.items():
        assert config_key(base.model_copy(update={name: value})) != config_key(base), name
    spread = {
        "rows": 64,
        "recall": 0.9,
        "min_ratio": 1e-4,
        "exclusion": 128,
        "tail_rows": 0,
        "tail_columns": 8,
        "max_columns": 512,
        "max_offsets": 512,
    }
    baseline = {
        "last_q": 32,
        "column_recall": 0.8,
        "diagonal_recall": 0.8,
        "min_columns": 8,
        "max_columns": 512,
        "min_diagonals": 8,
        "max_diagonals": 512,
    }
    for estimator, settings in ((SpreadEstimator(), spread), (BaselineEstimator(), baseline)):
        start = base.model_copy(update={"estimator": estimator})
        for name, value in settings.items():
            other = start.model_copy(update={"estimator": estimator.model_copy(update={name: value})})
            assert config_key(other) != config_key(start), (estimator.strategy, name)
    assert config_key(SparseAttentionConfig()) == config_key(base)
    assert config_key(SparseAttentionConfig(estimator=SpreadEstimator())) == config_key(base)
    hash(config_key(base))  # usable as a cache key


def test_config_key_of_the_spread_settings_tells_every_setting_apart():
    """The greedy's graphs are keyed by the strategy's settings: each of them changes the key."""
    base = SparseAttentionConfig()
    top = {"block_size": 128, "sink_tokens": 8, "local_blocks": 2}
    spread_fields = ("rows", "recall", "min_ratio", "exclusion", "tail_rows", "tail_columns")
    spread_fields += ("max_columns", "max_offsets")
    estimator = dict(zip(spread_fields, (64, 0.9, 1e-4, 128, 0, 8, 512, 512), strict=True))
    changed = [base.model_copy(update={name: value}) for name, value in top.items()]
    changed += [
        base.model_copy(update={"estimator": base.estimator.model_copy(update={name: value})})
        for name, value in estimator.items()
    ]
    for name, other in zip([*top, *estimator], changed, strict=True):
        assert config_key(SpreadSettings.of(other)) != config_key(SpreadSettings.of(base)), name


def test_replay_calls_the_function_on_cpu():
    calls = []

    def fn(x, y):
        calls.append(1)
        return x + y, None

    graphs = GraphCache()
    out, none = graphs.replay(fn, ("test", 1), (torch.ones(3), torch.arange(3.0)))
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0])) and none is None and len(calls) == 1
    assert len(graphs) == 0  # nothing captured off CUDA


def test_caches_are_separate_objects_and_the_estimate_is_the_same_with_or_without_one():
    """No module state: each cache holds its own graphs; on CPU the estimate with a cache equals the one without."""
    assert GraphCache()._graphs is not GraphCache()._graphs
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 300, 4, 16, generator=gen), torch.randn(1, 300, 2, 16, generator=gen)
    config = SparseAttentionConfig(block_size=64)
    plain, plain_report = estimate_index(q, k, config, return_report=True)
    cached, cached_report = estimate_index(q, k, config, return_report=True, graphs=GraphCache())
    assert torch.equal(plain.vertical, cached.vertical) and torch.equal(plain.slash, cached.slash)
    assert torch.equal(plain_report.recall, cached_report.recall)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        GraphCache(0)


class _Recording(GraphCache):
    """Records the key of every replay (on CPU a replay is a plain call)."""

    def __init__(self):
        super().__init__()
        self.keys: list[str] = []

    def replay(self, fn, key, inputs):
        self.keys.append(key[0])
        return super().replay(fn, key, inputs)


@dataclass(frozen=True)
class _ShardedLocal(LocalReducer):
    """The whole sequence on one rank, but declared sharded, as a ring's reducer is."""

    @property
    def sharded(self) -> bool:
        return True


@pytest.mark.parametrize(
    "estimator, sharded, replayed",
    [
        ("spread", False, ["estimate", "spread_select"]),  # the whole estimate (the greedy's replay nests in it)
        ("spread", True, ["spread_select"]),  # collectives cannot be captured: only the greedy, which has none
        ("baseline", False, []),  # not graphed
    ],
)
def test_the_whole_estimate_is_replayed_only_with_the_identity_reducer(estimator, sharded, replayed):
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 256, 2, 16, generator=gen), torch.randn(1, 256, 1, 16, generator=gen)
    config = SparseAttentionConfig(block_size=64, estimator=ESTIMATOR_CONFIGS[estimator]())
    reducer = (_ShardedLocal if sharded else LocalReducer).of(q)
    graphs = _Recording()
    got = estimate(q, k, config, reducer, softmax_scale=None, return_report=False, graphs=graphs)
    assert graphs.keys == replayed
    want = estimate_index(q, k, config)
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)


def test_constant_is_built_once_per_key_and_bounded():
    cache = GraphCache(capacity=1)
    builds = []

    def build(n):
        builds.append(n)
        return torch.arange(n)

    first = cache.constant(("rows", 4), lambda: build(4))
    assert cache.constant(("rows", 4), lambda: build(4)) is first
    for n in range(5, 9):  # 4 * capacity more keys: the first one is dropped
        cache.constant(("rows", n), lambda n=n: build(n))
    assert torch.equal(cache.constant(("rows", 4), lambda: build(4)), first)
    assert builds == [4, 5, 6, 7, 8, 4]


def test_estimate_with_a_cache_equals_without():
    """The cached observation rows change nothing: the same index and report, also on a second call."""
    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.estimator import estimate_index

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 700, 4, 32, generator=gen), torch.randn(1, 700, 2, 32, generator=gen)
    config = SparseAttentionConfig(block_size=64)
    plain, plain_report = estimate_index(q, k, config, return_report=True)
    cache = GraphCache()
    for _ in range(2):
        index, report = estimate_index(q, k, config, return_report=True, graphs=cache)
        assert torch.equal(index.vertical, plain.vertical) and torch.equal(index.slash, plain.slash)
        assert torch.equal(report.recall, plain_report.recall)
