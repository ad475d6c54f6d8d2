"""``sparse.graphs``: the key a captured estimate is cached under, and the CPU fallback (CUDA replay itself is
checked on a GPU by ``benchmarks/estimator_check.py``: graph vs op by op on changing inputs)."""

from __future__ import annotations

import torch

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.sparse.graphs import config_key, replay


def test_config_key_tells_every_knob_apart():
    """A graph captured for one setting must never be replayed for another: every field changes the key."""
    base = SparseAttentionConfig()
    changed = {
        "block_size": 128,
        "estimator": "baseline",
        "spread_rows": 64,
        "spread_recall": 0.9,
        "spread_min_ratio": 1e-4,
        "spread_exclusion": 128,
        "spread_tail_rows": 0,
        "spread_tail_columns": 8,
        "vertical_max": 512,
        "slash_max": 512,
        "sink_tokens": 8,
        "local_blocks": 2,
        "last_q": 32,
    }
    for name, value in changed.items():
        assert config_key(base.model_copy(update={name: value})) != config_key(base), name
    assert config_key(SparseAttentionConfig()) == config_key(base)
    hash(config_key(base))  # usable as a cache key


def test_replay_calls_the_function_on_cpu():
    calls = []

    def fn(x, y):
        calls.append(1)
        return x + y, None

    out, none = replay(fn, ("test", 1), (torch.ones(3), torch.arange(3.0)))
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0])) and none is None and len(calls) == 1
