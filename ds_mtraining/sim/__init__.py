"""Cluster-scale simulator of the sparse ring: its work per (rank, step), the balancing levers, the measured kernel
costs and a replay of the ring's dataflow on a topology, no GPU needed."""

from ..parallel.work import gathered_columns_work
from .balance import COLUMNS, LOCAL, BalancedSchedule, balance_ring, balance_tile_work
from .comm_cost import column_bytes, shard_bytes
from .costs import CALIBRATED, KernelCosts, StepCost
from .timeline import PRESETS, RingTimeline, Topology, ring_timeline

__all__ = [
    "CALIBRATED",
    "COLUMNS",
    "LOCAL",
    "PRESETS",
    "BalancedSchedule",
    "KernelCosts",
    "RingTimeline",
    "StepCost",
    "Topology",
    "balance_ring",
    "balance_tile_work",
    "column_bytes",
    "gathered_columns_work",
    "ring_timeline",
    "shard_bytes",
]
