"""The parallel benchmarks on tiny CPU cases: the ring's work model per layout (in process) and the ring's weak
scaling on two gloo processes (``torchrun``, as on the GPUs); their tables have their rows with finite numbers."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_reports import assert_finite, assert_header, table

from benchmarks import multi_gpu, ring_balance, ring_host, ring_kernels, ring_steps

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


def test_ring_host(tmp_path):
    out = tmp_path / "host.md"
    argv = ["--device", "cpu", "--dtype", "fp32", "--seqlens", "2048", "1024", "--worlds", "4", "2", "--heads", "2",
            "--head-dim", "64", "--calls", "2", "--out", str(out)]  # fmt: skip
    assert ring_host.main(argv) == 0
    text = out.read_text()
    assert_header(text, "ring_host")
    rows = table(text, "tokens")
    assert [row[:4] for row in rows] == [[n, w, local, call] for n, w, local in (("2K", "4", "512"), ("1K", "2", "512"))
                                         for call in ("forward", "backward")]  # fmt: skip
    assert_finite([cell for row in rows for cell in row[4:6]])
    assert all(0 < float(row[4]) <= float(row[5]) for row in rows)  # issuing a call cannot outlast running it
    with pytest.raises(SystemExit):
        ring_host.main(["--device", "cpu", "--seqlens", "2048", "--worlds", "4", "8"])


def test_ring_steps(tmp_path):
    """Every (rank, step) of rings of 2 and 4 ranks is timed (each rank's merged steps first checked against the
    one-device attention), with the work model's counts; the fitted cost model and its errors are reported, and each
    ring's overhead over the one-device run (W = 1)."""
    out, fit = tmp_path / "steps.md", tmp_path / "fit.json"
    argv = ["--device", "cpu", "--dtype", "fp32", "--seqlens", "512", "--worlds", "1", "2", "4", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "64", "--rep-ms", "1", "--check-ranks", "4", "--fit", str(fit),
            "--groups", "1", "2", "4", "--out", str(out)]  # fmt: skip
    assert ring_steps.main(argv) == 0
    text = out.read_text()
    assert_header(text, "ring_steps")
    shapes = [["512", "1", "ring"], ["512", "2", "ring"], ["512", "2", "all-gather 2"], ["512", "4", "ring"],
              ["512", "4", "all-gather 2"], ["512", "4", "all-gather 4"]]  # fmt: skip
    for direction in ("forward", "backward"):  # the model prices ring steps: the one-device rows are not fitted
        rows = table(text.split(f"## {direction}")[1], "tokens")
        assert [row[:4] for row in rows] == [s + [p] for s, p in zip(shapes[1:], ["4", "2", "16", "8", "4"])]
        assert_finite([cell for row in rows for cell in row[4:]])
    overhead = table(text.split("## Ring overhead")[1], "tokens")
    assert [row[:4] for row in overhead] == [s + [p] for s, p in zip(shapes, ["1", "2", "1", "4", "2", "1"])]
    assert overhead[0][7] == "1.00"
    assert_finite([cell for row in overhead for cell in row[4:]])
    record = json.loads(fit.read_text())
    steps = record["steps"]
    for world, group in ((2, 2), (4, 2), (4, 4)):  # a grouped step does the work of the ring steps it replaces
        ring = sum(s["tiles"] for s in steps if (s["world"], s["group"]) == (world, 1))
        assert sum(s["tiles"] for s in steps if (s["world"], s["group"]) == (world, group)) == pytest.approx(ring)
    for world in (2, 4):
        mine = [s for s in steps if s["world"] == world and s["group"] == 1]
        assert sorted((s["rank"], s["step"]) for s in mine) == [(r, t) for r in range(world) for t in range(world)]
        for rank in range(world):  # each rank meets every shard once
            assert sorted(s["src"] for s in mine if s["rank"] == rank) == list(range(world))
        assert all(s["fwd_ms"] > 0 and s["bwd_ms"] > 0 for s in mine)
        assert sum(s["tiles"] for s in mine) > 0
    assert all(math.isfinite(v) for part in record["model"].values() for v in part.values())
    # --refit fits saved steps again (a calibration joined from several calls): the same model and tables.
    again, refit = tmp_path / "again.md", tmp_path / "refit.json"
    assert ring_steps.main(["--refit", str(fit), "--fit", str(refit), "--out", str(again)]) == 0
    model = json.loads(refit.read_text())["model"]
    assert all(model[d] == pytest.approx(record["model"][d]) for d in ("forward", "backward"))
    for section in ("## forward", "## backward", "## Ring overhead"):
        assert table(again.read_text().split(section)[1], "tokens") == table(text.split(section)[1], "tokens")


def test_ring_steps_on_sampled_ranks(tmp_path):
    """--ranks K times K evenly spaced ranks (the first and the last among them), each standing for W / K ranks in
    the sums; a count below 1 is refused."""
    assert ring_steps.sampled_ranks(8, 3) == [0, 4, 7] and ring_steps.sampled_ranks(4, None) == [0, 1, 2, 3]
    assert ring_steps.sampled_ranks(4, 9) == [0, 1, 2, 3] and ring_steps.sampled_ranks(5, 1) == [0]
    with pytest.raises(ValueError, match="--ranks must be >= 1"):
        ring_steps.sampled_ranks(4, 0)
    out, fit = tmp_path / "steps.md", tmp_path / "fit.json"
    argv = ["--device", "cpu", "--dtype", "fp32", "--seqlens", "512", "--worlds", "1", "4", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "64", "--rep-ms", "1", "--check-ranks", "2", "--ranks", "2",
            "--groups", "1", "2", "--fit", str(fit), "--out", str(out)]  # fmt: skip
    assert ring_steps.main(argv) == 0
    steps = json.loads(fit.read_text())["steps"]
    for group, calls in ((1, 4), (2, 2)):
        mine = [s for s in steps if (s["world"], s["group"]) == (4, group)]
        assert sorted({s["rank"] for s in mine}) == [0, 3] and len(mine) == 2 * calls
        assert all(s["weight"] == 2.0 for s in mine)
    overhead = table(out.read_text().split("## Ring overhead")[1], "tokens")
    for row, group in zip(overhead[1:], (1, 2)):  # the sums count each sampled rank twice
        mine = [s for s in steps if (s["world"], s["group"]) == (4, group)]
        assert float(row[4]) == pytest.approx(2 * sum(s["fwd_ms"] for s in mine), abs=0.01)
        assert float(row[5]) == pytest.approx(2 * sum(s["bwd_ms"] for s in mine), abs=0.01)


def test_ring_kernels(tmp_path):
    """Each pass's time summed over a ring's pairs, per variant of the planted index, against the one-device call (its
    ratio 1.00); a shape whose group does not divide the ring is refused."""
    out = tmp_path / "kernels.md"
    argv = ["--device", "cpu", "--dtype", "fp32", "--seqlen", "512", "--shapes", "1:1", "2:1", "2:2", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "64", "--variants", "full", "diagonal", "--out", str(out)]  # fmt: skip
    assert ring_kernels.main(argv) == 0
    text = out.read_text()
    assert_header(text, "ring_kernels")
    for name in ("full", "diagonal"):
        rows = table(text.split(f"## {name}")[1], "W")
        assert [row[:3] for row in rows] == [[w, kv, d] for w, kv in (("1", "ring"), ("2", "ring"), ("2", "all-gather 2"))
                                             for d in ("forward", "backward")]  # fmt: skip
        assert [row[4] for row in rows[:2]] == ["1.00", "1.00"]
        assert all(float(row[3]) > 0 for row in rows)
    diagonal = ring_kernels.variant(ring_steps.make_pattern(
        argparse.Namespace(pattern="planted", heads=4, density=0.2, seed=0, device="cpu"), 512), "diagonal").index
    assert (diagonal.slash == 0).all() and (diagonal.vertical == -1).all()
    with pytest.raises(SystemExit):
        ring_kernels.main(["--device", "cpu", "--shapes", "4:3"])


def test_ring_kernels_runs_every_call_with_the_launch_config_asked(tmp_path, monkeypatch, capsys):
    """``--launch-config`` is in force for every measured call (what the Triton launchers read), the header names it,
    and a malformed spec, an unknown pass, an invalid config or one the block size does not take is one usage error
    (exit 2)."""
    from ds_mtraining.sparse.triton.launch_config import launch_config

    seen = []
    measure = ring_steps.measure

    def recording(*args, **kwargs):
        seen.append(launch_config(torch.bfloat16, 64, 128)["dkdv"])
        return measure(*args, **kwargs)

    monkeypatch.setattr(ring_steps, "measure", recording)
    out = tmp_path / "kernels.md"
    argv = ["--device", "cpu", "--dtype", "fp32", "--seqlen", "512", "--shapes", "1:1", "2:2", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "64", "--launch-config", "dkdv=64,32,4,2", "--out", str(out)]  # fmt: skip
    assert ring_kernels.main(argv) == 0
    assert seen == [(64, 32, 4, 2)] * 2
    assert "dkdv=64,32,4,2 (launch config)" in out.read_text()
    assert launch_config(torch.bfloat16, 64, 128)["dkdv"] != (64, 32, 4, 2)  # not left in force after the run
    refused = (("dkdv=64,32", "PASS=BLOCK,INNER,WARPS,STAGES"), ("bwd=64,64,4,2", "unknown pass"),
               ("dkdv=48,32,4,2", "powers of two"), ("dkdv=128,64,4,2", "must divide the block size 64"))
    for spec, needle in refused:
        with pytest.raises(SystemExit) as stop:
            ring_kernels.main(["--device", "cpu", "--launch-config", spec])
        assert stop.value.code == 2
        assert needle in capsys.readouterr().err


def test_ring_steps_on_the_committed_real_indices(tmp_path):
    """SmolLM2's saved indices (9 heads), stretched to the length and cycled to the 3B shape's 16 heads: every pair of
    a 2-rank ring timed."""
    out, fit = tmp_path / "steps.md", tmp_path / "fit.json"
    indices = REPO / "benchmarks" / "results" / "2026-11-29-smollm2_8k_indices.pt"
    argv = ["--device", "cpu", "--dtype", "fp32", "--seqlens", "512", "--worlds", "2", "--heads", "16",
            "--kv-heads", "2", "--head-dim", "64", "--pattern", "real", "--indices", str(indices), "--layer", "3",
            "--rep-ms", "1", "--check-ranks", "2", "--fit", str(fit), "--out", str(out)]  # fmt: skip
    assert ring_steps.main(argv) == 0
    assert len(json.loads(fit.read_text())["steps"]) == 4
    with pytest.raises(SystemExit, match="has no layer 99"):
        ring_steps.main([a if a != "3" else "99" for a in argv])


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
