"""``benchmarks/train_throughput.py`` end to end on a tiny model, every mode: the benchmark cannot break unnoticed."""

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
    command = [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--model", "tiny-qwen2",
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
    assert rows[0][13].strip() == "1.00x" and rows[0][14].strip() == "1.00x"  # dense against itself
    assert float(rows[1][-2]) < 1 and float(rows[0][-2]) == 1  # sparse rows ran sparse layers, dense rows none


def test_train_throughput_refuses_two_names_for_one_setting():
    command = [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--model", "tiny-qwen2",
               "--lengths", "256", "--fused-kernels", "false", "auto"]  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("auto fuses on a GPU: the two settings differ there")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2 and "--fused-kernels False and auto both mean" in done.stderr, done.stderr[-2000:]
