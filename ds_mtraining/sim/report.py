"""The simulator's table: plans ranked by their predicted step time, each compared with one dense reference (the
fastest dense plan of the same cluster), with each plan's memory per GPU; as markdown lines.

Ranked by time, not by a ratio: a ratio against a dense ring on each plan's own layout (what the table used to print)
ranks a layout that slows dense down more than sparse (contiguous) above a faster one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..training.memory import GiB, MemoryEstimate
from .cluster import AttentionSim, Plan, StepSim
from .memory import fits, memory_limit_gib

__all__ = ["COLUMNS", "Predicted", "ranked", "table"]

COLUMNS = (
    "rank", "plan", "fwd ms", "bwd ms", "all-to-all ms", "worker imb.", "step imb.", "ring eff.", "exposed", "step s",
    "tokens/s", "vs dense ref.", "GiB a GPU",
)  # fmt: skip


@dataclass(frozen=True)
class Predicted:
    """One plan's prediction: one layer's attention (ms) and the whole training step (s)."""

    attention: AttentionSim
    step: StepSim

    @property
    def plan(self) -> Plan:
        return self.attention.plan


def ranked(predicted: Sequence[Predicted]) -> list[Predicted]:
    """The predictions, fastest training step first."""
    return sorted(predicted, key=lambda p: p.step.step_s)


def table(
    sparse: Sequence[Predicted],
    dense: Sequence[Predicted],
    refused: Sequence[tuple[Plan, str]],
    memory: MemoryEstimate,
    memory_gib: float,
) -> list[str]:
    """The markdown table of ``sparse`` (ranked) and the plans the cluster cannot run (``refused``: plan, why), then
    a line naming the fastest plan and the dense reference, the fastest of ``dense`` (empty: no comparison).

    ``memory``: one GPU's estimate (the same for every plan, ``sim.memory``), marked where it exceeds what a step may
    fill of a card of ``memory_gib``."""
    reference = ranked(dense)[0] if dense else None
    gib = f"{memory.total / GiB:.1f}"
    if not fits(memory, memory_gib):
        gib += f" (over {memory_limit_gib(memory_gib):.1f})"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    order = ranked(sparse)
    for rank, p in enumerate(order, 1):
        fwd, bwd, w = p.attention.forward, p.attention.backward, p.attention.work
        exposed = (fwd.exposed_ms + bwd.exposed_ms) / (fwd.total_ms + bwd.total_ms)
        versus = "-" if reference is None else f"{reference.step.step_s / p.step.step_s:.2f}x"
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
