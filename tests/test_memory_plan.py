"""Start-up checks of the engine: the memory estimate (``ds_mtraining.memory``), the DeepSpeed arch-list
fix, and the ops DeepSpeed is about to build."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen2Config

from ds_mtraining.config import ConfigError, MTrainingConfig
from ds_mtraining.integration.deepspeed import normalize_cuda_arch_list
from ds_mtraining.memory import HOST_CHECKPOINTS_ON_GPU, GiB, Machine, check_memory, count_parameters, estimate_memory

QWEN_3B = AutoConfig.from_pretrained("model_configs/qwen2.5-3b")
H200 = int(139.8 * GiB)
H100 = 85_520_809_984  # an H100 80GB HBM3's total_memory (79.6 GiB)
RAM = 2 * 2**40  # a node's RAM: 2 TiB
LEVERS = {"offload": True, "checkpoints_on_host": False, "checkpoint_every": 1, "mlp_tile": None,
          "kept_attention_layers": 0}  # fmt: skip


def _check(levers: dict, tokens: int, *, fused: bool = True, device: int = H200, ram: int = RAM, ranks: int = 1,
           params: int | None = None) -> str | None:
    estimate = partial(estimate_memory, QWEN_3B, params=params or count_parameters(QWEN_3B), zero_stage=2, dp=1,
                       tokens=tokens, fused=fused)  # fmt: skip
    return check_memory(estimate, LEVERS | levers, Machine(device, ram, ranks), source="c.json", seqlen=tokens)


def test_parameter_count_is_the_models():
    config = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    # MLP, q (bias), o (no bias), k and v (biases), two norms
    layer = 3 * 32 * 64 + (32 * 32 + 32) + 32 * 32 + 2 * (32 * 16 + 16) + 2 * 32
    assert count_parameters(config) == 100 * 32 + 2 * layer + 32  # tied embedding, layers, final norm
    assert count_parameters(QWEN_3B) == 3_085_938_688  # Qwen2.5-3B's published count


def test_partitioning_by_zero_stage():
    kwargs = dict(params=1000, dp=4, offload=False, tokens=0)
    stages = [estimate_memory(QWEN_3B, zero_stage=s, **kwargs) for s in range(4)]
    assert [(e.weights, e.gradients, e.optimizer) for e in stages] == [
        (2000, 2000, 14000), (2000, 2000, 3500), (2000, 500, 3500), (500, 500, 3500)
    ]
    assert estimate_memory(QWEN_3B, zero_stage=2, **(kwargs | {"offload": True})).optimizer == 0


def test_offload_not_needed_is_a_note_with_the_time_it_costs():
    def note(tokens: int, fused: bool = True, p: int | None = None) -> str | None:
        return _check({}, tokens, fused=fused, params=p)

    assert note(131072).startswith("note: c.json offloads the optimizer state (40.2 GiB)") and "1.2 s shorter" in note(131072)
    assert "estimated peak 113 of 140 GiB" in note(262144)  # ran without offload at 112.7 GiB
    assert note(262144, fused=False) is None  # without offload it ran out of memory
    assert note(8192, p=50_000_000) is None  # a small model: nothing worth a note


# The H200 peaks of ``benchmarks/results/2026-12-04-h200-train_step.md`` (GiB; Qwen2.5-3B, ZeRO-2), keyed by
# (offload, fused, tokens): the lowest peak of the rows that ran a micro-batch inside an accumulation (the dense rows
# ran only the boundary one, which without offload holds no accumulated gradients: 5.3 GiB less).
MEASURED_PEAKS = {
    (True, True, 131072): 40.2, (True, True, 262144): 71.5, (True, False, 131072): 48.0,
    (False, True, 131072): 82.4, (False, True, 262144): 111.5, (False, False, 131072): 90.2,
}  # fmt: skip


@pytest.mark.parametrize("key", MEASURED_PEAKS)
def test_the_estimate_is_close_to_the_measured_peaks(key):
    offload, fused, tokens = key
    e = estimate_memory(QWEN_3B, params=count_parameters(QWEN_3B), zero_stage=2, dp=1, offload=offload,
                        tokens=tokens, fused=fused)  # fmt: skip
    assert abs(e.total / GiB / MEASURED_PEAKS[key] - 1) < 0.045, e.describe()


# With the checkpoints in host memory: one H100 (``benchmarks/results/2026-12-07-h100-checkpoint_offload_memory.md``;
# zero2_offload.json, fused, sparse), keyed by tokens. 128K held 33.7 GiB before the loss stopped asking transformers
# for every layer's hidden states (which kept the checkpoints on the GPU too).
MEASURED_HOST_CHECKPOINT_PEAKS = {131072: 24.0, 262144: 39.0}


@pytest.mark.parametrize("tokens", MEASURED_HOST_CHECKPOINT_PEAKS)
def test_the_estimate_with_checkpoints_on_the_host_is_close_to_the_measured_peaks(tokens):
    e = estimate_memory(QWEN_3B, params=count_parameters(QWEN_3B), zero_stage=2, dp=1, offload=True, tokens=tokens,
                        fused=True, checkpoints_on_host=True)  # fmt: skip
    assert abs(e.total / GiB / MEASURED_HOST_CHECKPOINT_PEAKS[tokens] - 1) < 0.045, e.describe()
    assert e.host_checkpoints == 36 * tokens * 2048 * 2


def test_a_config_without_offload_that_cannot_fit_is_refused_naming_what_would_fit():
    """Fused 256K ran at a 112.7 GiB peak; unfused 256K ran out of memory in its first micro-batch: refused, with the
    offload and the checkpoints in host memory each named with its estimated peaks."""
    assert _check({"offload": False}, 131072, fused=False) is None
    assert _check({"offload": False}, 262144) is None
    with pytest.raises(ConfigError) as err:
        _check({"offload": False}, 262144, fused=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("c.json: a rank needs about 132 GiB of GPU memory at 262144 tokens (weights 5.7")
    assert "more than a step can fill (85% of the GPU's 140 GiB, 85% of the node's 2048 GiB of RAM)" in message
    assert '"offload_optimizer": {"device": "cpu"}} (as in ds_configs/zero2_offload.json) (estimated peak 88 GiB, ' \
           "64 GiB of the node's RAM)" in message  # fmt: skip
    assert '"cpu_checkpointing": true} (estimated peak 102 GiB, 36 GiB of the node\'s RAM)' in message
    assert '"tiled_mlp": {"tokens_per_tile": 32768} (estimated peak 111 GiB)' in message
    assert message.endswith('or spread each sequence over more GPUs ("parallel": {"sequence_parallel_size"})')


def test_zero2_offload_at_256k_on_an_h100_is_refused_before_it_runs_out_of_memory():
    """It ran out of GPU memory in its first micro-batch (67.8 GiB allocated): refused at start-up, naming the
    checkpoints in host memory and the tiled MLP, each with its peak."""
    with pytest.raises(ConfigError) as err:
        _check({}, 262144, device=H100)
    message = str(err.value)
    assert message.startswith("c.json: a rank needs about 69 GiB of GPU memory at 262144 tokens"), message
    assert '"cpu_checkpointing": true} (estimated peak 39 GiB, 100 GiB of the node\'s RAM)' in message, message
    assert '"tiled_mlp": {"tokens_per_tile": 32768} (estimated peak 62 GiB, 64 GiB of the node\'s RAM)' in message
    assert "offload_optimizer" not in message  # already offloaded, and the state does not fit on the GPU
    assert _check({"checkpoints_on_host": True}, 262144, device=H100) is None


def test_host_memory_counts_every_rank_of_the_node_and_the_closest_settings_that_fit_are_named():
    """8 ranks of a node pinning 36 GiB of checkpoints and 64 GiB of optimizer state each: 800 GiB of a 768 GiB node.
    The closest setting that fits moves the checkpoints back and tiles the MLP; several changes at once are named
    together, the fewest first; where nothing fits, the smallest peak reached."""
    with pytest.raises(ConfigError) as err:
        _check({"checkpoints_on_host": True}, 262144, device=H100, ram=768 * GiB, ranks=8)
    message = str(err.value)
    assert "; the node 800 GiB of RAM), more than a step can fill (85% of the GPU's 80 GiB, 85% of the node's 768 GiB" \
           in message  # fmt: skip
    assert ('it fits with "activation_checkpointing": {"cpu_checkpointing": false} and "tiled_mlp": {"tokens_per_tile":'
            " 32768} (estimated peak 62 GiB, 512 GiB of the node's RAM); or shorten") in message  # fmt: skip
    with pytest.raises(ConfigError, match=r"no setting here makes it fit \(at best estimated peak 355 GiB, \d+ GiB of "
                                          r"the node's RAM\): shorten --seqlen"):  # fmt: skip
        _check({}, 4 * 1048576, device=H100)
    with pytest.raises(ConfigError) as err:
        _check({"offload": False, "kept_attention_layers": 35}, 524288, fused=False)
    assert ('it fits with "activation_checkpointing": {"cpu_checkpointing": true} and "tiled_mlp": {"tokens_per_tile": '
            '32768} and "keep_attention": false (estimated peak 103 GiB, ') in str(err.value)  # fmt: skip


def test_pinned_pieces_hold_any_size_in_a_few_powers_of_two_within_a_64th():
    """What the offloaded checkpoints are pinned in: powers of two, largest first, at most 7, their sum at least the
    size and under 1/64 more (a single pinned block takes up to twice: ``pinned_bytes``)."""
    from ds_mtraining.memory import pinned_bytes, pinned_pieces

    assert pinned_pieces(5 * 2**28) == [2**30, 2**28] and pinned_bytes(5 * 2**30) == 2**33
    assert pinned_pieces(0) == [] and pinned_pieces(1) == [1] and pinned_pieces(2**40) == [2**40]
    sizes = torch.randint(1, 2**40, (2000,), generator=torch.Generator().manual_seed(0)).tolist() + list(range(1, 300))
    for n in sizes:
        pieces = pinned_pieces(n)
        assert all(p & (p - 1) == 0 for p in pieces) and pieces == sorted(set(pieces), reverse=True), n
        assert n <= sum(pieces) < n + n / 64 + 1 and len(pieces) <= 7, (n, pieces)
        assert pinned_bytes(n) >= n and pinned_bytes(n) & (pinned_bytes(n) - 1) == 0 and pinned_bytes(n) < 2 * n


def test_offload_keeps_only_the_reduce_buckets_of_the_gradients_on_the_gpu():
    params = count_parameters(QWEN_3B)
    kwargs = dict(params=params, zero_stage=2, dp=1, tokens=0, offload=True)
    assert estimate_memory(QWEN_3B, **kwargs).gradients == 2 * 500_000_000 * 2
    small = estimate_memory(QWEN_3B, **kwargs, reduce_bucket=1000)
    assert small.gradients == 4000 and small.offloaded_gradients == params * 2 - 4000


@pytest.mark.parametrize(
    "value,expected",
    [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("9.0 10.0f", "9.0 10.0"), ("9.0", None), ("8.6+PTX", None)],
)
def test_arch_specific_entries_are_rewritten_for_deepspeed(monkeypatch, value, expected):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    assert normalize_cuda_arch_list() == expected
    assert __import__("os").environ["TORCH_CUDA_ARCH_LIST"] == (expected or value)


def test_ops_deepspeed_will_build_are_named_before_it_builds_them(tmp_path, monkeypatch):
    """DeepSpeed JIT-compiles its CPU communication op and CPU Adam (about 2.5 min on 2 cores) without a word; the
    job names what it is about to build, and nothing once torch's extension cache holds it."""
    import json

    from ds_mtraining.integration.deepspeed import ops_to_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    configs = Path(__file__).resolve().parents[1] / "ds_configs"
    offload = json.loads((configs / "zero2_offload.json").read_text())
    plain = json.loads((configs / "zero2.json").read_text())
    cpu = not torch.cuda.is_available()
    assert ops_to_build(offload) == ["deepspeed_shm_comm"] * cpu + ["cpu_adam"]
    assert ops_to_build(plain) == (["deepspeed_shm_comm"] if cpu else ["fused_adam"])
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert ops_to_build(offload) == ["deepspeed_shm_comm"] * cpu


def test_the_start_up_estimate_partitions_over_every_rank(monkeypatch):
    """ZeRO cuts the optimizer state over the DP x SP ranks (``MeshMPU``): counting it over DP alone put 32x the
    state on each GPU of a 32-rank sequence-parallel run and could refuse a config that fits."""
    from types import SimpleNamespace

    from ds_mtraining import memory
    from ds_mtraining.parallel.mesh import MeshShape

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the machine of memory.this_machine
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200))
    monkeypatch.setattr(memory, "estimate_memory", lambda config, **kwargs: seen.update(kwargs))

    def check(estimate, levers, machine, **kwargs):
        estimate(**levers)
        seen["levers"] = dict(levers)

    monkeypatch.setattr(memory, "check_memory", check)
    monkeypatch.setattr(memory, "decide_auto", lambda estimate, levers, machine, **kwargs: (
        dict(levers) | {"kept_attention_layers": 0 if levers["kept_attention_layers"] == "auto" else
                        levers["kept_attention_layers"]}, []))  # fmt: skip
    model_config = SimpleNamespace(num_hidden_layers=2)
    monkeypatch.setattr(memory, "count_parameters", lambda config: 1000)
    shape = MeshShape.build(world=8, ulysses=1, ring=4, q_heads=4, kv_heads=2)
    kwargs = dict(tokens=4096, seqlen=4096, source="c.json", fused=False)
    decided, notes = memory.plan_memory({"zero_optimization": {"stage": 2}}, MTrainingConfig(), model_config, shape,
                                        **kwargs)  # fmt: skip
    assert decided.activation_checkpointing.keep_attention is False and notes == []
    assert shape.dp == 2 and seen["dp"] == 8
    assert seen["levers"] == {"offload": False, "checkpoints_on_host": False, "checkpoint_every": 1, "mlp_tile": None,
                              "kept_attention_layers": 0}  # fmt: skip
    config = {"zero_optimization": {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True}}
    mtraining = MTrainingConfig.model_validate({"activation_checkpointing": {"layers": 3, "keep_attention": True},
                                                "tiled_mlp": {"tokens_per_tile": 1024}})  # fmt: skip
    memory.plan_memory(config, mtraining, model_config, shape, **kwargs)
    # keep_attention serves the one-device path only: this mesh has a ring of 4
    assert seen["levers"] == {"offload": False, "checkpoints_on_host": True, "checkpoint_every": 3, "mlp_tile": 1024,
                              "kept_attention_layers": 0}  # fmt: skip


def test_checkpoint_placement_moves_the_checkpoints_and_prices_the_layers_that_keep_their_activations():
    """Every layer checkpointed on the GPU is the fitted default; on the host the GPU keeps two layer inputs (the one
    in its backward and the one fetched ahead) and pinned memory all of them; a layer that does not checkpoint keeps
    its working set; none checkpointed, every layer does."""
    kwargs = dict(params=count_parameters(QWEN_3B), zero_stage=2, dp=1, offload=True, tokens=131072, fused=True)
    layer_input = 131072 * QWEN_3B.hidden_size * 2
    layers = QWEN_3B.num_hidden_layers
    base = estimate_memory(QWEN_3B, **kwargs)
    assert base == estimate_memory(QWEN_3B, **kwargs, checkpoint_every=1, checkpoints_on_host=False)
    assert base.host_checkpoints == 0
    host = estimate_memory(QWEN_3B, **kwargs, checkpoints_on_host=True)
    assert base.activations - host.activations == (layers - HOST_CHECKPOINTS_ON_GPU) * layer_input
    assert host.host_checkpoints == layers * layer_input
    working = 131072 * (8 * QWEN_3B.hidden_size + 3 * QWEN_3B.intermediate_size) * 2  # ACT_FUSED
    third = estimate_memory(QWEN_3B, **kwargs, checkpoint_every=3)
    assert third.activations - base.activations == (layers - layers // 3) * (working - layer_input)
    third_host = estimate_memory(QWEN_3B, **kwargs, checkpoint_every=3, checkpoints_on_host=True)
    assert third_host.host_checkpoints == layers // 3 * layer_input
    none = estimate_memory(QWEN_3B, **kwargs, checkpoint_every=None)
    assert none.activations - base.activations == layers * (working - layer_input) and none.host_checkpoints == 0


def test_auto_decides_the_tile_and_the_kept_attention_from_the_estimate():
    """``"auto"``: untiled where the step fits so, else the largest tile that fits; the attention kept where the
    step still fits with it, each decision a banner line."""
    from ds_mtraining.memory import decide_auto

    def decide(levers: dict, tokens: int, device: int, *, fused: bool = True, kept_layers: int = 35):
        estimate = partial(estimate_memory, QWEN_3B, params=count_parameters(QWEN_3B), zero_stage=2, dp=1,
                           tokens=tokens, fused=fused)  # fmt: skip
        return decide_auto(estimate, LEVERS | levers, Machine(device, RAM, 1), kept_layers=kept_layers)

    auto = {"mlp_tile": "auto", "kept_attention_layers": "auto"}
    # zero2_offload at 128K on the H200: 40 GiB untiled, and room for the 35 layers' 17.8 GiB (measured 17.2).
    levers, notes = decide(auto, 131072, H200)
    assert levers["mlp_tile"] is None and levers["kept_attention_layers"] == 35
    assert notes == ["memory    tiled_mlp auto: untiled, estimated peak 39 GiB of the 119 GiB a step may fill",
                     "memory    keep_attention auto: kept in 35 sparse layers (+17.8 GiB, estimated peak 57 GiB)"]
    # Unfused at 512K: 164 GiB untiled, 123 in tiles of 65536; tiles of 32768 fit (119 GiB measured, it ran), and the
    # kept attention then does not.
    levers, notes = decide(auto, 524288, H200, fused=False)
    assert levers == LEVERS | {"mlp_tile": 32768, "kept_attention_layers": 0}, levers
    assert notes[0] == ("memory    tiled_mlp auto: tiles of 32768 tokens (untiled the estimated peak is 164 GiB, over "
                        "the 119 GiB a step may fill)")  # fmt: skip
    assert notes[1] == ("memory    keep_attention auto: not kept: it needs 71.1 GiB more, estimated peak 190 GiB, over "
                        "the 119 GiB a step may fill")  # fmt: skip
    # Nothing fits: the smallest tile, for the check to refuse with what else would; the ring keeps nothing.
    levers, notes = decide(auto, 4 * 1048576, H100, kept_layers=0)
    assert levers["mlp_tile"] == 8192 and levers["kept_attention_layers"] == 0
    assert notes[1] == "memory    keep_attention auto: nothing to keep (the ring path and dense layers recompute)"
    # Settings written stay as written.
    assert decide({"mlp_tile": 4096, "kept_attention_layers": 0}, 131072, H200) == (
        LEVERS | {"mlp_tile": 4096, "kept_attention_layers": 0}, [])


def test_auto_is_a_value_of_the_config_that_only_the_job_decides():
    from ds_mtraining.integration.tiled_mlp import enable_tiled_mlp

    config = MTrainingConfig.from_deepspeed_config({"mtraining": {"tiled_mlp": {"tokens_per_tile": "auto"}}})
    assert config.tiled_mlp.tokens_per_tile == "auto"
    with pytest.raises(ConfigError, match=r"tiled_mlp\.tokens_per_tile"):
        MTrainingConfig.from_deepspeed_config({"mtraining": {"tiled_mlp": {"tokens_per_tile": "big"}}})
    with pytest.raises(ValueError, match=r"whole number of tokens >= 1; got 'auto' \(the training job decides"):
        enable_tiled_mlp(torch.nn.Module(), "auto")


def test_step_estimate_prices_the_config_as_decided_and_refuses_auto():
    """What benchmarks print beside a measured peak: the estimate of the levers as the config sets them."""
    from ds_mtraining.memory import step_estimate
    from ds_mtraining.parallel.mesh import MeshShape

    shape = MeshShape.build(world=1, ulysses=1, ring=1, q_heads=16, kv_heads=2)
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
              "activation_checkpointing": {"cpu_checkpointing": True}}  # fmt: skip
    mtraining = MTrainingConfig.model_validate({"activation_checkpointing": {"keep_attention": True},
                                                "tiled_mlp": {"tokens_per_tile": 32768}})  # fmt: skip
    got = step_estimate(config, mtraining, QWEN_3B, shape, tokens=2**19, fused=True)
    sparse = sum(mtraining.sparse_attention.for_layer(i).pattern != "dense" for i in range(QWEN_3B.num_hidden_layers))
    expected = estimate_memory(QWEN_3B, params=count_parameters(QWEN_3B), zero_stage=2, dp=1, offload=True,
                               tokens=2**19, fused=True, checkpoints_on_host=True, mlp_tile=32768,
                               kept_attention_layers=sparse, pinned_offload=False)  # DeepSpeed's default pin_memory
    assert got == expected and sparse > 0
    with pytest.raises(ValueError, match="decided"):
        step_estimate(config, MTrainingConfig(), QWEN_3B, shape, tokens=2**19, fused=True)  # keep_attention "auto"
