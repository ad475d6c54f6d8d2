"""ds-mtraining: DeepSpeed training on ultra-long contexts with dynamic vertical-slash sparse attention.

Tensor layout everywhere public: ``[B, N, H, D]`` (batch, tokens, heads, head dim); log-sum-exp is
``[B, H, N]``, fp32, natural log. Configuration lives in ``ds_mtraining.config`` (pydantic), imported on
demand so the kernels can be used where pydantic is not installed.
"""

from .estimator import EstimateReport, estimate_index
from .sparse import VerticalSlashIndex, index_to_dense_mask, vertical_slash_attention

__version__ = "0.1.0"

__all__ = ["EstimateReport", "VerticalSlashIndex", "estimate_index", "index_to_dense_mask", "vertical_slash_attention"]
