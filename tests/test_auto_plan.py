"""``"parallel": {"plan": "auto"}``: the simulator's choice of shape for small launched worlds, the written keys kept,
the refusals, and the job's plan running the choice."""

from __future__ import annotations

import json

import pytest

from ds_mtraining.config import ConfigError, ParallelConfig
from ds_mtraining.sim.cluster import ModelShape
from ds_mtraining.training.auto_plan import choose, memory_assumptions


def _kind(p: ParallelConfig) -> str:
    """The shape of a decided ``"parallel"`` section, as the tests name it."""
    if p.ring_degree == 1:
        return "ulysses" if p.ulysses_degree > 1 else "none"
    ring = "hierarchical " if p.inner_ring_size < p.ring_degree else "flat "
    ring += "all-gather" if p.kv_exchange == "all_gather" else "ring"
    return ("ulysses x " if p.ulysses_degree > 1 else "") + ring


def _choose(world: int, node: int, seqlen: int, topology: str = "h100", memory=None, **written):
    return choose(ParallelConfig(plan="auto", topology=topology, **written), world=world, gpus_per_node=node,
                  seqlen=seqlen, model=ModelShape(), block_size=64, stripe=None, memory=memory)  # fmt: skip


# (world, GPUs a node, tokens, topology, the shape the simulator picks): on one GPU a node the ring hides its transfers
# behind its steps (since the 2026-12-07 column splits a small step no longer pays a fixed backward floor, which had
# made the whole K/V gathered in one call win short rows); in a node of 2, NVLink gathers the whole K/V at 64K faster
# than the ring passes it; a node of 2 or more puts Ulysses inside it; nodes of 4 on slow links gather each node's ring
# ranks.
SHAPES = [
    (2, 2, 65536, "h100", "flat all-gather"),
    (2, 1, 32768, "h100", "flat ring"),
    (4, 4, 32768, "h100", "ulysses"),
    (4, 2, 32768, "h100", "ulysses x flat ring"),
    (8, 4, 32768, "a100", "ulysses x hierarchical all-gather"),
]


@pytest.mark.parametrize(("world", "node", "seqlen", "topology", "expected"), SHAPES)
def test_auto_picks_each_shape_somewhere(world, node, seqlen, topology, expected):
    """Each shape wins for some small world whose ranks all hold one sequence, and the choice is the fastest of what
    was ranked, its keys consistent."""
    auto = _choose(world, node, seqlen, topology, sequence_parallel_size=world)
    p = auto.parallel
    assert _kind(p) == expected
    assert p.ulysses_degree * p.ring_degree == p.sequence_parallel_size == world
    assert auto.runner_up is not None and auto.ranked >= 2
    assert auto.best.step.step_s <= auto.runner_up.step.step_s
    assert auto.best.plan != auto.runner_up.plan
    line = auto.describe()
    assert line.startswith("plan      auto (") and auto.best.plan.name in line and "runner-up" in line
    assert f"{auto.best.attention.layer_ms:.1f} ms a layer" in line
    assert auto.compare(2 * auto.best.step.step_s).endswith("(2.00x the prediction)")


@pytest.mark.parametrize(
    ("world", "node", "seqlen", "topology", "sp", "expected"),
    [(2, 1, 8192, "h100", 1, "none"), (8, 4, 262144, "a100", 2, "flat all-gather")],
)
def test_auto_weighs_data_parallelism_against_longer_sequence_groups(world, node, seqlen, topology, sp, expected):
    """Without a written sequence_parallel_size, the world splits into sequence groups of every size, the rest data
    parallel, ranked by tokens a second: short sequences train one a GPU, longer ones in groups of a few ranks. The
    choice is never slower in the simulator than one GPU a sequence (the shipped configs' degrees) or one group of
    the whole world."""
    auto = _choose(world, node, seqlen, topology)
    p = auto.parallel
    assert (p.sequence_parallel_size, _kind(p)) == (sp, expected)
    assert p.ulysses_degree * p.ring_degree == sp
    assert auto.best.step.sequences == world // sp and auto.best.fits
    for written in (1, world):
        other = _choose(world, node, seqlen, topology, sequence_parallel_size=written)
        if other.best is not None:
            assert auto.best.step.tokens_per_s >= other.best.step.tokens_per_s
    assert f"{world // sp} sequences side by side" in auto.describe()
    assert ("one GPU a sequence" in auto.describe()) == (sp == 1)


def test_the_jobs_memory_levers_decide_which_groups_fit():
    """512K tokens of the 3B shape do not fit one H200 with the checkpoints on the GPU (129 GiB over 118.8), so two
    ranks share each sequence; with DeepSpeed's cpu_checkpointing, read from the job's config, one GPU holds it and
    auto trains a sequence a GPU, two side by side."""
    shipped = json.loads(open("ds_configs/zero2_offload.json").read())
    memory = memory_assumptions(shipped, None, True)
    assert (memory.zero_stage, memory.offload, memory.cpu_checkpointing, memory.mlp_tile) == (2, True, False, None)
    on_gpu = _choose(2, 1, 524288, "h200", memory=memory)
    assert on_gpu.parallel.sequence_parallel_size == 2
    on_host = memory_assumptions({**shipped, "activation_checkpointing": {"cpu_checkpointing": True}}, None, True)
    assert on_host.cpu_checkpointing
    auto = _choose(2, 1, 524288, "h200", memory=on_host)
    assert auto.parallel.sequence_parallel_size == 1 and auto.best.fits
    assert "2 sequences side by side" in auto.describe()


def test_written_keys_keep_their_values():
    """A key written in ``"parallel"`` is not the plan's to choose: only the shapes that agree with it are ranked."""
    free = _choose(4, 2, 32768, sequence_parallel_size=4)
    assert free.parallel.ulysses_degree == 2
    kept = _choose(4, 2, 32768, sequence_parallel_size=4, ulysses_degree=1)
    assert kept.parallel.ulysses_degree == 1 and kept.parallel.ring_degree == 4 and kept.ranked < free.ranked
    assert _choose(2, 1, 8192, sequence_parallel_size=2, kv_exchange="ring").parallel.kv_exchange == "ring"
    assert _choose(2, 1, 32768, sequence_parallel_size=2, layout="zigzag").parallel.layout == "zigzag"
    flat = _choose(8, 4, 32768, "a100", sequence_parallel_size=8, inner_ring_size=None, kv_exchange="ring")
    assert flat.parallel.inner_ring_size == flat.parallel.ring_degree  # null is a flat ring, the launch's node aside


def test_one_rank_a_sequence_has_nothing_to_choose():
    auto = _choose(4, 4, 8192, sequence_parallel_size=1)
    assert (auto.parallel.ulysses_degree, auto.parallel.ring_degree, auto.best) == (1, 1, None)
    assert "no sequence parallelism" in auto.describe() and auto.compare(1.0) is None


@pytest.mark.parametrize(
    ("written", "needles"),
    [
        ({"ulysses_degree": 3}, ["found no shape of 4 ranks", "ulysses_degree=3", "drop some of them"]),
        ({"sequence_parallel_size": 3}, ["sequence_parallel_size=3 does not divide the 4 launched ranks"]),
    ],
)
def test_no_shape_agrees_is_one_line(written, needles):
    with pytest.raises(ConfigError) as error:
        _choose(4, 2, 32768, **written)
    message = str(error.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_the_job_runs_the_choice(tmp_path, monkeypatch, capsys):
    """The job's plan on a launch of 4 ranks, 2 a node, one sequence over all four: the mesh is the simulator's choice
    for the model's own shape, the banner names it, and the config's other keys are kept."""
    from ds_mtraining.training import TrainSettings, plan

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "mtraining": {"parallel": {"plan": "auto", "ring_columns": "per_step", "sequence_parallel_size": 4}},
    }))  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    p = plan(TrainSettings(deepspeed=str(config), seqlen=2048, steps=1, output_dir=str(tmp_path / "out")))
    chosen = p.auto.parallel
    assert p.mtraining.parallel == chosen and chosen.plan == "auto" and chosen.ring_columns == "per_step"
    assert (p.shape.ulysses, p.shape.ring, p.shape.inner_ring, p.shape.kv_exchange) == (
        chosen.ulysses_degree, chosen.ring_degree, chosen.inner_ring_size, chosen.kv_exchange
    )
    assert p.shape.world == 4 and p.shape.sp == 4
    assert p.auto.describe() in capsys.readouterr().out
