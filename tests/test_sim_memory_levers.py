"""The simulator's memory line knows the levers the training job's start-up plan uses (issue 55): the checkpoints in
pinned host memory, the MLP in tiles (``"auto"`` decided as the job decides it), and the node's RAM, each priced by
``ds_mtraining.memory`` itself."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from ds_mtraining.config import MTrainingConfig
from ds_mtraining.memory import HOST_CHECKPOINTS_ON_GPU, GiB, Machine, MemoryEstimate, estimate_memory, plan_memory
from ds_mtraining.parallel.mesh import MeshShape
from ds_mtraining.sim import PRESETS, ModelShape
from ds_mtraining.sim.__main__ import main
from ds_mtraining.sim.memory import MemoryAssumptions, step_memory
from ds_mtraining.training.auto_plan import model_shape

SHAPE = ModelShape()  # the 3B shape the simulator prices by default
CONFIG = SimpleNamespace(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, vocab_size=151936)
LONG = ["--seqlen", "8388608", "--world", "8", "--topology", "h200", "--rings", "ulysses", "--ulysses", "8"]
TOKENS = 8388608 // 8  # a GPU's tokens in LONG


def _today(
    seqlen: int, world: int, *, zero_stage: int = 2, offload: bool = True, fused: bool = True, dp: int = 1, **levers
) -> MemoryEstimate:
    """``estimate_memory`` as the simulator called it before issue 55, with ``levers`` added."""
    return estimate_memory(CONFIG, params=3_090_000_000, zero_stage=zero_stage, dp=world * dp, offload=offload,
                           tokens=seqlen // world, fused=fused, dtype_bytes=2, **levers)  # fmt: skip


def _memory_line(text: str) -> str:
    [line] = [line for line in text.splitlines() if line.startswith("Memory a GPU")]
    return line


def _gib_column(text: str) -> list[str]:
    """The table's "GiB a GPU" cells, one a plan ranked."""
    return [row.strip("|").split("|")[-1].strip() for row in text.splitlines() if re.match(r"\| \d+ \|", row)]


def _run(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("seqlen", "world", "dp", "assumptions"),
    [(8388608, 8, 1, MemoryAssumptions()), (131072, 1, 4, MemoryAssumptions(zero_stage=3, offload=False)),
     (524288, 32, 1, MemoryAssumptions(zero_stage=1, fused=False))],
)  # fmt: skip
def test_the_defaults_price_exactly_todays_estimate(seqlen, world, dp, assumptions):
    assert MemoryAssumptions() == MemoryAssumptions(2, True, True, cpu_checkpointing=False, mlp_tile=None)
    memory = step_memory(SHAPE, seqlen, world, assumptions, PRESETS["h200"], data_parallel=dp)
    a = assumptions
    assert memory.estimate == _today(seqlen, world, zero_stage=a.zero_stage, offload=a.offload, fused=a.fused, dp=dp)
    assert memory.levers == {"offload": a.offload, "checkpoints_on_host": False, "checkpoint_every": 1,
                             "mlp_tile": None, "kept_attention_layers": 0}  # fmt: skip
    assert memory.estimate.host_checkpoints == 0


def test_the_defaults_at_8m_tokens_are_the_248_gib_of_issue_55():
    memory = step_memory(SHAPE, 8388608, 8, MemoryAssumptions(), PRESETS["h200"])
    assert memory.estimate.total / GiB == pytest.approx(248.134, abs=1e-3)
    assert not memory.fits and not memory.gpu_fits and memory.host_fits


@pytest.mark.parametrize(
    ("world", "dp", "topology", "ranks"), [(8, 1, "h200", 8), (2, 1, "h100", 2), (4, 4, "a100", 8)]
)
def test_checkpoints_on_the_host_are_trainings_estimate_and_count_per_node(world, dp, topology, ranks):
    """The GPU keeps ``HOST_CHECKPOINTS_ON_GPU`` layer inputs' worth, the node's RAM every checkpoint of each of its ranks plus their offloaded
    optimizer state; a job smaller than a node shares it among its own ranks only."""
    seqlen = 8388608
    memory = step_memory(SHAPE, seqlen, world, MemoryAssumptions(cpu_checkpointing=True), PRESETS[topology],
                         data_parallel=dp)  # fmt: skip
    expected = _today(seqlen, world, dp=dp, checkpoints_on_host=True)
    assert memory.estimate == expected and memory.levers["checkpoints_on_host"] is True
    checkpoint = seqlen // world * 2048 * 2  # one layer's input, bf16
    assert expected.host_checkpoints == 36 * checkpoint  # a power of two: pinned as it is
    on_host = 36 - HOST_CHECKPOINTS_ON_GPU
    assert _today(seqlen, world, dp=dp).activations - expected.activations == on_host * checkpoint
    node = Machine(int(PRESETS[topology].memory_gib * GiB), int(PRESETS[topology].host_gib * GiB), ranks)
    assert memory.machine == node
    gpu, host = node.needs(expected, True)
    assert (
        memory.peaks
        == (gpu, host)
        == (expected.total, ranks * (36 * checkpoint + expected.host_state))
    )
    assert memory.fits == node.fits((gpu, host))


def test_the_node_ram_decides_with_the_gpu():
    """Start-up's verdict: the same GPU peak fails on a node whose RAM cannot pin the checkpoints."""
    small = replace(PRESETS["h200"], host_gib=64.0)
    assumptions = MemoryAssumptions(cpu_checkpointing=True, mlp_tile=65536)
    at = {"shape": SHAPE, "seqlen": 8388608, "world": 8, "assumptions": assumptions}
    roomy, short = step_memory(topology=PRESETS["h200"], **at), step_memory(topology=small, **at)
    assert roomy.estimate == short.estimate and roomy.peaks[1] / GiB == pytest.approx(1223.022, abs=1e-3)
    assert roomy.fits and not short.fits and short.gpu_fits and not short.host_fits
    assert short.over() == "node RAM 1223 over 54" and roomy.over() == ""


QWEN_3B = AutoConfig.from_pretrained("model_configs/qwen2.5-3b")


@pytest.mark.parametrize(
    ("seqlen", "world", "topology", "fused", "cpu", "tile"),
    [
        (1048576, 8, "h200", True, False, None),  # 40 GiB whole: no tile
        (524288, 1, "h200", False, False, 32768),  # the measured 512K, unfused: 164 GiB whole
        (4194304, 8, "h200", True, False, 65536),
        (8388608, 8, "h200", False, True, 65536),  # the checkpoints on the host, the MLP still too wide
        (2097152, 8, "h100", True, False, 65536),
    ],
)  # fmt: skip
def test_auto_tile_is_the_training_jobs_decision(seqlen, world, topology, fused, cpu, tile):
    """``--mlp-tile auto`` picks what the job's start-up plan (``memory.plan_memory``) picks for the same model, levers
    and machine."""
    shape = model_shape(QWEN_3B)
    memory = step_memory(shape, seqlen, world, MemoryAssumptions(fused=fused, cpu_checkpointing=cpu, mlp_tile="auto"),
                         PRESETS[topology])  # fmt: skip
    ds_config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
                 "activation_checkpointing": {"cpu_checkpointing": cpu}}  # fmt: skip
    mtraining = MTrainingConfig.model_validate({"activation_checkpointing": {"keep_attention": False},
                                                "tiled_mlp": {"tokens_per_tile": "auto"}})  # fmt: skip
    mesh = MeshShape.build(world=world, ulysses=1, ring=world, q_heads=16, kv_heads=2)
    machine = Machine(int(PRESETS[topology].memory_gib * GiB), int(PRESETS[topology].host_gib * GiB), min(world, 8))
    decided, _ = plan_memory(ds_config, mtraining, QWEN_3B, mesh, tokens=seqlen, seqlen=seqlen, source="t.json",
                             fused=fused, machine=machine)  # fmt: skip
    assert memory.levers["mlp_tile"] == decided.tiled_mlp.tokens_per_tile == tile
    assert memory.fits  # each case fits once decided (plan_memory did not refuse it)
    untiled = step_memory(shape, seqlen, world, MemoryAssumptions(fused=fused, cpu_checkpointing=cpu),
                          PRESETS[topology])  # fmt: skip
    assert untiled.gpu_fits == (tile is None)  # it tiles exactly where the whole MLP does not fit


def test_the_cli_fits_8m_tokens_with_the_checkpoints_on_the_host(capsys):
    expected = _today(8388608, 8, checkpoints_on_host=True, mlp_tile=65536)  # auto tiles the MLP: whole, 128 GiB
    host = 8 * (expected.host_checkpoints + expected.host_state) / GiB
    text = _run(capsys, [*LONG, "--cpu-checkpointing", "--mlp-tile", "auto"])
    line = _memory_line(text)
    assert (
        "ZeRO-2, optimizer state on the CPU, fused kernels, checkpoints in pinned host memory, MLP in tiles of 65536 "
        "tokens (auto), "
        "ZeRO over all 8 GPUs, 1,048,576 tokens a GPU"
    ) in line
    assert f"{expected.total / GiB:.1f} GiB in all, which fits: under the 85% of the card's 139.8 GiB" in line
    assert (f"Host memory a node (8 GPUs' pinned checkpoints and offloaded optimizer state): {host:.1f} GiB, which "
            "fits: under the 85% of its 2048 GiB they may pin (1740.8). It fits.") in line  # fmt: skip
    assert f"{expected.total / GiB:.1f}" == "97.7" and set(_gib_column(text)) == {"97.7"}  # no row marked over
    without = _memory_line(_run(capsys, [*LONG, "--mlp-tile", "auto"]))
    tiled = _today(8388608, 8, mlp_tile=8192)  # no tile fits: the smallest, as the job would refuse it with
    assert "fused kernels, MLP in tiles of 8192 tokens (auto), ZeRO over all" in without
    assert f"{tiled.total / GiB:.1f} GiB in all, which does NOT fit the 85% of the card's 139.8 GiB" in without
    levers = re.search(r"It does not fit: (.*) would lower it\.", without).group(1).split(", ")
    assert levers == ["more GPUs (--world)", "--zero-stage 3", "--cpu-checkpointing"]  # the tile is already auto


def test_the_cli_names_host_memory_when_the_node_cannot_pin_the_checkpoints(capsys):
    argv = [*LONG, "--cpu-checkpointing", "--mlp-tile", "auto", "--host-gib", "64", "--layouts", "striped",
            "--kv-exchange", "ring", "--no-dense"]  # fmt: skip
    text = _run(capsys, argv)
    line = _memory_line(text)
    assert (
        "Host memory a node (8 GPUs' pinned checkpoints and offloaded optimizer state): 1223.0 GiB, which does "
        "NOT fit the 85% of its 64 GiB they may pin (54.4)"
    ) in line
    assert "GiB in all, which fits: under the 85% of the card's 139.8 GiB" in line  # the GPU is not the problem
    levers = re.search(r"It does not fit: (.*) would lower it\.", line).group(1).split(", ")
    assert levers == [
        "more GPUs (--world)",
        "--no-cpu-checkpointing",
        "--no-offload",
        "a node with more RAM (--host-gib)",
    ]
    assert _gib_column(text) == ["94.1 (node RAM 1223 over 54)"]  # the plan's row is marked too


def test_the_memory_flags_are_checked_and_name_the_levers_that_are_off(capsys):
    # 6e9 parameters with their optimizer state on one GPU (ZeRO-0): over an H100, every lever off named.
    argv = ["--seqlen", "4096", "--world", "2", "--rings", "flat", "--layouts", "striped", "--params", "6e9",
            "--no-offload", "--zero-stage", "0", "--no-fused", "--kv-exchange", "ring", "--no-dense"]  # fmt: skip
    line = _memory_line(_run(capsys, argv))
    assert "Host memory a node (2 GPUs' pinned checkpoints and offloaded optimizer state): 0.0 GiB" in line
    levers = re.search(r"It does not fit: (.*) would lower it\.", line).group(1).split(", ")
    assert levers == ["more GPUs (--world)", "--offload", "--zero-stage 1", "--fused", "--cpu-checkpointing",
                      "--mlp-tile auto"]  # fmt: skip
    line = _memory_line(_run(capsys, [*argv, "--mlp-tile", "4096", "--cpu-checkpointing"]))
    assert "checkpoints in pinned host memory, MLP in tiles of 4096 tokens, ZeRO over" in line
    for bad in ("512", "big"):
        with pytest.raises(SystemExit):
            main([*argv, "--mlp-tile", bad])
        assert "is not auto, none or a number of tokens >= 1024" in capsys.readouterr().err
