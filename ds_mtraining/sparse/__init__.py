"""Single-device dynamic sparse attention: the index contract, its estimator, the attention API."""

from .attention import vertical_slash_attention
from .estimate import EstimateReport, estimate_index
from .index import VerticalSlashIndex, index_to_dense_mask
from .merge import merge_attention_
from .reference import reference_attention

__all__ = [
    "EstimateReport",
    "VerticalSlashIndex",
    "estimate_index",
    "index_to_dense_mask",
    "merge_attention_",
    "reference_attention",
    "vertical_slash_attention",
]
