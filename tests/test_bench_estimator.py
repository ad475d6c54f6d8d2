"""The estimator benchmarks and experiments on tiny CPU cases: each runs end to end and its tables have their rows
with finite numbers, so none can rot unnoticed. The SmolLM2-135M ones read the model from its wheel."""

from __future__ import annotations

import pytest
import torch
from bench_reports import assert_finite, assert_header, numbers, table

from benchmarks import ab_main, estimator_bench, greedy_schedule_fidelity, packed_estimate, validation_cost, weak_heads
from ds_mtraining.estimator.spread import greedy

TINY = ["--device", "cpu", "--rep-ms", "1"]


def test_estimator_bench(tmp_path):
    out = tmp_path / "estimators.md"
    args = [*TINY, "--seqlens", "256", "--strategies", "baseline", "spread", "--out", str(out)]
    assert estimator_bench.main(args) == 0
    text = out.read_text()
    assert_header(text, "estimator_bench")
    (row,) = table(text, "N")
    assert row[0] == "256" and len(row) == 6  # N, the attention, 2 strategies, spread with its report, planted heads
    assert_finite(row[1:])
    rows = table(text, "N | input")
    assert [row[1] for row in rows] == ["random", "planted", "95 %-sparse"]
    assert_finite([cell for row in rows for cell in row[2:]])
    assert all(0 < numbers(row[2])[0] <= 1 for row in rows)  # densities
    assert "Spread estimator at N=256, CPU ops" in text and "- total: " in text


def test_validation_cost(tmp_path):
    out = tmp_path / "validation.md"
    assert validation_cost.main([*TINY, "--seqlen", "256", "--repeats", "1", "--layers", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "validation_cost")
    rows = table(text, "case")
    assert [row[0] for row in rows] == [
        "kernel API fwd+bwd (no validation)", "autograd fwd+bwd", "1 layers estimate + attention fwd+bwd"
    ]  # fmt: skip
    assert_finite([rows[0][1], *rows[1][1:], *rows[2][1:]])
    assert_finite([text.split("validate alone: ")[1]])


def test_ab_main_records_and_compares(tmp_path):
    record = tmp_path / "side.pt"
    assert ab_main.main([*TINY, "--seqlens", "256", "--save", str(record)]) == 0
    out = tmp_path / "ab.md"
    assert ab_main.main(["--compare", str(record), str(record), "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "ab_main")
    times = table(text, "case")
    assert [row[0] for row in times] == [
        "spread estimator, 256 (ms)", "attention fwd, 256 / 95 % (ms)", "attention fwd+bwd, 256 / 95 % (ms)"
    ]  # fmt: skip
    assert all(row[3] == "1.000" for row in times)
    indices = table(text, "index")
    assert len(indices) == 6 and all(row[1:] == ["True", "True"] for row in indices)
    assert text.rstrip().endswith("PASS: every index equal bit for bit")
    # A side whose index differs fails the comparison.
    changed = torch.load(record)
    vertical, slash = changed["indices"]["spread planted 256"]
    changed["indices"]["spread planted 256"] = (vertical, slash.flip(-1))
    torch.save(changed, tmp_path / "other.pt")
    assert ab_main.main(["--compare", str(record), str(tmp_path / "other.pt"), "--out", str(out)]) == 1
    assert ["spread planted 256", "True", "False"] in table(out.read_text(), "index")


def test_greedy_schedule_fidelity(tmp_path):
    defaults = greedy.spread_select.__defaults__
    args = ["8,32", "fidelity", "--model", "smollm2-135m", "--length", "256", "--last-rows", "64", "--layers", "1",
            "--masked", "--estimators", "spread", "--device", "cpu", "--out", str(tmp_path)]  # fmt: skip
    assert greedy_schedule_fidelity.main(args) == 0
    assert greedy.spread_select.__defaults__ == defaults  # the schedule is the harness's only while it runs
    text = (tmp_path / "fidelity.md").read_text()
    assert "command: `python -m benchmarks.greedy_schedule_fidelity 8,32 fidelity --model smollm2-135m" in text
    (row, everything) = table(text, "layer")
    assert row[0] == "1" and everything[0] == "**all**"
    assert_finite(row[1:])


def test_greedy_schedule_fidelity_refuses_a_bad_schedule():
    with pytest.raises(SystemExit, match="comma-separated positive picks"):
        greedy_schedule_fidelity.main(["8,0", "fidelity"])


def test_packed_estimate(tmp_path):
    out = tmp_path / "packed.md"
    assert packed_estimate.main(["--length", "512", "--rows", "1", "--layers", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "packed_estimate")
    rows = table(text, "layer")
    assert [row[0] for row in rows] == ["1", "**all**"]
    assert_finite([cell for row in rows for cell in row[1:]])


def test_weak_heads_capture_stats_diagnose_compare(tmp_path):
    common = ["--length", "256", "--layers", "1", "--work", str(tmp_path / "work")]
    assert weak_heads.main(["capture", *common]) == 0
    assert weak_heads.main(["stats", *common]) == 0
    assert len(list((tmp_path / "work").glob("stats_256_l1_h*.pt"))) == 9  # SmolLM2-135M's heads
    out = tmp_path / "diagnose.md"
    assert weak_heads.main(["diagnose", *common, "--below", "1.01", "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "weak_heads")
    rows = table(text, "layer")
    assert len(rows) == 9 and all(row[0] == "1" for row in rows)  # every head is under a recall of 1.01
    assert_finite([cell for row in rows for cell in row[2:]])
    out = tmp_path / "compare.md"
    assert weak_heads.main(["compare", *common, "--variant", "now:", "--variant", "short:8,32", "--out", str(out)]) == 0
    rows = table(out.read_text(), "variant")
    assert [row[:2] for row in rows] == [["now", "9"], ["short", "9"]]
    assert_finite([cell for row in rows for cell in row[2:]])
