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
    """Every mode at two lengths: each row's times add up, and the second length runs all its rows too (its dense
    reference among them), though the first length's last mode is not dense."""
    out = tmp_path / "report.md"
    command = [sys.executable, "-m", "benchmarks.train_throughput", "--model", "tiny-qwen2",
               "--lengths", "128", "256", "--accumulation", "4", "--steps", "2", "--fused-kernels", "false",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if re.match(r"\| off \| \d+ \|", line)]
    modes = ["dense", "sparse", "planted", "none"]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [(n, m) for n in ("128", "256") for m in modes]
    for r in rows:
        micro, forward, backward, optimizer, step_1, step_a = (float(r[i]) for i in (3, 6, 7, 8, 9, 10))
        assert min(micro, forward, backward, optimizer) > 0
        assert step_1 == pytest.approx(forward + backward + optimizer, abs=0.02)
        assert step_a == pytest.approx(3 * micro + step_1, abs=0.1)  # accumulation 4: 3 inside + the boundary
        seqlen = int(r[1])
        tokens_per_s = float(r[11].replace(",", ""))  # to 1 token/s, from a step @1 to 0.01 s
        assert seqlen / (step_1 + 0.005) - 0.5 <= tokens_per_s <= seqlen / (step_1 - 0.005) + 0.5
        assert 0 < float(r[-2]) <= 1 and math.isfinite(float(r[-1]))  # the sparse-layer density, the loss
        assert 0 < float(r[-3]) < 10  # the start-up estimate of the peak (GiB): reduce buckets, a tiny model
    for dense in (rows[0], rows[4]):  # each length's dense row against itself
        assert dense[13].strip() == "1.00x" and dense[14].strip() == "1.00x" and float(dense[-2]) == 1
    assert float(rows[5][-2]) < 1  # 256's sparse row ran sparse layers (128 tokens are two blocks: all attended)


def test_train_throughput_refuses_two_names_for_one_setting():
    command = [sys.executable, "-m", "benchmarks.train_throughput", "--model", "tiny-qwen2",
               "--lengths", "256", "--fused-kernels", "false", "auto"]  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("auto fuses on a GPU: the two settings differ there")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2 and "--fused-kernels False and auto both mean" in done.stderr, done.stderr[-2000:]


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
