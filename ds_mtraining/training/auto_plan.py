"""``"parallel": {"plan": "auto"}``: the job's parallel shape, chosen at start-up by the cluster simulator.

Which shape is fastest (Ulysses degree, a ring or all-gathered groups, the inner ring, the layout) depends on the
world, the node size, the links, the length and the kernels' per-call costs (issue 53): at 512K on 32 GPUs the plain
ring is 2x dense and Ulysses 8 x ring 3.5x in the simulator, and the order turns with the length. No rule of thumb
holds across those, and the simulator (``sim.report.rank_plans``) already replays each shape's dataflow on them with
the measured step costs, so the job asks it, as the user would with ``python -m ds_mtraining.sim``.

Without a written ``sequence_parallel_size`` the world is split into sequence groups of the sizes that divide it and
hold their share of the sequence in memory, the rest data parallel (one GPU a sequence included: the shipped
configs' shape), and the shapes are ranked by tokens a second over the whole world, so ``auto`` is never slower in
the simulator than one GPU a sequence would be. At short lengths one GPU a sequence wins; longer sequences train in
groups of a few ranks side by side before a group spans the world. Sizes are ranked from the shortest group up and
the search ends after two sizes in a row fall behind the best (``_group_sizes``).

Every rank runs the same deterministic ranking (a planted 5 % pattern, seed 0, the committed costs), so all pick the
same shape without a collective, before any process group exists. A key written in ``"parallel"`` keeps its value:
only the shapes that agree with it are ranked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ConfigError, ParallelConfig
from ..models import head_dim
from ..parallel.mesh import MeshError, MeshShape
from ..sim.cluster import ModelShape, Plan
from ..sim.memory import MemoryAssumptions, step_memory
from ..sim.presets import PRESETS
from ..sim.report import Predicted, candidate_plans, rank_plans, ranking_pattern
from ..sim.report import ranked as ranked_predictions

__all__ = ["CHOSEN_KEYS", "AutoPlan", "choose", "model_shape", "runtime_keys"]

CHOSEN_KEYS = ("sequence_parallel_size", "ulysses_degree", "ring_degree", "inner_ring_size", "kv_exchange", "layout")
"""The ``"parallel"`` keys ``plan: "auto"`` decides when they are not written."""


@dataclass(frozen=True)
class AutoPlan:
    """The shape ``plan: "auto"`` chose and why.

    Attributes:
        parallel: the ``"parallel"`` section with every key of :data:`CHOSEN_KEYS` decided.
        best / runner_up: the simulator's predictions for the chosen shape and the next one (``None``: no other, or
            nothing to choose: one rank a sequence).
        ranked: how many shapes were ranked.
        world: the launched ranks, which the shapes split into sequence groups.
    """

    parallel: ParallelConfig
    best: Predicted | None
    runner_up: Predicted | None
    ranked: int
    world: int = 1

    def describe(self) -> str:
        """The banner's line: the choice, its predicted attention per layer and step, and the runner-up's."""
        if self.best is None:
            return "plan      auto: one rank a sequence, no sequence parallelism to choose"

        def said(p: Predicted) -> str:
            attention, step, sequences = p.attention.layer_ms, p.step.step_s, p.step.sequences
            name = "one GPU a sequence" if sequences == self.world else p.plan.name
            side = f", {sequences} sequences side by side" if sequences > 1 else ""
            return f"{name}{side}: attention {attention:.1f} ms a layer (fwd + bwd), step {step:.2f} s"

        runner = f"; runner-up {said(self.runner_up)}" if self.runner_up is not None else ""
        return (
            f"plan      auto ({self.parallel.topology} nodes, {self.ranked} shapes ranked by the simulator, "
            f"predicted): {said(self.best)}{runner}"
        )

    def compare(self, measured_s: float) -> str | None:
        """The log's line after the first steps: the measured step beside the predicted one (``None``: no
        prediction)."""
        if self.best is None:
            return None
        predicted = self.best.step.step_s
        return (
            f"plan      auto: step measured {measured_s:.2f} s, predicted {predicted:.2f} s "
            f"({measured_s / predicted:.2f}x the prediction)"
        )


def runtime_keys(plan: Plan, sp: int, gpus_per_node: int, layout: str = "striped") -> dict[str, int | str | None]:
    """The ``"parallel"`` keys that run the simulator's ``plan`` on ``sp`` ranks of nodes of ``gpus_per_node`` GPUs
    (``sim.cluster.Plan.rings``, the shapes the simulator prices; a flat ring names its inner size, so the launch's
    node size does not make it hierarchical). Without a ring (Ulysses over the whole sequence) the layout and the
    exchange do nothing: ``layout`` and ``"ring"`` then, so such shapes compare equal."""
    u, ring, inner = plan.rings(sp, gpus_per_node)
    inner = inner or ring
    exchange, layout = (plan.kv_exchange, plan.layout) if ring > 1 else ("ring", layout)
    return {
        "sequence_parallel_size": sp, "ulysses_degree": u, "ring_degree": ring, "inner_ring_size": inner,
        "kv_exchange": exchange, "layout": layout,
    }  # fmt: skip


def model_shape(config) -> ModelShape:
    """The simulator's ``ModelShape`` of a transformers config: its attention shape and sizes; the non-attention
    costs per token stay the measured 3B shape's (they do not depend on the parallel shape, which is what is ranked)."""
    from ..memory import count_parameters

    heads = config.num_attention_heads
    return ModelShape(
        heads=heads, kv_heads=config.num_key_value_heads,
        head_dim=head_dim(config), layers=config.num_hidden_layers,
        params=float(count_parameters(config)), hidden=config.hidden_size, intermediate=config.intermediate_size,
        vocab=config.vocab_size,
    )  # fmt: skip


def memory_assumptions(ds_config: dict, tiled_mlp_tokens: int | str | None, fused: bool) -> MemoryAssumptions:
    """How the job holds its state, for the simulator's memory check of each shape: the DeepSpeed config's ZeRO stage,
    optimizer offload and ``cpu_checkpointing``, the MLP's tile (``"tiled_mlp": {"tokens_per_tile"}``, ``"auto"``
    decided per shape as start-up decides it) and whether Liger's fused kernels run."""
    from ..integration.deepspeed import optimizer_offloaded, zero_stage
    from ..integration.ds_config import cpu_checkpointing

    return MemoryAssumptions(
        zero_stage=zero_stage(ds_config), offload=optimizer_offloaded(ds_config),
        fused=fused, cpu_checkpointing=cpu_checkpointing(ds_config), mlp_tile=tiled_mlp_tokens,
    )  # fmt: skip


def _group_sizes(
    world: int, seqlen: int, model: ModelShape, topology: str, gpus_per_node: int, memory: MemoryAssumptions
) -> list[int]:
    """The sequence-group sizes worth ranking on ``world`` ranks (nodes of ``gpus_per_node``), shortest first: those
    that divide the world and whose GPUs and nodes hold their share of the sequence before attention
    (``sim.memory.step_memory``: weights, gradients, optimizer state, activations; the node's pinned memory); if none
    does, the whole world (ranked, and refused there if no shape fits). The
    shortest groups communicate least, so they are ranked first and the search ends where longer ones fall behind:
    ranking every size of a thousand ranks would take the simulator many minutes."""
    nodes = replace(PRESETS[topology], gpus_per_node=gpus_per_node)  # as rank_plans prices them
    sizes = [sp for sp in range(1, world + 1) if world % sp == 0]
    held = [sp for sp in sizes
            if step_memory(model, seqlen, sp, memory, nodes, data_parallel=world // sp).fits]  # fmt: skip
    return held or [world]


def _agrees(decided: dict, written: dict) -> bool:
    """Whether a shape's keys are the written ones (``inner_ring_size`` null: a flat ring, its size the ring's)."""
    for key, value in written.items():
        if key == "inner_ring_size" and value is None:
            value = decided["ring_degree"]
        if decided[key] != value:
            return False
    return True


def choose(
    parallel: ParallelConfig,
    *,
    world: int,
    gpus_per_node: int,
    seqlen: int,
    model: ModelShape,
    block_size: int,
    stripe: int | None,
    accumulation: int = 1,
    memory: MemoryAssumptions | None = None,
    source: str = "the config",
) -> AutoPlan:
    """Rank the shapes of ``world`` launched ranks (nodes of ``gpus_per_node``) that agree with the keys written in
    ``parallel`` and run on this model and length, sequence groups of every size with the rest data parallel unless
    ``sequence_parallel_size`` is written (module docstring), and return the one with the most tokens a second.

    Args:
        parallel: the config's ``"parallel"`` section (``plan == "auto"``).
        model: the model's attention shape and sizes (``sim.cluster.ModelShape``).
        block_size / stripe: the sparse block size and the layout's stripe (the length must split into them).
        accumulation: micro-batches per optimizer step (the step the prediction is for).
        memory: how the job holds its state (:func:`memory_assumptions`; default ``MemoryAssumptions()``, the shipped
            ``zero2_offload.json``): which group sizes fit, and each shape's memory verdict.
        source: names the config in errors.

    Raises:
        ConfigError: no shape agrees with the written keys and runs here (the message names the keys).
    """
    memory = MemoryAssumptions() if memory is None else memory
    written = {key: getattr(parallel, key) for key in CHOSEN_KEYS if key in parallel.model_fields_set}
    if "sequence_parallel_size" in written:
        sizes = [written["sequence_parallel_size"]]
        if world % sizes[0]:
            raise ConfigError(
                f"{source}: mtraining.parallel.sequence_parallel_size={sizes[0]} does not divide the {world} "
                "launched ranks"
            )
    else:
        sizes = _group_sizes(world, seqlen, model, parallel.topology, gpus_per_node, memory)
    one = {"sequence_parallel_size": 1, "ulysses_degree": 1, "ring_degree": 1, "inner_ring_size": None}
    if sizes == [1]:
        return AutoPlan(parallel.model_copy(update=one), None, None, 0, world)
    pattern = ranking_pattern(model, seqlen)
    counted: dict = {}  # the pattern's work counts, shared by the rankings of every size
    predicted, keys, refusals = [], {}, []  # keys: (sp, plan) -> the "parallel" keys that run it
    best_rate, behind = 0.0, 0
    for sp in sizes:
        plans = []
        # One GPU a sequence has one shape (the simulator prices it as a ring of one).
        candidates = [Plan(parallel.layout, "flat", columns=parallel.ring_columns)] if sp == 1 else candidate_plans(
            gpus_per_node, columns=parallel.ring_columns)  # fmt: skip
        for plan in candidates:
            u, ring, _ = plan.rings(sp, gpus_per_node)
            if u * ring != sp:  # a Ulysses degree above or not dividing the group
                continue
            decided = runtime_keys(plan, sp, gpus_per_node, parallel.layout) if sp > 1 else {
                **one, "kv_exchange": parallel.kv_exchange, "layout": parallel.layout}  # fmt: skip
            if not _agrees(decided, written) or decided in keys.values():  # the first of the plans that run alike
                continue
            try:
                shape = MeshShape.build(
                    world=world, ulysses=decided["ulysses_degree"], ring=decided["ring_degree"], q_heads=model.heads,
                    kv_heads=model.kv_heads, inner_ring=decided["inner_ring_size"],
                    kv_exchange=decided["kv_exchange"],
                )  # fmt: skip
                shape.layout(seqlen, kind=plan.layout, block_size=block_size, stripe=stripe)
            except MeshError:
                continue
            plans.append(plan)
            keys[sp, plan] = decided
        if not plans:
            continue
        # A sequence group of sp ranks, world / sp of them side by side: ranked by tokens a second over the world.
        ranked_here, refused = rank_plans(
            sp, seqlen, parallel.topology, shape=model, gpus_per_node=gpus_per_node, plans=plans, pattern=pattern,
            accumulation=accumulation, data_parallel=world // sp, counted=counted, assumptions=memory,
        )  # fmt: skip
        predicted += ranked_here
        refusals += refused
        rate = max((p.step.tokens_per_s for p in ranked_here if p.fits), default=0.0)
        if rate > best_rate:
            best_rate, behind = rate, 0
        elif best_rate > 0:  # sizes before the first that runs and fits are not behind anything
            behind += 1
        if behind == 2:  # longer groups only add communication: two sizes in a row behind the best end the search
            break
    if not keys:
        said = ", ".join(f"{k}={v}" for k, v in written.items()) or "none"
        raise ConfigError(
            f"{source}: mtraining.parallel.plan \"auto\" found no shape of {world} ranks ({gpus_per_node} a node) for "
            f"{seqlen} tokens that agrees with the keys written ({said}); drop some of them or write the degrees"
        )
    ranked = ranked_predictions(predicted)
    if not ranked:
        raise ConfigError(f"{source}: mtraining.parallel.plan \"auto\": the simulator runs none of the shapes "
                          f"({refusals[0][1]}); write the degrees")  # fmt: skip
    best = ranked[0]
    chosen = parallel.model_copy(update=keys[world // best.step.sequences, best.plan])
    return AutoPlan(chosen, best, ranked[1] if len(ranked) > 1 else None, len(ranked), world)
