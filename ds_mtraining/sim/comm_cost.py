"""What the ring moves: the bytes of a K/V shard and of the gathered columns (``sim.timeline`` prices them on the
links)."""

from __future__ import annotations

from ..sparse.pattern import AttentionPattern


def shard_bytes(local_len: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of one rank's K and V shard: ``2 · local_len · kv_heads · head_dim · dtype_bytes``."""
    return 2 * local_len * kv_heads * head_dim * dtype_bytes


def column_bytes(pattern: AttentionPattern, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of the gathered columns' K and V of ``pattern`` (with an index): per KV head, the union of its query
    heads' columns."""
    index, seqlen = pattern.index, pattern.seqlen
    if index is None:
        raise ValueError("column_bytes needs a pattern with an index (a dense pattern has no columns)")
    group = index.heads // kv_heads
    mask = index.column_mask(seqlen).view(index.batch, kv_heads, group, seqlen).any(2)
    return 2 * int(mask.sum()) * head_dim * dtype_bytes
