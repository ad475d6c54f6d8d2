"""The "mtraining" section of DeepSpeed configs: defaults, shipped files, error messages, per-layer merge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ds_mtraining.config import (
    ConfigError,
    LayerOverride,
    MTrainingConfig,
    ParallelConfig,
    SparseAttentionConfig,
)

DS_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json"))


def load_section(section: dict[str, Any]) -> MTrainingConfig:
    return MTrainingConfig.from_deepspeed_config({"train_micro_batch_size_per_gpu": 1, "mtraining": section})


def test_defaults_are_valid() -> None:
    config = MTrainingConfig()
    assert config.sparse_attention.pattern == "vertical_slash"
    assert config.sparse_attention.block_size == 64
    assert config.parallel.layout == "striped"
    assert config.effective_stripe_size == 64
    assert load_section({}) == config


def test_every_field_is_documented() -> None:
    for model in (MTrainingConfig, SparseAttentionConfig, LayerOverride, ParallelConfig):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_override_fields_mirror_sparse_attention() -> None:
    expected = set(SparseAttentionConfig.model_fields) - {"overrides", "block_size"} | {"layers"}
    assert set(LayerOverride.model_fields) == expected


def test_ds_configs_exist() -> None:
    assert {p.name for p in DS_CONFIGS} >= {"zero2_offload.json", "zero2.json", "dense_baseline.json"}


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in DS_CONFIGS])
def test_ds_config_loads(path: Path) -> None:
    config = MTrainingConfig.from_deepspeed_config(path)
    assert config.sparse_attention.for_layer(0).pattern == "dense"
    assert MTrainingConfig.from_deepspeed_config(str(path)) == config


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in DS_CONFIGS])
def test_ds_config_accepted_by_deepspeed(path: Path) -> None:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    parsed = ds_config.DeepSpeedConfig(str(path))
    assert parsed.zero_optimization_stage == 2
    assert parsed.train_batch_size == 1


def test_dense_baseline_differs_only_in_pattern() -> None:
    directory = DS_CONFIGS[0].parent
    sparse = json.loads((directory / "zero2_offload.json").read_text())
    dense = json.loads((directory / "dense_baseline.json").read_text())
    assert sparse["mtraining"]["sparse_attention"].pop("pattern") == "vertical_slash"
    assert dense["mtraining"]["sparse_attention"].pop("pattern") == "dense"
    assert sparse == dense


def test_dict_input() -> None:
    config = load_section(
        {
            "sparse_attention": {"block_size": 128, "vertical_max": 2048},
            "parallel": {"sequence_parallel_size": 8, "ulysses_degree": 2, "ring_degree": 4, "inner_ring_size": 2},
        }
    )
    assert config.sparse_attention.block_size == 128
    assert config.sparse_attention.vertical_max == 2048
    assert config.parallel.ring_degree == 4
    assert config.effective_stripe_size == 128


def test_stripe_size_multiple_of_block_size() -> None:
    config = load_section({"parallel": {"stripe_size": 256}})
    assert config.effective_stripe_size == 256


@pytest.mark.parametrize(
    "section, expected",
    [
        pytest.param(
            {"sparse_attentoin": {}},
            [
                "mtraining.sparse_attentoin: unknown key",
                "allowed keys: activation_checkpointing, parallel, sparse_attention, tiled_mlp",
            ],
            id="unknown-key-top",
        ),
        pytest.param(
            {"sparse_attention": {"vertical_recal": 0.95}},
            ["mtraining.sparse_attention.vertical_recal: unknown key", "allowed keys: block_size, estimator,"],
            id="unknown-key-nested",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [0], "block_size": 128}]}},
            [
                "mtraining.sparse_attention.overrides.0.block_size: unknown key",
                "allowed keys: estimator, last_q, layers",
            ],
            id="unknown-key-override",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": "oracle"}},
            ["mtraining.sparse_attention.estimator = 'oracle':", "'baseline' or 'spread'"],
            id="estimator-unknown",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": "spread", "spread_rows": 0}},
            ["mtraining.sparse_attention.spread_rows = 0:", "greater than or equal to 1"],
            id="spread-rows-0",
        ),
        pytest.param(
            {"sparse_attention": {"spread_recall": 1.2}},
            ["mtraining.sparse_attention.spread_recall = 1.2:", "less than or equal to 1"],
            id="spread-recall-1.2",
        ),
        pytest.param(
            {"sparse_attention": {"spread_min_ratio": -1e-4}},
            ["mtraining.sparse_attention.spread_min_ratio = -0.0001:", "greater than or equal to 0"],
            id="spread-min-ratio-negative",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [3], "spread_exclusion": -64}]}},
            ["mtraining.sparse_attention.overrides.0.spread_exclusion = -64:", "greater than or equal to 0"],
            id="spread-exclusion-negative-override",
        ),
        pytest.param(
            {"sparse_attention": {"spread_tail_rows": -8}},
            ["mtraining.sparse_attention.spread_tail_rows = -8:", "greater than or equal to 0"],
            id="spread-tail-rows-negative",
        ),
        pytest.param(
            {"parallel": {"ring_columns": "sometimes"}},
            ["mtraining.parallel.ring_columns = 'sometimes':", "'per_step' or 'gathered'"],
            id="ring-columns-unknown",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [2], "spread_tail_columns": 1.5}]}},
            ["mtraining.sparse_attention.overrides.0.spread_tail_columns = 1.5:", "integer"],
            id="spread-tail-columns-fraction-override",
        ),
        pytest.param(
            {"sparse_attention": {"block_size": 96}},
            ["mtraining.sparse_attention.block_size = 96: Input should be 64 or 128"],
            id="block-size-96",
        ),
        pytest.param(
            {"sparse_attention": {"vertical_recall": 0}},
            ["mtraining.sparse_attention.vertical_recall = 0:", "greater than 0"],
            id="recall-0",
        ),
        pytest.param(
            {"sparse_attention": {"slash_recall": 1.5}},
            ["mtraining.sparse_attention.slash_recall = 1.5:", "less than or equal to 1"],
            id="recall-1.5",
        ),
        pytest.param(
            {"sparse_attention": {"slash_max": -1}},
            ["mtraining.sparse_attention.slash_max = -1:", "greater than or equal to 0"],
            id="negative-budget",
        ),
        pytest.param(
            {"sparse_attention": {"vertical_min": 2000}},
            [
                "mtraining.sparse_attention:",
                "vertical_min=2000 > vertical_max=1024",
                "raise vertical_max or lower vertical_min",
            ],
            id="vertical-min-gt-max",
        ),
        pytest.param(
            {"sparse_attention": {"slash_min": 10, "slash_max": 5}},
            ["mtraining.sparse_attention:", "slash_min=10 > slash_max=5", "raise slash_max or lower slash_min"],
            id="slash-min-gt-max",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [3, 4], "vertical_min": 2000}]}},
            ["overrides[0] (layers [3, 4])", "vertical_min=2000 > vertical_max=1024", "raise vertical_max"],
            id="override-min-gt-max",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [0, 1], "pattern": "dense"}, {"layers": [1]}]}},
            ["layer 1 is listed in overrides[0] and overrides[1]", "one override only"],
            id="duplicate-layer-across-overrides",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [2, 2]}]}},
            ["mtraining.sparse_attention.overrides.0.layers = [2, 2]:", "layers [2] listed more than once"],
            id="duplicate-layer-in-override",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": []}]}},
            ["mtraining.sparse_attention.overrides.0.layers = []:", "at least 1 item"],
            id="empty-layers",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [-1]}]}},
            ["mtraining.sparse_attention.overrides.0.layers.0 = -1:", "greater than or equal to 0"],
            id="negative-layer",
        ),
        pytest.param(
            {"parallel": {"sequence_parallel_size": 8, "ulysses_degree": 2, "ring_degree": 2}},
            ["mtraining.parallel:", "ulysses_degree=2 * ring_degree=2 = 4 != sequence_parallel_size=8", "product"],
            id="ulysses-times-ring",
        ),
        pytest.param(
            {"parallel": {"sequence_parallel_size": 4, "ring_degree": 4, "inner_ring_size": 3}},
            ["mtraining.parallel:", "inner_ring_size=3 does not divide ring_degree=4", "[1, 2, 4]"],
            id="inner-ring-not-divisor",
        ),
        pytest.param(
            {"parallel": {"stripe_size": 96}},
            ["parallel.stripe_size=96 is not a multiple of sparse_attention.block_size=64", "multiple of 64"],
            id="stripe-not-multiple",
        ),
        pytest.param(
            {"sparse_attention": {"last_q": "64"}},
            ["mtraining.sparse_attention.last_q = '64': Input should be a valid integer"],
            id="string-for-int",
        ),
        pytest.param(
            {"parallel": {"layout": "diagonal"}},
            ["mtraining.parallel.layout = 'diagonal':", "'contiguous', 'zigzag' or 'striped'"],
            id="unknown-layout",
        ),
        pytest.param(
            {"parallel": 4},
            ["mtraining.parallel = 4:", "valid dictionary"],
            id="subsection-not-object",
        ),
    ],
)
def test_bad_section(section: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_section(section)
    message = str(info.value)
    assert "<dict>" in message
    for part in expected:
        assert part in message


def test_every_error_is_listed() -> None:
    with pytest.raises(ConfigError) as info:
        load_section({"sparse_attention": {"block_size": 96, "last_q": 0}, "parallel": {"ring_degree": 0}})
    message = str(info.value)
    for key in ("sparse_attention.block_size", "sparse_attention.last_q", "parallel.ring_degree"):
        assert f"mtraining.{key} = " in message


def test_missing_section(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    with pytest.raises(ConfigError, match=r'has no "mtraining" section') as info:
        MTrainingConfig.from_deepspeed_config(path)
    assert str(path) in str(info.value)
    assert '"sparse_attention": {' in str(info.value)


@pytest.mark.parametrize(
    "section", [pytest.param([], id="list"), pytest.param(None, id="null"), pytest.param("x", id="string")]
)
def test_section_not_an_object(section: Any) -> None:
    with pytest.raises(ConfigError, match='"mtraining" must be an object'):
        MTrainingConfig.from_deepspeed_config({"mtraining": section})


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "mtraining": {,}\n}\n')
    with pytest.raises(ConfigError, match="invalid JSON") as info:
        MTrainingConfig.from_deepspeed_config(path)
    assert f"{path}:2:17:" in str(info.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"mtraining": {"sparse_attention": {"block_size": 96}}}))
    with pytest.raises(ConfigError, match="block_size = 96") as info:
        MTrainingConfig.from_deepspeed_config(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(FileNotFoundError, match="absent.json"):
        MTrainingConfig.from_deepspeed_config(path)


def test_for_layer_merges_override() -> None:
    sparse = SparseAttentionConfig(
        vertical_max=512,
        overrides=(
            LayerOverride(layers=(0,), pattern="dense"),
            LayerOverride(layers=(2, 5), vertical_recall=0.99, vertical_max=2048),
        ),
    )
    layer0 = sparse.for_layer(0)
    assert layer0.pattern == "dense"
    assert layer0.vertical_max == 512  # inherited
    assert layer0.overrides == ()

    layer5 = sparse.for_layer(5)
    assert layer5.pattern == "vertical_slash"  # inherited
    assert (layer5.vertical_recall, layer5.vertical_max) == (0.99, 2048)
    assert layer5.slash_recall == sparse.slash_recall

    assert sparse.for_layer(1) == sparse.model_copy(update={"overrides": ()})


def test_for_layer_rejects_negative_layer() -> None:
    with pytest.raises(ValueError, match="layer must be >= 0, got -1"):
        SparseAttentionConfig().for_layer(-1)


@pytest.mark.parametrize(
    "model, field, value",
    [
        pytest.param(MTrainingConfig(), "parallel", ParallelConfig(), id="mtraining"),
        pytest.param(SparseAttentionConfig(), "block_size", 128, id="sparse_attention"),
        pytest.param(ParallelConfig(), "layout", "zigzag", id="parallel"),
        pytest.param(LayerOverride(layers=(0,)), "pattern", "dense", id="override"),
    ],
)
def test_models_are_frozen(model: Any, field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match="frozen"):
        setattr(model, field, value)


@pytest.mark.parametrize(
    "section, expected",
    [
        pytest.param(
            {"sparse_attention": {"vertical_max": 10**30}},
            ["mtraining.sparse_attention.vertical_max = ", "at most 1048576 tokens", "2**20"],
            id="vertical_max",
        ),
        pytest.param(
            {"sparse_attention": {"spread_rows": 2**20 + 1}},
            ["mtraining.sparse_attention.spread_rows = 1048577", "at most 1048576"],
            id="spread_rows",
        ),
        pytest.param(
            {"sparse_attention": {"local_blocks": 2**14 + 1}},
            ["mtraining.sparse_attention.local_blocks = 16385", "at most 16384 blocks"],
            id="local_blocks",
        ),
        pytest.param(
            {"sparse_attention": {"spread_min_ratio": 2.0}},
            ["mtraining.sparse_attention.spread_min_ratio = 2.0", "less than or equal to 1"],
            id="min_ratio",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [1], "vertical_max": 10**30}]}},
            ["mtraining.sparse_attention.overrides.0.vertical_max = ", "at most 1048576"],
            id="override",
        ),
    ],
)
def test_budgets_have_upper_bounds(section: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_section(section)
    for part in expected:
        assert part in str(info.value), str(info.value)


def test_budget_bounds_are_inclusive() -> None:
    config = SparseAttentionConfig(vertical_max=2**20, slash_max=2**20, local_blocks=2**14, spread_min_ratio=1.0)
    assert config.vertical_max == 2**20


def test_overrides_must_name_layers_the_model_has() -> None:
    config = SparseAttentionConfig(overrides=[{"layers": [0], "pattern": "dense"}, {"layers": [3, 4, 7], "last_q": 8}])
    config.check_layers(8, "big")  # layers 0..7 all exist
    with pytest.raises(ConfigError) as info:
        config.check_layers(4, "tiny", "my.json")
    assert str(info.value) == (
        "my.json: mtraining.sparse_attention.overrides[1] names layers 4, 7, but tiny has 4 layers (0..3); "
        "list only layers the model has"
    )


def test_layer0_note() -> None:
    assert SparseAttentionConfig(overrides=[{"layers": [0], "pattern": "dense"}]).layer0_note() is None
    assert SparseAttentionConfig(pattern="dense").layer0_note() is None
    note = SparseAttentionConfig(overrides=[{"layers": [1], "pattern": "dense"}]).layer0_note()
    assert note.startswith("note: layer 0 attends sparsely") and '{"layers": [0], "pattern": "dense"}' in note
