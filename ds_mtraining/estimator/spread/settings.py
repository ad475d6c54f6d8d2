"""The ``"spread"`` strategy's settings: the one place it reads the layer's ``SparseAttentionConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig

__all__ = ["SpreadSettings"]


@dataclass(frozen=True)
class SpreadSettings:
    """What every step of the spread strategy reads (``SparseAttentionConfig``'s fields in brackets).

    Attributes:
        block_size: index tile size ``bs`` (``block_size``).
        rows: staggered observation rows (``spread_rows``).
        recall: the sampled rows' covered mass to reach (``spread_recall``).
        min_ratio: floor of a pick's estimated mean probability per new entry (``spread_min_ratio``).
        exclusion: entries nearer than this to their row are not column evidence (``spread_exclusion``).
        tail_rows: the last queries the tail repair covers (``spread_tail_rows``).
        tail_columns: most columns the tail repair adds (``spread_tail_columns``).
        vertical_max: most columns beyond the sinks (``vertical_max``).
        slash_max: most block offsets beyond the forced ones (``slash_max``).
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
    vertical_max: int
    slash_max: int
    sink_tokens: int
    local_blocks: int

    @classmethod
    def of(cls, config: SparseAttentionConfig) -> SpreadSettings:
        return cls(
            block_size=config.block_size,
            rows=config.spread_rows,
            recall=config.spread_recall,
            min_ratio=config.spread_min_ratio,
            exclusion=config.spread_exclusion,
            tail_rows=config.spread_tail_rows,
            tail_columns=config.spread_tail_columns,
            vertical_max=config.vertical_max,
            slash_max=config.slash_max,
            sink_tokens=config.sink_tokens,
            local_blocks=config.local_blocks,
        )
