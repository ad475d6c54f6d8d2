"""``benchmarks.train_throughput`` end to end on a tiny model, every mode: the benchmark cannot break unnoticed."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_train_throughput_runs_every_mode(tmp_path):
    out = tmp_path / "report.md"
    command = [sys.executable, "-m", "benchmarks.train_throughput", "--model", "tiny-qwen2",
               "--lengths", "256", "--accumulation", "4", "--steps", "2", "--fused-kernels", "false",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if re.match(r"\| off \| 256 \|", line)]
    assert [r[2].strip() for r in rows] == ["dense", "sparse", "planted", "none"]
    for r in rows:
        micro, forward, backward, optimizer, step_1, step_a = (float(r[i]) for i in (3, 6, 7, 8, 9, 10))
        assert min(micro, forward, backward, optimizer) > 0
        assert step_1 == pytest.approx(forward + backward + optimizer, abs=0.02)
        assert step_a == pytest.approx(3 * micro + step_1, abs=0.1)  # accumulation 4: 3 inside + the boundary
        tokens_per_s = float(r[11].replace(",", ""))  # to 1 token/s, from a step @1 to 0.01 s
        assert 256 / (step_1 + 0.005) - 0.5 <= tokens_per_s <= 256 / (step_1 - 0.005) + 0.5
        assert 0 < float(r[-2]) <= 1 and math.isfinite(float(r[-1]))  # the sparse-layer density, the loss
        assert 0 < float(r[-3]) < 10  # the start-up estimate of the peak (GiB): reduce buckets, a tiny model
    assert rows[0][13].strip() == "1.00x" and rows[0][14].strip() == "1.00x"  # dense against itself
    assert float(rows[1][-2]) < 1 and float(rows[0][-2]) == 1  # sparse rows ran sparse layers, dense rows none


def test_train_throughput_refuses_two_names_for_one_setting():
    command = [sys.executable, "-m", "benchmarks.train_throughput", "--model", "tiny-qwen2",
               "--lengths", "256", "--fused-kernels", "false", "auto"]  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("auto fuses on a GPU: the two settings differ there")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2 and "--fused-kernels False and auto both mean" in done.stderr, done.stderr[-2000:]


def test_dense_rows_run_for_every_length(tmp_path):
    """The dense rows of the second length ran too when the first length's last mode was not dense."""
    out = tmp_path / "report.md"
    command = [sys.executable, "-m", "benchmarks.train_throughput", "--model", "tiny-qwen2",
               "--lengths", "128", "256", "--modes", "dense", "none", "--accumulation", "2", "--warmup", "1",
               "--fused-kernels", "false", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in out.read_text().splitlines()
            if re.match(r"\| off \| \d+ \|", line)]  # fmt: skip
    assert rows == [["off", "128", "dense"], ["off", "128", "none"], ["off", "256", "dense"], ["off", "256", "none"]]


def test_a_row_out_of_gpu_memory_is_reported_in_the_table():
    from benchmarks import train_throughput

    row = {"micro": 2.0, "spread": 0.0, "forward": 0.5, "backward": 1.5, "optimizer": 0.1, "step_1": 2.1,
           "step_a": 4.1, "tokens_per_s_1": 100.0, "tokens_per_s_a": 200.0, "peak_gib": 10.0, "estimated_gib": 9.0, "loss": 1.0,
           "density": 1.0, "profile": None}  # fmt: skip
    rows = [row | {"fused": True, "seqlen": 1024, "mode": "dense"}, row | {"fused": True, "seqlen": 1024, "mode": "none"},
            {"seqlen": 1024, "mode": "sparse", "fused": False, "out_of_memory": True, "peak_gib": 130.5}]  # fmt: skip
    lines = [line for line in train_throughput.table(rows, accumulation=2).splitlines() if line.startswith("| on") or line.startswith("| off")]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    assert all(len(c) == 21 for c in cells)
    assert cells[2][:4] == ["off", "1K", "sparse", "out of GPU memory"] and cells[2][17] == "130.5"
    assert cells[1][14] == "1.00x"  # none against the dense row: the out-of-memory row does not disturb the others
