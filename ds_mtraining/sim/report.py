"""The simulator's ranking of parallel plans and its table: every candidate plan (layout x ring x K/V exchange,
Ulysses degrees) simulated (:func:`rank_plans`, what a job choosing its plan would call), ranked by predicted step time
with its memory per GPU (and its node's RAM), each compared with one dense reference (the fastest dense plan of the
same cluster); the table as markdown lines.

Ranked by time, not by a ratio: a ratio against a dense ring on each plan's own layout (what the table used to print)
ranks a layout that slows dense down more than sparse (contiguous) above a faster one. A plan the card (or the node's
RAM) cannot hold ranks after every plan it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..memory import GiB
from .cluster import AttentionSim, ModelShape, Pattern, Plan, StepSim, simulate_attention, simulate_step
from .costs import CALIBRATED, KernelCosts
from .memory import MemoryAssumptions, StepMemory, plan_memory, step_memory
from .patterns import planted_pattern_index
from .presets import PRESETS
from .timeline import Topology

__all__ = [
    "COLUMNS", "KV_EXCHANGES", "LAYOUTS", "RINGS", "Predicted", "candidate_plans", "rank_plans", "ranked",
    "ranking_pattern", "table",
]  # fmt: skip

LAYOUTS = ("contiguous", "zigzag", "striped")
RINGS = ("flat", "hierarchical", "ulysses")
KV_EXCHANGES = ("ring", "all_gather")

COLUMNS = (
    "rank", "plan", "fwd ms", "bwd ms", "all-to-all ms", "worker imb.", "step imb.", "ring eff.", "exposed", "step s",
    "tokens/s", "vs dense ref.", "GiB a GPU",
)  # fmt: skip


@dataclass(frozen=True)
class Predicted:
    """One plan's prediction: one layer's attention (``attention.layer_ms``), the whole training step
    (``step.step_s``) and one GPU's memory (``memory.estimate``: bytes by kind; the levers as decided and the node's
    RAM, ``sim.memory.StepMemory``)."""

    attention: AttentionSim
    step: StepSim
    memory: StepMemory

    @property
    def plan(self) -> Plan:
        return self.attention.plan

    @property
    def fits(self) -> bool:
        """Whether start-up would run it: the GPU's peak and the node's pinned memory under their limits."""
        return self.memory.fits


def ranked(predicted: Sequence[Predicted]) -> list[Predicted]:
    """The predictions, most tokens a second first (for one data-parallel degree: the fastest step), the plans the
    card or the node's RAM cannot hold after the others."""
    return sorted(predicted, key=lambda p: (not p.fits, -p.step.tokens_per_s))


def candidate_plans(
    gpus_per_node: int,
    *,
    layouts: Sequence[str] = LAYOUTS,
    rings: Sequence[str] = RINGS,
    ulysses: Sequence[int] | None = None,
    kv_exchanges: Sequence[str] = KV_EXCHANGES,
    columns: str = "per_step",
) -> list[Plan]:
    """Every plan of ``layouts`` x ``rings`` (``ulysses``: a plan per degree, default every divisor > 1 of
    ``gpus_per_node``) x ``kv_exchanges``; ring-exchange plans first. Some may not run on a cluster
    (:func:`rank_plans` says why)."""
    degrees = [u for u in range(2, gpus_per_node + 1) if gpus_per_node % u == 0] if ulysses is None else ulysses
    return [
        Plan(layout, ring, u, columns, exchange)
        for exchange in kv_exchanges
        for ring in rings
        for u in (degrees if ring == "ulysses" else [1])
        for layout in layouts
    ]


def ranking_pattern(shape: ModelShape, seqlen: int, costs: KernelCosts = CALIBRATED) -> Pattern:
    """The pattern plans are ranked on unless one is given: planted at 5 % (seed 0, the same in every process),
    ``[1, shape.heads, ·]`` at the costs' block size."""
    return planted_pattern_index(1, shape.heads, seqlen, costs.block_size, density=0.05, seed=0)


def rank_plans(
    world: int,
    seqlen: int,
    topology: Topology | str = "h100",
    costs: KernelCosts = CALIBRATED,
    shape: ModelShape | None = None,
    *,
    gpus_per_node: int | None = None,
    pattern: Pattern | None = None,
    plans: Sequence[Plan] | None = None,
    assumptions: MemoryAssumptions | None = None,
    accumulation: int = 1,
    data_parallel: int = 1,
    counted: dict | None = None,
) -> tuple[list[Predicted], list[tuple[Plan, str]]]:
    """The plans for one ``seqlen``-token sequence on ``world`` GPUs, ranked (:func:`ranked`: best first), and those
    the cluster cannot run with why. Pure: no files, no devices. ``data_parallel``: such groups side by side, each
    with its own sequence (ZeRO's partitions and traffic span all of them).

    Args:
        topology: a :class:`Topology` or a preset's name (``sim.PRESETS``); ``gpus_per_node`` overrides its own.
        costs: the step costs (default: the committed calibration); shape: the model (default: the 3B shape).
        pattern: the attention pattern (``[1, Hq, ·]``, the costs' block size; default: planted at 5 %, seed 0).
        plans: the candidates (default: :func:`candidate_plans` of the node).
        assumptions: how the job holds its state (default: ``MemoryAssumptions()``; its ``"auto"`` decided on this
            topology's GPUs and nodes, ``sim.memory.step_memory``).
        counted: shared across calls on one pattern (``simulate_attention``'s).
    """
    topology = PRESETS[topology] if isinstance(topology, str) else topology
    if gpus_per_node is not None:
        topology = replace(topology, gpus_per_node=gpus_per_node)
    shape = ModelShape() if shape is None else shape
    if pattern is None:
        pattern = ranking_pattern(shape, seqlen, costs)
    assumptions = MemoryAssumptions() if assumptions is None else assumptions
    base = step_memory(shape, seqlen, world, assumptions, topology, data_parallel=data_parallel)
    counted = {} if counted is None else counted
    predicted, refused = [], []
    for plan in candidate_plans(topology.gpus_per_node) if plans is None else plans:
        try:
            att = simulate_attention(pattern, seqlen, world, plan, topology, costs, shape, counted=counted)
        except ValueError as err:
            refused.append((plan, str(err)))
            continue
        memory = plan_memory(base, att)
        step = simulate_step(
            att, seqlen, world, topology, shape, accumulation=accumulation, data_parallel=data_parallel
        )
        predicted.append(Predicted(att, step, memory))
    return ranked(predicted), refused


def table(sparse: Sequence[Predicted], dense: Sequence[Predicted], refused: Sequence[tuple[Plan, str]]) -> list[str]:
    """The markdown table of ``sparse`` (ranked) and the plans the cluster cannot run (``refused``: plan, why), then
    a line naming the fastest plan and the dense reference, the fastest of ``dense`` (empty: no comparison).

    Each plan's memory a GPU (``Predicted.memory``) is marked where it exceeds what a step may fill of the card, or
    where its node's pinned memory exceeds what the node's RAM may hold (``StepMemory.over``)."""
    reference = ranked(dense)[0] if dense else None
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    order = ranked(sparse)
    for rank, p in enumerate(order, 1):
        fwd, bwd, w = p.attention.forward, p.attention.backward, p.attention.work
        exposed = (fwd.exposed_ms + bwd.exposed_ms) / (fwd.total_ms + bwd.total_ms)
        versus = "-" if reference is None else f"{reference.step.step_s / p.step.step_s:.2f}x"
        gib = f"{p.memory.estimate.total / GiB:.1f}" + ("" if p.fits else f" ({p.memory.over()})")
        cells = (
            rank, p.plan.name, f"{fwd.total_ms:.1f}", f"{bwd.total_ms:.1f}", f"{p.attention.all_to_all_ms:.1f}",
            f"{w.worker_imbalance:.3f}", f"{w.step_imbalance:.3f}", f"{(fwd.efficiency + bwd.efficiency) / 2:.3f}",
            f"{exposed:.0%}", f"{p.step.step_s:.2f}", f"{p.step.tokens_per_s:,.0f}", versus, gib,
        )  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    for plan, why in refused:
        lines.append(f"| - | {plan.name} | not possible: {why} |" + " |" * (len(COLUMNS) - 3))
    lines.append("")
    if order:
        best = order[0]
        lines.append(f"Fastest predicted: `{best.plan.name}`, {best.step.step_s:.2f} s a step.")
    if reference is not None:
        lines.append(
            f"Dense reference: `{reference.plan.name}`, the fastest of the same plans run with dense attention (a "
            f"cuDNN-class dense ring), {reference.step.step_s:.2f} s a step; \"vs dense ref.\" is its step time over "
            "each plan's."
        )
    return lines
