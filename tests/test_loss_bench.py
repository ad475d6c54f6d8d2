"""``benchmarks.loss_bench`` on a tiny case: the table has its rows with finite numbers, so it cannot rot.

On CPU Liger runs through the Triton interpreter (``conftest.py``); without it the table says Liger was not run."""

from __future__ import annotations

import math

import pytest
import torch
from bench_reports import assert_header

from benchmarks import loss_bench

TINY = ["--tokens", "32", "48", "--hidden", "16", "--vocab", "40", "--rep-ms", "1"]


def _rows(report: str) -> dict[tuple[int, str], list[str]]:
    """Table rows by (tokens, loss), their cells after those two."""
    lines = [line for line in report.splitlines() if line.startswith("| ")][1:]  # the header row first
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {(int(c[0]), c[1]): c[2:] for c in cells}


def test_table_with_every_row(tmp_path):
    assert loss_bench.main([*TINY, "--dtype", "bf16", "--out", str(tmp_path / "loss.md")]) == 0
    report = (tmp_path / "loss.md").read_text()
    assert_header(report, "loss_bench")
    assert "liger-kernel " in report.splitlines()[2] and "--tokens 32 48" in report.splitlines()[4]
    rows = _rows(report)
    names = ("tiled", "liger (accum fp32)", "liger (accum weight dtype)")
    assert sorted(rows) == sorted((tokens, name) for tokens in (32, 48) for name in names)
    on_gpu = torch.cuda.is_available()
    for (tokens, name), (chunks, ms, tflops, peak, time_ratio, memory_ratio, loss, diff) in rows.items():
        count, size = (int(x) for x in chunks.split(" x "))
        assert count == math.ceil(tokens / size), chunks
        numbers = [ms, tflops, time_ratio, loss] + ([peak, memory_ratio] if on_gpu else [])
        assert all(math.isfinite(float(x)) and float(x) > 0 for x in numbers), (tokens, name, numbers)
        assert on_gpu or peak == memory_ratio == "–"  # no peak memory on CPU
        if name == "tiled":
            assert time_ratio == "1.00" and diff == "–"
        else:
            # Same loss as ours; gradients within bf16 rounding of ours (bf16 logits and gradients in both).
            assert float(loss) == pytest.approx(float(rows[tokens, "tiled"][6]), rel=1e-5)
            assert all(float(x) < 2**-5 for x in diff.split(" / ")), diff


@pytest.mark.skipif(torch.cuda.is_available(), reason="Liger always runs on a GPU")
def test_says_liger_was_not_run_without_the_interpreter(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert loss_bench.main([*TINY, "--dtype", "fp32", "--out", str(tmp_path / "loss.md")]) == 0
    rows = _rows((tmp_path / "loss.md").read_text())
    assert sorted(rows) == sorted((tokens, name) for tokens in (32, 48) for name in ("tiled", loss_bench.NOT_RUN))
    assert all(math.isfinite(float(rows[tokens, "tiled"][1])) for tokens in (32, 48))
