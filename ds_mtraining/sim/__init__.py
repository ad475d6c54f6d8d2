"""Cluster-scale simulator of the sparse ring: balancing levers and a communication model, no GPU needed."""

from ..parallel.work import gathered_columns_work
from .balance import COLUMNS, LOCAL, BalancedSchedule, balance_ring, balance_tile_work
from .comm_cost import Cluster, RingTime, column_bytes, ring_time, shard_bytes

__all__ = [
    "COLUMNS",
    "LOCAL",
    "BalancedSchedule",
    "Cluster",
    "RingTime",
    "balance_ring",
    "balance_tile_work",
    "column_bytes",
    "gathered_columns_work",
    "ring_time",
    "shard_bytes",
]
