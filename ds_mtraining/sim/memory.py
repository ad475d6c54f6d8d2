"""Whether a simulated plan fits the card: training's own start-up estimate (``memory.estimate_memory``)
for the model shape the simulator prices.

What the estimate counts per GPU depends on the tokens a GPU holds (``N / W`` of one sequence: every plan spreads the
whole sequence over the ``W`` GPUs, Ulysses or ring) and on ZeRO's partition group, which is the world (the mesh's
``MeshMPU`` hands DeepSpeed every DP x SP rank). So every ring plan of one cluster gets the same estimate; the ring's
K/V shards in flight are not in it (two shards of ``N / W`` tokens' K and V: small next to the activations). An
all-gathered plan (``Plan.kv_exchange``) holds more during a call (:func:`plan_memory`): its group's gathered K/V (``g``
shards, bf16) and, in the backward, the call's dK/dV over them (``g`` shards, fp32), added to the activations as one
layer's transient at the step's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from ..memory import FILL, GiB, MemoryEstimate, estimate_memory
from .cluster import AttentionSim, ModelShape

__all__ = ["MemoryAssumptions", "fits", "gpu_memory", "memory_limit_gib", "memory_line", "plan_memory"]


@dataclass(frozen=True)
class MemoryAssumptions:
    """How the training job holds its state (the defaults: ``ds_configs/zero2_offload.json`` with the fused kernels,
    what ``ModelShape``'s times were measured with).

    Attributes:
        zero_stage: DeepSpeed's ZeRO stage (0-3).
        offload: the optimizer state lives on the host (``offload_optimizer``).
        fused: Liger's fused kernels and loss (``fused_kernels``).
    """

    zero_stage: int = 2
    offload: bool = True
    fused: bool = True

    def describe(self) -> str:
        where = "on the CPU" if self.offload else "on the GPU"
        return f"ZeRO-{self.zero_stage}, optimizer state {where}, {'fused' if self.fused else 'unfused'} kernels"


def gpu_memory(
    shape: ModelShape, seqlen: int, world: int, assumptions: MemoryAssumptions, *, data_parallel: int = 1
) -> MemoryEstimate:
    """One GPU's peak in a step of one ``seqlen``-token sequence spread over ``world`` GPUs, ``data_parallel`` such
    groups side by side (ZeRO over all of them; bytes, by kind)."""
    config = SimpleNamespace(  # the fields estimate_memory reads of a transformers config
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        vocab_size=shape.vocab,
    )  # fmt: skip
    return estimate_memory(
        config, params=int(shape.params), zero_stage=assumptions.zero_stage, dp=world * data_parallel,
        offload=assumptions.offload,
        tokens=seqlen // world, fused=assumptions.fused, dtype_bytes=shape.grad_bytes,  # the training dtype's
    )  # fmt: skip


def plan_memory(estimate: MemoryEstimate, attention: AttentionSim) -> MemoryEstimate:
    """``estimate`` (:func:`gpu_memory`) with ``attention``'s plan's own transient: an all-gathered group's K/V
    (``attention.gathered_bytes``, bf16) and the backward call's fp32 dK/dV of as many shards (twice those bytes);
    nothing for a ring plan."""
    return replace(estimate, activations=estimate.activations + 3 * attention.gathered_bytes)


def memory_limit_gib(memory_gib: float) -> float:
    """What a step may fill of a card of ``memory_gib`` (``memory.FILL`` of it, as start-up checks)."""
    return FILL * memory_gib


def fits(estimate: MemoryEstimate, memory_gib: float) -> bool:
    """Whether ``estimate`` stays under what a step may fill of a card of ``memory_gib``."""
    return estimate.total / GiB <= memory_limit_gib(memory_gib)


def memory_line(
    estimate: MemoryEstimate, assumptions: MemoryAssumptions, seqlen: int, world: int, memory_gib: float
) -> str:
    """One line: what ``estimate`` holds, under which assumptions, and whether it fits a card of ``memory_gib``
    (with what would lower it when it does not)."""
    total, limit = estimate.total / GiB, memory_limit_gib(memory_gib)
    if fits(estimate, memory_gib):
        verdict = f"fits: under the {FILL:.0%} of the card's {memory_gib:.1f} GiB a step may fill ({limit:.1f})"
    else:
        levers = ["more GPUs (--world)"] + ["--offload"] * (not assumptions.offload) + [
            f"--zero-stage {assumptions.zero_stage + 1}"
        ] * (assumptions.zero_stage < 3) + ["--fused"] * (not assumptions.fused)
        verdict = (
            f"does NOT fit the {FILL:.0%} of the card's {memory_gib:.1f} GiB a step may fill ({limit:.1f}); "
            f"{', '.join(levers)} would lower it"
        )
    return (
        f"Memory a GPU (`memory.estimate_memory`, start-up's check; {assumptions.describe()}, ZeRO over all "
        f"{world} GPUs, {seqlen // world:,} tokens a GPU), the same for every ring plan: {estimate.describe()}, "
        f"{total:.1f} GiB in all, which {verdict}. An all-gathered plan adds its gathered K/V (bf16) and their "
        "dK/dV (fp32) to the activations: its row's GiB."
    )
