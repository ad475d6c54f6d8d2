"""Whether a simulated plan fits the cluster: training's own start-up plan (``ds_mtraining.memory``) for the model
shape the simulator prices, on the topology's GPUs and nodes.

What the estimate counts per GPU depends on the tokens a GPU holds (``N / W`` of one sequence: every plan spreads the
whole sequence over the ``W`` GPUs, Ulysses or ring) and on ZeRO's partition group, which is the world (the mesh's
``MeshMPU`` hands DeepSpeed every DP x SP rank). So every ring plan of one cluster gets the same estimate; the ring's
K/V shards in flight are not in it (two shards of ``N / W`` tokens' K and V: small next to the activations). An
all-gathered plan (``Plan.kv_exchange``) holds more during a call (:func:`plan_memory`): its group's gathered K/V (``g``
shards, bf16) and, in the backward, the call's dK/dV over them (``g`` shards, fp32), added to the activations as one
layer's transient at the step's peak.

The levers are the job's (:class:`MemoryAssumptions`): the ZeRO stage, the optimizer state on the host
(``offload_optimizer``), the fused kernels, the checkpoints in pinned host memory (``cpu_checkpointing``) and the MLP in
tiles (``tiled_mlp.tokens_per_tile``, ``"auto"`` decided by ``memory.decide_auto`` as start-up decides it); every
layer checkpoints and no attention is kept (the ring path recomputes it). :func:`step_memory` returns the estimate
with the levers as decided, and the verdict is start-up's (``memory.Machine.fits``): the GPU's peak under
``memory.FILL`` of the card, and the node's pinned checkpoints and offloaded optimizer state (its
``min(gpus_per_node, world)`` ranks' together, ``Machine.needs``) under ``memory.HOST_FILL`` of its RAM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace
from typing import Any, Literal

from ..memory import FILL, HOST_FILL, GiB, Machine, MemoryEstimate, decide_auto, estimate_memory
from .cluster import AttentionSim, ModelShape
from .timeline import Topology

__all__ = ["MemoryAssumptions", "StepMemory", "memory_line", "plan_memory", "step_memory"]


@dataclass(frozen=True)
class MemoryAssumptions:
    """How the training job holds its state (the defaults: ``ds_configs/zero2_offload.json`` with the fused kernels,
    what ``ModelShape``'s times were measured with).

    Attributes:
        zero_stage: DeepSpeed's ZeRO stage (0-3).
        offload: the optimizer state lives on the host (``offload_optimizer``).
        fused: Liger's fused kernels and loss (``fused_kernels``).
        cpu_checkpointing: the activation checkpoints wait in pinned host memory
            (``"activation_checkpointing": {"cpu_checkpointing": true}``).
        mlp_tile: the MLP runs in tiles of this many tokens (``"tiled_mlp": {"tokens_per_tile": N}``; None: whole;
            ``"auto"``: decided as start-up decides it, :func:`step_memory`).
    """

    zero_stage: int = 2
    offload: bool = True
    fused: bool = True
    cpu_checkpointing: bool = False
    mlp_tile: int | None | Literal["auto"] = None


@dataclass(frozen=True)
class StepMemory:
    """One GPU's step as start-up plans it: the estimate (bytes, by kind), the levers it was priced with (decided) and
    the machine it is checked on.

    Attributes:
        estimate: one GPU's peak (``memory.estimate_memory``; ``host_checkpoints`` its checkpoints in pinned memory).
        assumptions: the levers as asked (``mlp_tile`` may be ``"auto"``).
        levers: ``estimate_memory``'s levers as decided (``offload``, ``checkpoints_on_host``, ``checkpoint_every``,
            ``mlp_tile``: an int or None, ``kept_attention_layers``), what ``memory.decide_auto`` returns.
        machine: a GPU of the topology, its node's RAM and the job's ranks on a node.
    """

    estimate: MemoryEstimate
    assumptions: MemoryAssumptions
    levers: Mapping[str, Any]
    machine: Machine

    @property
    def peaks(self) -> tuple[int, int]:
        """The GPU's peak and its node's host memory, bytes (``Machine.needs``: every local rank's pinned checkpoints
        and, with offload, its optimizer state)."""
        return self.machine.needs(self.estimate, self.levers["offload"])

    @property
    def fits(self) -> bool:
        """Whether start-up would run it (``Machine.fits``: ``FILL`` of the GPU, ``HOST_FILL`` of the RAM)."""
        return self.machine.fits(self.peaks)

    @property
    def gpu_fits(self) -> bool:
        """Whether the GPU's peak fits (``Machine.fits`` of it alone: under ``FILL`` of the card)."""
        return self.machine.fits((self.peaks[0], 0))

    @property
    def host_fits(self) -> bool:
        """Whether the node's pinned memory fits (``Machine.fits`` of it alone: under ``HOST_FILL`` of the RAM)."""
        return self.machine.fits((0, self.peaks[1]))

    @property
    def gpu_limit_gib(self) -> float:
        """What a step may fill of the card, GiB."""
        return FILL * self.machine.device_bytes / GiB

    @property
    def host_limit_gib(self) -> float:
        """What the node's ranks may pin of its RAM, GiB."""
        return HOST_FILL * self.machine.host_bytes / GiB

    def over(self) -> str:
        """What it exceeds, for a table's cell: ``""`` where it fits, else the card's or the node RAM's limit (GiB)."""
        if not self.gpu_fits:
            return f"over {self.gpu_limit_gib:.1f}"
        host = self.peaks[1] / GiB
        return "" if self.host_fits else f"node RAM {host:.0f} over {self.host_limit_gib:.0f}"

    def describe(self) -> str:
        """The levers as decided, e.g. ``ZeRO-2, optimizer state on the CPU, fused kernels, checkpoints in pinned
        host memory, MLP in tiles of 65536 tokens (auto)``; the checkpoints on the GPU and the MLP whole go unsaid
        unless ``"auto"`` chose the latter."""
        a, tile = self.assumptions, self.levers["mlp_tile"]
        said = [f"ZeRO-{a.zero_stage}", f"optimizer state {'on the CPU' if a.offload else 'on the GPU'}",
                f"{'fused' if a.fused else 'unfused'} kernels"]  # fmt: skip
        if self.levers["checkpoints_on_host"]:
            said.append("checkpoints in pinned host memory")
        auto = " (auto)" if a.mlp_tile == "auto" else ""
        if tile is not None:
            said.append(f"MLP in tiles of {tile} tokens{auto}")
        elif auto:
            said.append(f"MLP untiled{auto}")
        return ", ".join(said)


def step_memory(
    shape: ModelShape,
    seqlen: int,
    world: int,
    assumptions: MemoryAssumptions,
    topology: Topology,
    *,
    data_parallel: int = 1,
) -> StepMemory:
    """One GPU's step of one ``seqlen``-token sequence spread over ``world`` GPUs, ``data_parallel`` such groups side
    by side (ZeRO over all of them), on ``topology``'s GPUs and nodes: ``assumptions``' ``"auto"`` decided by
    ``memory.decide_auto`` (the training job's own decision, on the same estimate and machine), then priced."""
    config = SimpleNamespace(  # the fields estimate_memory reads of a transformers config
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        vocab_size=shape.vocab,
    )  # fmt: skip
    estimate = partial(
        estimate_memory, config, params=int(shape.params), zero_stage=assumptions.zero_stage, dp=world * data_parallel,
        tokens=seqlen // world, fused=assumptions.fused, dtype_bytes=shape.grad_bytes,  # the training dtype's
    )  # fmt: skip
    # A job smaller than a node shares the node's RAM only among its own ranks.
    machine = Machine(
        device_bytes=int(topology.memory_gib * GiB), host_bytes=int(topology.host_gib * GiB),
        ranks_per_host=min(topology.gpus_per_node, world * data_parallel),
    )  # fmt: skip
    # Every layer checkpoints; the kept attention is not priced ("auto" keeps it only where it fits, a ring never).
    levers = {
        "offload": assumptions.offload, "checkpoints_on_host": assumptions.cpu_checkpointing, "checkpoint_every": 1,
        "mlp_tile": assumptions.mlp_tile, "kept_attention_layers": 0,
    }  # fmt: skip
    levers, _ = decide_auto(estimate, levers, machine, kept_layers=0)
    return StepMemory(estimate(**levers), assumptions, levers, machine)


def plan_memory(memory: StepMemory, attention: AttentionSim) -> StepMemory:
    """``memory`` (:func:`step_memory`) with ``attention``'s plan's own transient: an all-gathered group's K/V
    (``attention.gathered_bytes``, bf16) and the backward call's fp32 dK/dV of as many shards (twice those bytes);
    nothing for a ring plan. The levers stay as decided: start-up decides them without the plan's transient."""
    estimate = replace(memory.estimate, activations=memory.estimate.activations + 3 * attention.gathered_bytes)
    return replace(memory, estimate=estimate)


def _lowering(memory: StepMemory) -> list[str]:
    """The flags that would lower what ``memory`` exceeds (the GPU's peak, the node's pinned memory or both), each
    lever that is off (as ``--offload`` etc.) or on where it costs host memory."""
    a, gpu_over, host_over = memory.assumptions, not memory.gpu_fits, not memory.host_fits
    on_gpu = (
        ("more GPUs (--world)", True), ("--offload", not a.offload),
        (f"--zero-stage {a.zero_stage + 1}", a.zero_stage < 3), ("--fused", not a.fused),
        ("--cpu-checkpointing", not a.cpu_checkpointing), ("--mlp-tile auto", a.mlp_tile is None),
    )  # fmt: skip
    on_host = (
        ("more GPUs (--world)", not gpu_over), ("--no-cpu-checkpointing", a.cpu_checkpointing),
        ("--no-offload", a.offload), ("a node with more RAM (--host-gib)", True),
    )  # fmt: skip
    return [flag for flag, applies in on_gpu * gpu_over + on_host * host_over if applies]


def memory_line(memory: StepMemory, seqlen: int, world: int) -> str:
    """One line: what ``memory`` holds on a GPU and in its node's RAM, under which levers (as decided), and whether it
    fits (with what would lower it when it does not)."""
    (gpu, host), gpu_limit, host_limit = (p / GiB for p in memory.peaks), memory.gpu_limit_gib, memory.host_limit_gib
    card, ram = memory.machine.device_bytes / GiB, memory.machine.host_bytes / GiB
    if memory.gpu_fits:
        on_gpu = f"fits: under the {FILL:.0%} of the card's {card:.1f} GiB a step may fill ({gpu_limit:.1f})"
    else:
        on_gpu = f"does NOT fit the {FILL:.0%} of the card's {card:.1f} GiB a step may fill ({gpu_limit:.1f})"
    if memory.host_fits:
        on_host = f"fits: under the {HOST_FILL:.0%} of its {ram:.0f} GiB they may pin ({host_limit:.1f})"
    else:
        on_host = f"does NOT fit the {HOST_FILL:.0%} of its {ram:.0f} GiB they may pin ({host_limit:.1f})"
    levers = _lowering(memory)
    verdict = "It fits." if not levers else f"It does not fit: {', '.join(levers)} would lower it."
    ranks = memory.machine.ranks_per_host
    owners = f"{ranks} GPUs'" if ranks > 1 else "1 GPU's"
    return (
        f"Memory a GPU (`memory.estimate_memory`, start-up's check; {memory.describe()}, ZeRO over all "
        f"{world} GPUs, {seqlen // world:,} tokens a GPU), the same for every ring plan: {memory.estimate.describe()}, "
        f"{gpu:.1f} GiB in all, which {on_gpu}. Host memory a node ({owners} pinned "
        f"checkpoints and offloaded optimizer state): {host:.1f} GiB, which {on_host}. {verdict} An all-gathered plan "
        "adds its gathered K/V (bf16) and their dK/dV (fp32) to the activations: its row's GiB."
    )
