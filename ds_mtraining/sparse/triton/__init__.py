"""Triton kernels for vertical-slash sparse attention (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Launchers: ``vertical_slash_forward`` (optionally merging into a running fp32 ``(out, lse)``),
``vertical_slash_backward`` (deterministic), and ``prepare_index``, which converts a ``VerticalSlashIndex``
to the kernels' per-tile form once so several calls (forward, backward, ring steps) can share it, and
``prepare_tile_map``, which places a shard's tiles in the global sequence for a ring step (``q_blocks`` /
``kv_blocks``).
"""

from .vertical_slash import (
    KernelIndex,
    TileMap,
    prepare_index,
    prepare_tile_map,
    vertical_slash_backward,
    vertical_slash_forward,
)

__all__ = [
    "KernelIndex",
    "TileMap",
    "prepare_index",
    "prepare_tile_map",
    "vertical_slash_backward",
    "vertical_slash_forward",
]
