"""The parallel benchmarks on tiny CPU cases: the ring's work model per layout (in process) and the ring's weak
scaling on two gloo processes (``torchrun``, as on the GPUs); their tables have their rows with finite numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench_reports import assert_finite, assert_header, table

from benchmarks import multi_gpu, ring_balance

REPO = Path(__file__).resolve().parents[1]


def test_ring_balance(tmp_path):
    out = tmp_path / "balance.md"
    assert ring_balance.main(["--seqlens", "4096", "--worlds", "2", "16", "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "ring_balance")
    rows = table(text, "W")
    layouts = ["contiguous", "zigzag", "striped", "striped+gathered (ring)", "striped+balancing"]
    assert [row[4] for row in rows] == layouts * 3 * 2  # 3 sparsities x 2 ring sizes
    levers = table(text.split("## Levers")[1], "W")
    assert [row[4] for row in levers] == [
        f"{layout}{lever}" for layout in ("striped", "zigzag")
        for lever in ("", " + gathered columns", " + own-shard tiles moved", " + both")
    ]  # fmt: skip
    assert all(row[0] == "16" for row in levers)  # the largest ring
    assert_finite([cell for row in rows + levers for cell in row[3:4] + row[5:]])
    comm = table(text, "ring")
    assert [row[:2] for row in comm] == [[ring, schedule] for ring in ("flat", "hierarchical 2x8")
                                         for schedule in ("striped", "striped+balancing")]  # fmt: skip
    assert_finite([cell for row in comm for cell in row[2:]])


def test_multi_gpu_on_two_cpu_processes(tmp_path):
    out = tmp_path / "multi_gpu.md"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "benchmarks.multi_gpu",
               "--quick", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert_header(text, "multi_gpu", launcher="torchrun --nproc_per_node 2 -m")
    rows = table(text, "tokens/GPU")
    methods = [m.name for m in multi_gpu.SINGLE] + [m.name for m in multi_gpu.MULTI]
    assert [row[3] for row in rows] == methods * 2  # at 256 and 512 tokens a process
    assert_finite([cell for row in rows for cell in row[4:]])
    imbalance = table(text, "tokens/GPU | method | source")
    assert len(imbalance) == 2 * len(multi_gpu.MULTI) * 3  # model, measured fwd, measured bwd
    assert_finite([cell for row in imbalance for cell in row[3:7]])
