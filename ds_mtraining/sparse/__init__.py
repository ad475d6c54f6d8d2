"""Single-device dynamic sparse attention: the index contract, the pattern that carries it, and the attention API (the estimator of the index is
``ds_mtraining.estimator``, which builds on this package)."""

from .attention import masked_sparse_attention, vertical_slash_attention
from .documents import Documents
from .index import VerticalSlashIndex, index_to_dense_mask
from .merge import merge_attention_
from .naive import vertical_slash_attention_naive
from .pattern import AttentionPattern
from .reference import reference_attention

__all__ = [
    "AttentionPattern",
    "Documents",
    "VerticalSlashIndex",
    "index_to_dense_mask",
    "masked_sparse_attention",
    "merge_attention_",
    "reference_attention",
    "vertical_slash_attention",
    "vertical_slash_attention_naive",
]
