"""The "mtraining" section of DeepSpeed configs: defaults, shipped files, error messages, per-layer merge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ds_mtraining.config import (
    ESTIMATOR_CONFIGS,
    BaselineEstimator,
    ConfigError,
    DataConfig,
    FusedKernelsConfig,
    LayerOverride,
    MTrainingConfig,
    ParallelConfig,
    SparseAttentionConfig,
    SpreadEstimator,
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
    models = (MTrainingConfig, SparseAttentionConfig, LayerOverride, ParallelConfig, DataConfig, FusedKernelsConfig)
    for model in (*models, *ESTIMATOR_CONFIGS.values()):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_override_fields_mirror_sparse_attention() -> None:
    expected = set(SparseAttentionConfig.model_fields) - {"overrides", "block_size"} | {"layers"}
    assert set(LayerOverride.model_fields) == expected
    assert expected == {"layers", "pattern", "sink_tokens", "local_blocks", "estimator"}


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
            "sparse_attention": {"block_size": 128, "estimator": {"strategy": "spread", "max_columns": 2048}},
            "parallel": {"sequence_parallel_size": 8, "ulysses_degree": 2, "ring_degree": 4, "inner_ring_size": 2},
        }
    )
    assert config.sparse_attention.block_size == 128
    assert config.sparse_attention.estimator == SpreadEstimator(max_columns=2048)
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
                "allowed keys: activation_checkpointing, data, fused_kernels, parallel, sparse_attention, tiled_mlp",
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
                "allowed keys: estimator, layers, local_blocks, pattern, sink_tokens",
            ],
            id="unknown-key-override",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "oracle"}}},
            ["mtraining.sparse_attention.estimator: Input tag 'oracle'", "'baseline', 'spread'"],
            id="estimator-unknown",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": "spread"}},
            ['mtraining.sparse_attention: "estimator": "spread" is now an object naming its "strategy"'],
            id="estimator-a-name",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [1], "spread_rows": 32}]}},
            ["mtraining.sparse_attention.overrides.0", "spread_rows"],
            id="flat-key-in-override",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "rows": 0}}},
            ["mtraining.sparse_attention.estimator.rows = 0:", "greater than or equal to 1"],
            id="spread-rows-0",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "recall": 1.2}}},
            ["mtraining.sparse_attention.estimator.recall = 1.2:", "less than or equal to 1"],
            id="spread-recall-1.2",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "min_ratio": -1e-4}}},
            ["mtraining.sparse_attention.estimator.min_ratio = -0.0001:", "greater than or equal to 0"],
            id="spread-min-ratio-negative",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [3], "estimator": {"exclusion": -64}}]}},
            [
                (
                    "mtraining.sparse_attention: overrides[0] (layers [3]) merged with the base: "
                    "estimator.exclusion: Input should be greater than or equal to 0"
                )
            ],
            id="spread-exclusion-negative-override",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "tail_rows": -8}}},
            ["mtraining.sparse_attention.estimator.tail_rows = -8:", "greater than or equal to 0"],
            id="spread-tail-rows-negative",
        ),
        pytest.param(
            {"parallel": {"ring_columns": "sometimes"}},
            ["mtraining.parallel.ring_columns = 'sometimes':", "'per_step' or 'gathered'"],
            id="ring-columns-unknown",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [2], "estimator": {"tail_columns": 1.5}}]}},
            [
                (
                    "mtraining.sparse_attention: overrides[0] (layers [2]) merged with the base: "
                    "estimator.tail_columns: Input should be a valid integer"
                )
            ],
            id="spread-tail-columns-fraction-override",
        ),
        pytest.param(
            {"sparse_attention": {"block_size": 96}},
            ["mtraining.sparse_attention.block_size = 96: Input should be 64 or 128"],
            id="block-size-96",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "column_recall": 0}}},
            ["mtraining.sparse_attention.estimator.column_recall = 0:", "greater than 0"],
            id="column-recall-0",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "diagonal_recall": 1.5}}},
            ["mtraining.sparse_attention.estimator.diagonal_recall = 1.5:", "less than or equal to 1"],
            id="diagonal-recall-1.5",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "max_offsets": -1}}},
            ["mtraining.sparse_attention.estimator.max_offsets = -1:", "greater than or equal to 0"],
            id="negative-budget",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "max_diagonals": -1}}},
            ["mtraining.sparse_attention.estimator.max_diagonals = -1:", "greater than or equal to 0"],
            id="negative-budget-baseline",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "min_columns": 2000}}},
            [
                "mtraining.sparse_attention.estimator:",
                "min_columns=2000 > max_columns=1024",
                "raise max_columns or lower min_columns",
            ],
            id="min-columns-gt-max",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "min_diagonals": 10, "max_diagonals": 5}}},
            [
                "mtraining.sparse_attention.estimator:",
                "min_diagonals=10 > max_diagonals=5",
                "raise max_diagonals or lower min_diagonals",
            ],
            id="min-diagonals-gt-max",
        ),
        pytest.param(
            {
                "sparse_attention": {
                    "estimator": {"strategy": "baseline"},
                    "overrides": [{"layers": [3, 4], "estimator": {"min_columns": 2000}}],
                }
            },
            [
                "mtraining.sparse_attention: overrides[0] (layers [3, 4]) merged with the base: estimator:",
                "min_columns=2000 > max_columns=1024",
                "raise max_columns",
            ],
            id="override-min-gt-max",
        ),
        pytest.param(
            {
                "sparse_attention": {
                    "estimator": {"strategy": "baseline", "max_columns": 512},
                    "overrides": [
                        {"layers": [0], "pattern": "dense"},
                        {"layers": [2], "estimator": {"min_columns": 1000}},
                    ],
                }
            },
            [
                "mtraining.sparse_attention: overrides[1] (layers [2]) merged with the base: estimator:",
                "min_columns=1000 > max_columns=512",
                "raise max_columns or lower min_columns",
            ],
            id="override-min-gt-base-max",
        ),
        pytest.param(
            {
                "sparse_attention": {
                    "overrides": [{"layers": [3, 4], "estimator": {"strategy": "baseline", "min_columns": 2000}}]
                }
            },
            [
                "mtraining.sparse_attention: overrides[0] (layers [3, 4]) merged with the base: estimator:",
                "min_columns=2000 > max_columns=1024",
            ],
            id="override-other-strategy-min-gt-max",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [3], "estimator": {"min_columns": 8}}]}},
            [
                (
                    "mtraining.sparse_attention: overrides[0] (layers [3]) merged with the base: "
                    "estimator.min_columns: Extra inputs are not permitted"
                )
            ],
            id="override-key-of-another-strategy",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "min_columns": 8}}},
            [
                "mtraining.sparse_attention.estimator.min_columns: unknown key",
                (
                    "allowed keys: exclusion, max_columns, max_offsets, min_ratio, recall, rows, strategy, tail_columns, "
                    "tail_rows"
                ),
            ],
            id="estimator-unknown-key",
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
            {"sparse_attention": {"estimator": {"strategy": "baseline", "last_q": "64"}}},
            ["mtraining.sparse_attention.estimator.last_q = '64': Input should be a valid integer"],
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


FLAT_KEYS = {
    "last_q": "baseline.last_q",
    "vertical_recall": "baseline.column_recall",
    "slash_recall": "baseline.diagonal_recall",
    "vertical_min": "baseline.min_columns",
    "slash_min": "baseline.min_diagonals",
    "vertical_max": "spread.max_columns or baseline.max_columns",
    "slash_max": "spread.max_offsets or baseline.max_diagonals",
    "spread_rows": "spread.rows",
    "spread_recall": "spread.recall",
    "spread_min_ratio": "spread.min_ratio",
    "spread_exclusion": "spread.exclusion",
    "spread_tail_rows": "spread.tail_rows",
    "spread_tail_columns": "spread.tail_columns",
}
"""The first releases' flat keys and where each went."""


@pytest.mark.parametrize("key", list(FLAT_KEYS))
def test_flat_key_names_its_new_place(key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_section({"sparse_attention": {key: 1}})
    message = str(info.value)
    assert f'mtraining.sparse_attention: "{key}" is now estimator {FLAT_KEYS[key]}' in message, message
    assert '(e.g. "estimator": {"strategy": "spread", "recall": 0.98, "max_columns": 1024})' in message, message


def test_flat_keys_are_listed_together() -> None:
    with pytest.raises(ConfigError) as info:
        load_section({"sparse_attention": {"estimator": "spread", "spread_rows": 32, "vertical_max": 512}})
    assert (
        'mtraining.sparse_attention: "spread_rows" is now estimator spread.rows; "vertical_max" is now estimator '
        'spread.max_columns or baseline.max_columns; "estimator": "spread" is now an object naming its "strategy" (e.g.'
    ) in str(info.value)


@pytest.mark.parametrize(
    "section",
    [
        pytest.param({"sparse_attention": {"estimator": {"recall": 0.9}}}, id="base"),
        pytest.param({"sparse_attention": {"estimator": {}}}, id="empty"),
    ],
)
def test_estimator_without_strategy_names_the_strategies(section: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        load_section(section)
    assert (
        'mtraining.sparse_attention: estimator needs its "strategy": one of baseline, spread, e.g. "estimator": '
        '{"strategy": "spread", "recall": 0.98}'
    ) in str(info.value)


def test_every_error_is_listed() -> None:
    with pytest.raises(ConfigError) as info:
        load_section(
            {
                "sparse_attention": {"block_size": 96, "estimator": {"strategy": "baseline", "last_q": 0}},
                "parallel": {"ring_degree": 0},
            }
        )
    message = str(info.value)
    for key in ("sparse_attention.block_size", "sparse_attention.estimator.last_q", "parallel.ring_degree"):
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
        estimator=BaselineEstimator(max_columns=512),
        overrides=(
            LayerOverride(layers=(0,), pattern="dense"),
            LayerOverride(layers=(2, 5), estimator={"column_recall": 0.99, "max_columns": 2048}),
        ),
    )
    layer0 = sparse.for_layer(0)
    assert layer0.pattern == "dense"
    assert layer0.estimator.max_columns == 512  # inherited
    assert layer0.overrides == ()

    layer5 = sparse.for_layer(5)
    assert layer5.pattern == "vertical_slash"  # inherited
    assert isinstance(layer5.estimator, BaselineEstimator)
    assert (layer5.estimator.column_recall, layer5.estimator.max_columns) == (0.99, 2048)
    assert layer5.estimator.diagonal_recall == sparse.estimator.diagonal_recall
    assert layer5.estimator == sparse.estimator.model_copy(update={"column_recall": 0.99, "max_columns": 2048})

    assert sparse.for_layer(1) == sparse.model_copy(update={"overrides": ()})


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"recall": 0.99, "max_columns": 2048}, id="strategy-omitted"),
        pytest.param({"strategy": "spread", "recall": 0.99, "max_columns": 2048}, id="same-strategy-named"),
    ],
)
def test_override_merges_a_partial_estimator_into_the_base(change: dict[str, Any]) -> None:
    """Keys of the base's strategy change only those keys; the base's other estimator settings stay."""
    base = SpreadEstimator(rows=32, recall=0.9, max_columns=512, exclusion=64)
    sparse = load_section(
        {"sparse_attention": {"estimator": base.model_dump(), "overrides": [{"layers": [2], "estimator": change}]}}
    ).sparse_attention
    assert sparse.for_layer(2).estimator == SpreadEstimator(rows=32, recall=0.99, max_columns=2048, exclusion=64)
    assert sparse.for_layer(1).estimator == base
    python = SparseAttentionConfig(estimator=base, overrides=[LayerOverride(layers=(2,), estimator=change)])
    assert python == sparse


def test_override_of_another_strategy_replaces_the_estimator() -> None:
    """Another ``"strategy"`` replaces the base's estimator: that strategy's defaults for the keys left out."""
    sparse = SparseAttentionConfig(
        estimator=SpreadEstimator(rows=32, max_columns=512),
        overrides=[
            {"layers": [1], "estimator": {"strategy": "baseline", "last_q": 8}},
            {"layers": [3], "estimator": {"strategy": "baseline"}},
        ],
    )
    assert sparse.for_layer(1).estimator == BaselineEstimator(last_q=8)  # max_columns 1024, not the base's 512
    assert sparse.for_layer(3).estimator == BaselineEstimator()
    assert sparse.for_layer(2).estimator == SpreadEstimator(rows=32, max_columns=512)
    back = SparseAttentionConfig(
        estimator=BaselineEstimator(last_q=8, max_columns=4),
        overrides=[{"layers": [0], "estimator": {"strategy": "spread"}}],
    )
    assert back.for_layer(0).estimator == SpreadEstimator()


def test_override_estimator_in_python() -> None:
    override = LayerOverride(layers=(2,), estimator={"max_columns": 2048})
    assert override.estimator == {"max_columns": 2048} and override.pattern is None
    sparse = SparseAttentionConfig(overrides=(override,))
    assert sparse.for_layer(2).estimator == SpreadEstimator(max_columns=2048)
    assert sparse.for_layer(2).sink_tokens == sparse.sink_tokens


def test_for_layer_validates_the_merge() -> None:
    """The merged settings are validated: a merge that breaks a rule is refused when the config is built, naming the
    override."""
    with pytest.raises(ValidationError) as info:
        SparseAttentionConfig(
            estimator=BaselineEstimator(max_columns=512),
            overrides=[LayerOverride(layers=(4, 5), estimator={"min_columns": 1000})],
        )
    assert (
        "overrides[0] (layers [4, 5]) merged with the base: estimator: min_columns=1000 > max_columns=512; "
        "raise max_columns or lower min_columns"
    ) in str(info.value)


@pytest.mark.parametrize(
    "sparse, expected",
    [
        pytest.param(
            SparseAttentionConfig(
                block_size=128,
                sink_tokens=8,
                local_blocks=2,
                estimator=SpreadEstimator(
                    rows=64, recall=0.9, max_columns=512, max_offsets=256, min_ratio=2e-4, exclusion=128,
                    tail_rows=16, tail_columns=32,
                ),
            ),
            "vertical_slash bs=128 sinks=8 local_blocks=2 estimator=spread rows=64 recall=0.9 columns<=512 "
            "offsets<=256 min_ratio=0.0002 exclusion=128 tail_rows=16 tail_columns<=32",
            id="spread",
        ),
        pytest.param(
            SparseAttentionConfig(
                estimator=BaselineEstimator(
                    last_q=32, column_recall=0.8, diagonal_recall=0.7, min_columns=4, max_columns=256,
                    min_diagonals=2, max_diagonals=128,
                )
            ),
            "vertical_slash bs=64 sinks=4 local_blocks=1 estimator=baseline last_q=32 recall columns=0.8 "
            "diagonals=0.7 columns [4, 256] diagonals [2, 128]",
            id="baseline",
        ),
        pytest.param(SparseAttentionConfig(pattern="dense"), "dense causal attention", id="dense"),
        pytest.param(
            SparseAttentionConfig(overrides=[{"layers": [0], "pattern": "dense"}]).for_layer(0),
            "dense causal attention",
            id="dense-override",
        ),
    ],
)  # fmt: skip
def test_describe(sparse: SparseAttentionConfig, expected: str) -> None:
    assert sparse.describe() == expected


def test_describe_of_each_strategy_defaults() -> None:
    assert SparseAttentionConfig().describe() == (
        "vertical_slash bs=64 sinks=4 local_blocks=1 estimator=spread rows=128 recall=0.98 columns<=4096 "
        "offsets<=1024 min_ratio=0.0 exclusion=256 tail_rows=32 tail_columns<=64"
    )
    assert BaselineEstimator().describe() == (
        "estimator=baseline last_q=64 recall columns=0.9 diagonals=0.9 columns [0, 1024] diagonals [0, 1024]"
    )


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
        pytest.param(SpreadEstimator(), "recall", 0.5, id="spread"),
        pytest.param(BaselineEstimator(), "last_q", 8, id="baseline"),
        pytest.param(SparseAttentionConfig(), "estimator", BaselineEstimator(), id="estimator"),
    ],
)
def test_models_are_frozen(model: Any, field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match="frozen"):
        setattr(model, field, value)


@pytest.mark.parametrize(
    "section, expected",
    [
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "max_columns": 10**30}}},
            ["mtraining.sparse_attention.estimator.max_columns = ", "at most 1048576 tokens", "2**20"],
            id="max_columns",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "max_columns": 10**30}}},
            ["mtraining.sparse_attention.estimator.max_columns = ", "at most 1048576 tokens", "2**20"],
            id="max_columns-baseline",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "baseline", "max_diagonals": 2**20 + 1}}},
            ["mtraining.sparse_attention.estimator.max_diagonals = 1048577", "at most 1048576 tokens"],
            id="max_diagonals-baseline",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "rows": 2**20 + 1}}},
            ["mtraining.sparse_attention.estimator.rows = 1048577", "at most 1048576"],
            id="rows",
        ),
        pytest.param(
            {"sparse_attention": {"local_blocks": 2**14 + 1}},
            ["mtraining.sparse_attention.local_blocks = 16385", "at most 16384 blocks"],
            id="local_blocks",
        ),
        pytest.param(
            {"sparse_attention": {"estimator": {"strategy": "spread", "min_ratio": 2.0}}},
            ["mtraining.sparse_attention.estimator.min_ratio = 2.0", "less than or equal to 1"],
            id="min_ratio",
        ),
        pytest.param(
            {"sparse_attention": {"overrides": [{"layers": [1], "estimator": {"max_columns": 10**30}}]}},
            [
                (
                    "mtraining.sparse_attention: overrides[0] (layers [1]) merged with the base: "
                    "estimator.max_columns: at most 1048576"
                )
            ],
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
    config = SparseAttentionConfig(
        local_blocks=2**14, estimator=SpreadEstimator(max_columns=2**20, max_offsets=2**20, min_ratio=1.0)
    )
    assert config.estimator.max_columns == 2**20
    baseline = BaselineEstimator(min_columns=2**20, max_columns=2**20, min_diagonals=2**20, max_diagonals=2**20)
    assert baseline.max_diagonals == 2**20


def test_overrides_must_name_layers_the_model_has() -> None:
    config = SparseAttentionConfig(
        overrides=[
            {"layers": [0], "pattern": "dense"},
            {"layers": [3, 4, 7], "estimator": {"strategy": "baseline", "last_q": 8}},
        ]
    )
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


def test_old_estimator_string_is_refused_with_the_object_form() -> None:
    for section in ({"estimator": "baseline"}, {"overrides": [{"layers": [1], "estimator": "baseline"}]}):
        with pytest.raises(ConfigError) as info:
            load_section({"sparse_attention": section})
        assert '"estimator": "baseline" is now an object naming its "strategy" (e.g. "estimator": {"strategy": ' in str(
            info.value
        ), info.value


def test_flat_key_in_an_override_names_its_new_place() -> None:
    with pytest.raises(ConfigError) as info:
        load_section({"sparse_attention": {"overrides": [{"layers": [1], "spread_rows": 32}]}})
    assert 'mtraining.sparse_attention.overrides.0: "spread_rows" is now estimator spread.rows' in str(info.value)


def test_null_in_an_override_inherits() -> None:
    sparse = SparseAttentionConfig(
        sink_tokens=8, overrides=[{"layers": [1], "pattern": None, "sink_tokens": None, "estimator": None}]
    )
    assert sparse.for_layer(1) == sparse.for_layer(0)
    assert sparse.for_layer(1).sink_tokens == 8


@pytest.mark.parametrize("name", ["zero2_offload.json", "zero2.json"])
def test_shipped_settings_are_the_sparse_configs_section(name: str) -> None:
    """What an evaluation without a config uses (``SparseAttentionConfig.shipped``) is what the sparse training
    configs set: the same model is evaluated as it was trained (layer 0 dense)."""
    path = DS_CONFIGS[0].parent / name
    assert MTrainingConfig.from_deepspeed_config(path).sparse_attention == SparseAttentionConfig.shipped()
    assert SparseAttentionConfig.shipped().for_layer(0).pattern == "dense"
    assert SparseAttentionConfig.shipped().for_layer(1) == SparseAttentionConfig()
