"""Cluster-scale simulator of the sparse ring, no GPU needed: its work per (rank, step) (vertical-slash and
block-sparse patterns), the balancing levers, the measured step costs, the ring's dataflow replayed on a topology
(named clusters: ``presets``), a whole training step, whether it fits a GPU's memory, and the ranked report
(``python -m ds_mtraining.sim``; the ranking alone, for a job choosing its plan: ``sim.report.rank_plans``, not
imported here: it loads training's memory estimate)."""

from ..parallel.work import gathered_columns_work
from .balance import COLUMNS, LOCAL, BalancedSchedule, balance_ring, balance_tile_work
from .block_patterns import BlockPattern, block_ring_work, moba_pattern, xattention_pattern
from .cluster import DENSE_COSTS, AttentionSim, ModelShape, Plan, StepSim, simulate_attention, simulate_step
from .comm_cost import column_bytes, shard_bytes
from .costs import CALIBRATED, KernelCosts, StepCost, StepTerms
from .presets import PRESETS
from .timeline import RingTimeline, Topology, ring_timeline

__all__ = [
    "CALIBRATED",
    "COLUMNS",
    "DENSE_COSTS",
    "LOCAL",
    "PRESETS",
    "AttentionSim",
    "BalancedSchedule",
    "BlockPattern",
    "KernelCosts",
    "ModelShape",
    "Plan",
    "RingTimeline",
    "StepCost",
    "StepSim",
    "StepTerms",
    "Topology",
    "balance_ring",
    "balance_tile_work",
    "block_ring_work",
    "column_bytes",
    "gathered_columns_work",
    "moba_pattern",
    "ring_timeline",
    "shard_bytes",
    "simulate_attention",
    "simulate_step",
    "xattention_pattern",
]
