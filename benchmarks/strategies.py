"""The estimator settings the benchmarks time, by name, and the CUDA graphs the estimates replay from."""

from __future__ import annotations

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import GraphCache

# SparseAttentionConfig's defaults, except the block size (spelled out: the recorded results were taken with them).
BASE = {"pattern": "vertical_slash", "block_size": 128, "sink_tokens": 4, "local_blocks": 1}
"""The index-wide settings every strategy below shares."""
BASELINE = BaselineEstimator(
    last_q=64, column_recall=0.9, diagonal_recall=0.9, min_columns=0, max_columns=1024, min_diagonals=0,
    max_diagonals=1024,
)  # fmt: skip
SPREAD = SpreadEstimator(
    rows=128, recall=0.98, max_columns=1024, max_offsets=1024, min_ratio=0.0, exclusion=256, tail_rows=32,
    tail_columns=64,
)  # fmt: skip
STRATEGIES = {
    "baseline": SparseAttentionConfig(**BASE, estimator=BASELINE),
    "spread": SparseAttentionConfig(**BASE, estimator=SPREAD),
    "spread, 64 rows": SparseAttentionConfig(**BASE, estimator=SPREAD.model_copy(update={"rows": 64})),
    "spread, 2048 columns": SparseAttentionConfig(**BASE, estimator=SPREAD.model_copy(update={"max_columns": 2048})),
    "spread, 4096 columns": SparseAttentionConfig(**BASE, estimator=SPREAD.model_copy(update={"max_columns": 4096})),
}
"""The settings each timed estimator column uses, by its name."""
GRAPHS = GraphCache()
"""The CUDA graphs the estimates replay from: the training job's attention handle owns one such cache per model."""
