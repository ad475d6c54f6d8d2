"""ds-mtraining: DeepSpeed training on ultra-long contexts with dynamic vertical-slash sparse attention.

Tensor layout everywhere public: ``[B, N, H, D]`` (batch, tokens, heads, head dim); log-sum-exp is
``[B, H, N]``, fp32, natural log. The attention entry points are gathered in ``ds_mtraining.attention`` and
exported here. Configuration lives in ``ds_mtraining.config`` (pydantic), imported on
demand so the kernels can be used where pydantic is not installed.
"""

from .attention import (
    AttentionPattern,
    Documents,
    VerticalSlashIndex,
    masked_sparse_attention,
    sparse_ring_attention,
    vertical_slash_attention,
    vertical_slash_attention_naive,
)
from .estimator import EstimateReport, estimate_index

__version__ = "0.1.0"

__all__ = [
    "AttentionPattern",
    "Documents",
    "EstimateReport",
    "VerticalSlashIndex",
    "estimate_index",
    "masked_sparse_attention",
    "sparse_ring_attention",
    "vertical_slash_attention",
    "vertical_slash_attention_naive",
]
