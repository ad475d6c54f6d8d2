"""The ``"spread"`` strategy's settings: the one place it reads the layer's ``SparseAttentionConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..strategy import index_wide

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig

__all__ = ["SpreadSettings"]


@dataclass(frozen=True)
class SpreadSettings:
    """What every step of the spread strategy reads (``SparseAttentionConfig``'s fields in brackets).

    Attributes:
        block_size: index tile size ``bs`` (``block_size``).
        rows: staggered observation rows (``estimator.rows``).
        recall: the sampled rows' covered mass to reach (``estimator.recall``).
        min_ratio: floor of a pick's estimated mean probability per new entry (``estimator.min_ratio``).
        exclusion: entries nearer than this to their row are not column evidence (``estimator.exclusion``).
        tail_rows: the last queries the tail repair covers (``estimator.tail_rows``).
        tail_columns: most columns the tail repair adds (``estimator.tail_columns``).
        max_columns: most columns beyond the sinks (``estimator.max_columns``).
        max_offsets: most block offsets beyond the forced ones (``estimator.max_offsets``).
        sink_tokens: forced columns ``0 .. sink_tokens - 1`` (``sink_tokens``).
        local_blocks: forced offsets ``0 .. local_blocks - 1`` (``local_blocks``).
    """

    block_size: int
    rows: int
    recall: float
    min_ratio: float
    exclusion: int
    tail_rows: int
    tail_columns: int
    max_columns: int
    max_offsets: int
    sink_tokens: int
    local_blocks: int

    @classmethod
    def of(cls, config: SparseAttentionConfig) -> SpreadSettings:
        return cls(**index_wide(config), **config.estimator.model_dump(exclude={"strategy"}))
