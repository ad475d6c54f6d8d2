"""The dense layers' kernel (``sparse.dense``) off CUDA: SDPA, named in the banner; ``benchmarks.dense_kernels`` on
a tiny CPU case checks it against the float64 definition and times it, and its check fails a kernel with a wrong
scale. The GPU side is ``tests/gpu/test_gpu_dense.py``."""

from __future__ import annotations

import torch
from bench_reports import assert_finite, assert_header, table

from benchmarks import dense_kernels
from ds_mtraining.sparse import dense
from ds_mtraining.training import describe, plan
from ds_mtraining.training.cli import parse_args

ARGS = ["--device", "cpu", "--dtype", "fp32", "--seqlens", "256", "--check-seqlen", "100", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "64", "--rep-ms", "1"]  # fmt: skip


def test_dense_kernels(tmp_path):
    out = tmp_path / "dense.md"
    assert dense_kernels.main([*ARGS, "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "dense_kernels")
    assert "the project's choice here: `sdpa`" in text
    checks = table(text, "kernel")
    assert [row[0] for row in checks] == ["dense_causal_attention"] and checks[0][2] == "yes"
    assert all(float(e) < 1e-5 for e in checks[0][1].split(" / "))
    times = table(text, "N")
    assert [row[:2] for row in times] == [["256", "dense_causal_attention"]]
    assert_finite(times[0][2:4])


def test_the_check_catches_a_wrong_kernel():
    args = type("Args", (), {"device": "cpu", "check_seqlen": 100, "seed": 0, "heads": 4, "kv_heads": 2,
                             "head_dim": 64})  # fmt: skip
    wrong = lambda q, k, v, scale: dense.dense_causal_attention(q, k, v, 2 * scale)  # noqa: E731
    assert max(dense_kernels.errors(wrong, args, torch.float32)) > dense_kernels.TOLERANCE[torch.float32]
    assert max(dense_kernels.errors(dense.dense_causal_attention, args, torch.float32)) < 1e-5


def test_off_cuda_the_choice_is_sdpa():
    assert dense.dense_kernel(torch.device("cpu"), torch.bfloat16, 128) == "sdpa"


def test_the_banner_names_the_dense_kernel(tmp_path):
    args = parse_args(["--deepspeed", "ds_configs/zero2.json", "--output-dir", str(tmp_path / "out")])
    kernels = next(line for line in describe(plan(args)).splitlines() if line.startswith("kernels "))
    assert kernels.endswith("; dense attention: SDPA (cuDNN first)"), kernels
