"""Budgets that fit the hardware: which cap bound a layer's index (``LayerStats.capped_*``), and the recall warning.

Real estimates throughout: random q/k (diffuse attention, which no small budget covers) with small caps must show
the caps bound and warn once per layer naming them; a planted easy pattern with generous caps, or a recall lost to
``min_ratio`` rather than to a cap, must stay silent.
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import estimate_index
from ds_mtraining.integration.budget import (
    CAPS,
    RECALL_MARGIN,
    RecallWatch,
    capped_heads,
    layer_table,
    sparse_layers,
    sparse_mean,
)
from ds_mtraining.integration.model_loading import resolve_model
from ds_mtraining.integration.transformers import MTrainingAttention
from ds_mtraining.sparse import VerticalSlashIndex
from ds_mtraining.sparse.planted import plant_head

N = 1024
DENSE_0 = [{"layers": [0], "pattern": "dense"}]


def record_of(attention: MTrainingAttention) -> dict[str, list[float]]:
    """The per-layer values the training loop reduces (one rank: the mean over one rank is the value itself)."""
    layers = sorted(attention.stats)
    assert layers == list(range(len(layers)))
    return {key: [float(getattr(attention.stats[i], key)) for i in layers] for key in ("density", "recall", *CAPS)}


def random_qkv(seed: int, heads: int = 4, kv_heads: int = 2, dim: int = 64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N, heads, dim, generator=gen)
    k = torch.randn(1, N, kv_heads, dim, generator=gen)
    v = torch.randn(1, N, kv_heads, dim, generator=gen)
    return q, k, v


def planted_qk(columns: int, diagonals: int, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[1, N, heads, 128]`` (softmax scale 1) whose rows put equal shares on ``columns`` far columns,
    ``diagonals`` far diagonals and a two-token local band, 0.05 on the sink."""
    qs, ks = [], []
    for h in range(heads):
        gen = torch.Generator().manual_seed(h)
        cols = (torch.randperm(N - 300, generator=gen)[:columns] + 8).tolist()
        diags = (torch.randperm(N // 2, generator=gen)[:diagonals] + 100).tolist()
        share = 0.9 / (columns + diagonals + 2)
        q, k = plant_head(
            N,
            columns=dict.fromkeys(cols, share),
            diagonals={0: share, 1: share, **dict.fromkeys(diags, share)},
            sink=0.05,
            seed=h,
        )
        qs.append(q)
        ks.append(k)
    return torch.stack(qs, dim=1)[None].float(), torch.stack(ks, dim=1)[None].float()


# ---------------------------------------------------------------------------------------------------------
# Which cap bound: capped_heads on hand-built and estimated indices
# ---------------------------------------------------------------------------------------------------------


def test_capped_heads_counts_columns_beyond_sinks_and_offsets_beyond_the_forced_ones():
    config = SparseAttentionConfig(
        sink_tokens=4, local_blocks=2, estimator=SpreadEstimator(max_columns=3, max_offsets=2, tail_columns=2)
    )
    pad = -1
    sinks = [0, 1, 2, 3]
    vertical = torch.tensor(
        [
            [sinks + [100, 200, pad, pad, pad], [0, 1, 2, 3, 100, 200, 300, pad, pad]],
            [sinks + [100, 200, 300, 400, 500], [0, 1, 2, 3, pad, pad, pad, pad, pad]],
        ]
    )  # free columns per head: 2, 3, 5, 0 -> max_columns=3 reached by 2 of 4; 3 + 2 = 5 by 1 of 4
    slash = torch.tensor([[[0, 1, 5, 7], [0, 1, pad, pad]], [[0, 1, 4, pad], [0, 1, 2, 9]]])  # free: 2, 0, 1, 2
    index = VerticalSlashIndex.build(vertical, slash, 64)
    capped = capped_heads(index, config)
    assert set(capped) == set(CAPS)
    assert {key: float(value) for key, value in capped.items()} == {
        "capped_columns": 0.5,
        "capped_offsets": 0.5,
        "capped_tail": 0.25,
    }
    assert all(value.dtype == torch.float32 and value.dim() == 0 for value in capped.values())
    no_tail = capped_heads(
        index, config.model_copy(update={"estimator": config.estimator.model_copy(update={"tail_rows": 0})})
    )
    assert float(no_tail["capped_tail"]) == 0.0 and float(no_tail["capped_columns"]) == 0.5
    # The baseline's max_diagonals counts token diagonals, which the offsets do not reveal; its columns count alike.
    baseline = capped_heads(
        index, config.model_copy(update={"estimator": BaselineEstimator(max_columns=3, max_diagonals=2)})
    )
    assert float(baseline["capped_offsets"]) == 0.0 and float(baseline["capped_tail"]) == 0.0
    assert float(baseline["capped_columns"]) == 0.5


def test_estimate_on_random_qk_with_small_caps_reaches_every_cap():
    q, k, _ = random_qkv(0)
    config = SparseAttentionConfig(estimator=SpreadEstimator(max_columns=8, max_offsets=2))
    index, report = estimate_index(q, k, config, return_report=True)
    capped = {key: float(value) for key, value in capped_heads(index, config).items()}
    assert capped == {"capped_columns": 1.0, "capped_offsets": 1.0, "capped_tail": 1.0}
    assert float(report.recall.mean()) < config.estimator.recall - RECALL_MARGIN  # the caps did cost recall
    # The greedy's columns and the tail's are disjoint: the count is exactly both caps.
    assert (index.vertical >= config.sink_tokens).sum(-1).eq(8 + 64).all()


def test_planted_columns_beyond_the_cap_show_only_the_column_cap():
    """40 planted far columns and a cap of 4 (tail off): the greedy buys offsets instead, the recall target is
    still met (no warning), and only max_columns shows as reached."""
    q, k = planted_qk(columns=40, diagonals=0)
    config = SparseAttentionConfig(estimator=SpreadEstimator(max_columns=4, tail_rows=0))
    index, report = estimate_index(q, k, config, softmax_scale=1.0, return_report=True)
    capped = {key: float(value) for key, value in capped_heads(index, config).items()}
    assert capped == {"capped_columns": 1.0, "capped_offsets": 0.0, "capped_tail": 0.0}
    assert float(report.recall.min()) >= config.estimator.recall - RECALL_MARGIN


def test_generous_caps_on_an_easy_pattern_bind_nothing():
    q, k = planted_qk(columns=4, diagonals=2)
    config = SparseAttentionConfig()
    index, report = estimate_index(q, k, config, softmax_scale=1.0, return_report=True)
    assert all(float(value) == 0.0 for value in capped_heads(index, config).values())
    assert float(report.recall.min()) >= config.estimator.recall - RECALL_MARGIN


# ---------------------------------------------------------------------------------------------------------
# The watch over the attention's own statistics
# ---------------------------------------------------------------------------------------------------------


def attend_layers(sparse: SparseAttentionConfig, layers: int, inputs) -> MTrainingAttention:
    """``MTrainingAttention.attend`` for layers ``0 .. layers-1`` on ``inputs(layer) -> (q, k, v, scale)``."""
    attention = MTrainingAttention(sparse)
    for layer in range(layers):
        q, k, v, scale = inputs(layer)
        attention.attend(layer, q, k, v, scale)
    return attention


def test_watch_warns_once_per_layer_naming_the_caps():
    sparse = SparseAttentionConfig(estimator=SpreadEstimator(max_columns=8, max_offsets=2), overrides=DENSE_0)
    attention = attend_layers(sparse, 3, lambda layer: (*random_qkv(layer), 64**-0.5))
    record = record_of(attention)
    assert [record[key][0] for key in CAPS] == [0.0, 0.0, 0.0] and record["recall"][0] == 1.0  # dense layer 0
    for layer in (1, 2):
        assert [record[key][layer] for key in CAPS] == [1.0, 1.0, 1.0]
    watch = RecallWatch(sparse)
    lines = watch.check(record)
    assert [line.split(":")[0:2] for line in lines] == [["warning", " layer 1"], ["warning", " layer 2"]]
    for layer, line in zip((1, 2), lines, strict=True):
        assert line == (
            f"warning: layer {layer}: observed recall {record['recall'][layer]:.3f} < recall target 0.98 with "
            "max_columns=8 (100% of heads), max_offsets=2 (100% of heads), tail_columns=64 (100% of heads) "
            'reached; raise them in "mtraining.sparse_attention.estimator" of the DeepSpeed JSON, or for this layer '
            f'only: "overrides": [{{"layers": [{layer}], "estimator": {{"strategy": "spread", "max_columns": 16, '
            '"max_offsets": 4, "tail_columns": 128}}]'
        )
        # The suggested override is valid and raises exactly the caps named, the rest of the estimator unchanged.
        fix = json.loads(line.split('"overrides": ', 1)[1])
        fixed = SparseAttentionConfig(estimator=sparse.estimator, overrides=fix).for_layer(layer).estimator
        assert fixed == sparse.estimator.model_copy(update={"max_columns": 16, "max_offsets": 4, "tail_columns": 128})
    assert watch.check(record) == []  # once per layer and run


def test_watch_is_silent_when_nothing_binds():
    sparse = SparseAttentionConfig(overrides=DENSE_0)
    q, k = planted_qk(columns=4, diagonals=2)
    attention = attend_layers(sparse, 2, lambda layer: (q, k, k, 1.0))
    record = record_of(attention)
    assert record["recall"][1] >= 0.98 - RECALL_MARGIN and [record[key][1] for key in CAPS] == [0.0, 0.0, 0.0]
    assert RecallWatch(sparse).check(record) == []


def test_watch_is_silent_when_recall_is_lost_to_min_ratio_not_a_cap():
    """``min_ratio`` stops the greedy long before the target: a recall well below it, but no cap to raise."""
    sparse = SparseAttentionConfig(estimator=SpreadEstimator(min_ratio=0.5))
    q, k = planted_qk(columns=4, diagonals=2)
    attention = attend_layers(sparse, 1, lambda layer: (q, k, k, 1.0))
    record = record_of(attention)
    assert record["recall"][0] < 0.98 - RECALL_MARGIN and [record[key][0] for key in CAPS] == [0.0, 0.0, 0.0]
    assert RecallWatch(sparse).check(record) == []


def synthetic(recall: list[float], columns: list[float], offsets: list[float] | None = None) -> dict:
    zeros = [0.0] * len(recall)
    return {
        "density": [0.5] * len(recall),
        "recall": recall,
        "capped_columns": columns,
        "capped_offsets": offsets or zeros,
        "capped_tail": zeros,
    }


def test_watch_over_several_steps_warns_each_layer_once_and_skips_dense_and_baseline_layers():
    sparse = SparseAttentionConfig(
        estimator=SpreadEstimator(max_columns=64, max_offsets=8),
        overrides=[
            {"layers": [0], "pattern": "dense"},
            {"layers": [4], "estimator": {"strategy": "baseline", "max_columns": 64, "max_diagonals": 8}},
            {"layers": [5], "estimator": {"recall": 0.5}},
        ],
    )
    watch = RecallWatch(sparse)
    target = 0.98 - RECALL_MARGIN
    # layer 0 dense and layer 4 baseline: never judged, whatever the values say.
    step1 = synthetic([0.1, 0.5, 0.99, 0.5, 0.1, 0.46], [1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    assert [line.split(":")[1] for line in watch.check(step1)] == [" layer 1"]  # 3: no cap; 5: 0.46 > 0.5 - 0.05
    assert watch.check(step1) == []
    step2 = synthetic([0.1, 0.5, target - 1e-3, 0.5, 0.1, 0.44], [1.0, 1.0, 0.25, 0.0, 1.0, 0.0], [0, 0, 0, 0, 0, 1])
    assert [line.split(":")[1] for line in watch.check(step2)] == [" layer 2", " layer 5"]
    step3 = synthetic([0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [1.0] * 6)
    assert [line.split(":")[1] for line in watch.check(step3)] == [" layer 3"]
    assert watch.check(step3) == [] and watch.warned == {1, 2, 3, 5}
    # Just at the margin is not "well below"; a NaN recall is not judged.
    fresh = RecallWatch(sparse)
    assert fresh.check(synthetic([1.0, target, float("nan"), 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0, 0, 0])) == []


def test_message_text_for_one_cap_a_small_share_and_an_overridden_layer():
    sparse = SparseAttentionConfig(
        estimator=SpreadEstimator(max_columns=64, max_offsets=8),
        overrides=[{"layers": [0], "pattern": "dense"}, {"layers": [2, 3], "estimator": {"max_offsets": 4}}],
    )
    watch = RecallWatch(sparse)
    record = synthetic([1.0, 0.026, 0.5, 0.9], [0.0, 0.25, 0.0, 0.0], [0.0, 0.0, 0.001, 0.0])
    layer1 = (
        "warning: layer 1: observed recall 0.026 < recall target 0.98 with max_columns=64 (25% of heads) reached; "
        'raise it in "mtraining.sparse_attention.estimator" of the DeepSpeed JSON, or for this layer only: '
        '"overrides": [{"layers": [1], "estimator": {"strategy": "spread", "max_columns": 128}}]'
    )
    layer2 = (  # layer 2 has an override: a second one listing it would be refused, so the fix goes into it
        "warning: layer 2: observed recall 0.500 < recall target 0.98 with max_offsets=4 (<1% of heads) reached; "
        'raise it in "mtraining.sparse_attention.overrides[1]" (layers [2, 3]): '
        '"estimator": {"strategy": "spread", "max_offsets": 8}'
    )
    assert watch.check(record) == [layer1, layer2]  # layer 3: 0.9 is below 0.93, but no cap bound
    with pytest.raises(ValueError, match="margin"):
        RecallWatch(sparse, margin=-0.1)


# ---------------------------------------------------------------------------------------------------------
# Means and the summary's table
# ---------------------------------------------------------------------------------------------------------


def test_means_over_sparse_layers_only():
    sparse = SparseAttentionConfig(overrides=DENSE_0)
    assert sparse_layers(sparse, 4) == [1, 2, 3]
    assert sparse_mean([1.0, 0.2, 0.1, 0.3], sparse) == pytest.approx(0.2)  # not 0.4, the mean over all layers
    dense = SparseAttentionConfig(pattern="dense")
    assert sparse_layers(dense, 3) == [] and sparse_mean([1.0, 1.0, 1.0], dense) == 1.0
    with pytest.raises(ValueError, match="one value per layer"):
        sparse_mean([], sparse)


def test_layer_table_lists_each_layer():
    sparse = SparseAttentionConfig(estimator=SpreadEstimator(max_columns=64, max_offsets=8), overrides=DENSE_0)
    record = synthetic([1.0, 0.271, 0.95], [0.0, 1.0, 0.0], [0.0, 0.5, 0.0])
    record["density"] = [1.0, 0.153, 0.2]
    console = Console(file=io.StringIO(), width=160)
    console.print(layer_table(record, sparse))
    rows = [re.split("[│┃]", line) for line in console.file.getvalue().splitlines() if re.search("[│┃]", line)]
    cells = [[cell.strip() for cell in row[1:-1]] for row in rows]  # the header's rule is ┃, the rows' │
    assert cells[0] == ["layer", "attention", "density", "recall", "target", "caps reached (share of heads)"]
    assert cells[1:] == [
        ["0", "dense", "1.000", "1.000", "-", "-"],
        ["1", "spread", "0.153", "0.271", "0.98", "max_columns=64 100%, max_offsets=8 50%"],
        ["2", "spread", "0.200", "0.950", "0.98", "-"],
    ]
    del record["capped_tail"]  # records written before the caps were recorded still render
    console.print(layer_table(record, sparse))


# ---------------------------------------------------------------------------------------------------------
# A real forward through a tiny model
# ---------------------------------------------------------------------------------------------------------


def test_tiny_model_forward_records_the_caps_it_reached():
    model = resolve_model("tiny-qwen2", vocab_size=512, max_positions=N).build(seed=0)
    ids = torch.randint(0, 512, (1, N), generator=torch.Generator().manual_seed(0))
    sparse = SparseAttentionConfig(
        estimator=SpreadEstimator(max_columns=8, max_offsets=1, tail_columns=16), overrides=DENSE_0
    )
    attention = MTrainingAttention(sparse)
    with torch.no_grad():
        model(ids, mtraining=attention)
    stats = attention.stats
    assert sorted(stats) == [0, 1, 2, 3]
    for name in CAPS:
        assert all(getattr(s, name).dtype == torch.float32 and getattr(s, name).dim() == 0 for s in stats.values())
        assert float(getattr(stats[0], name)) == 0.0  # dense
    for layer in (1, 2, 3):  # a random-init model attends diffusely: 8 columns and 1 offset cover little
        assert [float(getattr(stats[layer], name)) for name in CAPS] == [1.0, 1.0, 1.0]
        assert float(stats[layer].recall) < 0.98 - RECALL_MARGIN
    record = record_of(attention)
    lines = RecallWatch(sparse).check(record)
    assert [line.split(":")[1] for line in lines] == [" layer 1", " layer 2", " layer 3"]
    assert all("max_columns=8 (100% of heads), max_offsets=1 (100% of heads), tail_columns=16" in x for x in lines)
    assert sparse_mean(record["density"], sparse) < sum(record["density"]) / 4  # the dense layer is left out
