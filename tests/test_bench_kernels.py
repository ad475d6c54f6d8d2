"""The attention-kernel benchmarks on tiny CPU cases (the Triton kernels through the interpreter, fp32): each runs
end to end and its tables have their rows with finite numbers, so none can rot unnoticed."""

from __future__ import annotations

import pytest
from bench_reports import assert_finite, assert_header, table

from benchmarks import cpu_sparse_attention, flash4_probe, kernel_bench, kernel_breakdown, kernel_tune, packed_bench
from benchmarks.baselines import flex_block_mask
from benchmarks.cases import index_for_density
from ds_mtraining.sparse.index import index_to_dense_mask

SHAPE = ["--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--rep-ms", "1"]


def test_kernel_bench(tmp_path):
    out = tmp_path / "kernel_bench.md"
    args = ["--device", "cpu", "--sizes", "256", "--densities", "0.1", "--block-size", "64", *SHAPE, "--out", str(out)]
    assert kernel_bench.main(args) == 0
    text = out.read_text()
    assert_header(text, "kernel_bench")
    (row,) = table(text, "N")
    assert row[:2] == ["256", "90 %"]
    assert_finite([row[2], *row[4:7], row[17]])  # density, ours fwd / fwd+bwd / ratio, the estimator
    assert row[7] == row[9] == "nan"  # FlexAttention and cuDNN: GPU only


def test_flash4_probe(tmp_path):
    """Ours is checked against float64 and timed; flash-attn-4 (not installable here) reads n/a, never a crash."""
    out = tmp_path / "flash4.md"
    args = ["--device", "cpu", "--seqlen", "512", "--columns", "96", "--check-seqlen", "384", *SHAPE, "--out", str(out)]
    assert flash4_probe.main(args) == 0
    text = out.read_text()
    assert_header(text, "flash4_probe")
    errors = [line for line in text.splitlines() if line.startswith("- ours: ")]
    assert len(errors) == 1
    assert all(float(e) < 1e-5 for e in errors[0].removeprefix("- ours: ").split(" / "))
    rows = table(text, "index")
    assert [r[2] for r in rows if r[2] == "ours"] == ["ours", "ours"]
    for row in rows:
        if row[2] == "ours":
            assert_finite(row[4:6])
        else:
            assert row[3:] == ["n/a"] * 6


def test_flex_block_mask_holds_every_entry_our_kernels_attend():
    index, _ = index_for_density(1, 2, 1000, 128, 0.1, device="cpu")
    mask, tiles = flex_block_mask(index, 1000)
    tile_rows = mask.to_dense()[0, :, :, :]  # [H, q tiles, kv tiles]
    entries = index_to_dense_mask(index, 1000)[0]  # [H, N, N]
    covered = tile_rows.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :1000, :1000].bool()
    assert not (entries & ~covered).any()
    assert 0 < tiles < 1


def test_kernel_tune(tmp_path):
    out = tmp_path / "tune.md"
    args = ["--device", "cpu", "--quick", "--seqlen", "256", "--block-size", "64", "--passes", "fwd", *SHAPE,
            "--out", str(out)]  # fmt: skip
    assert kernel_tune.main(args) == 0
    text = out.read_text()
    assert_header(text, "kernel_tune")
    rows = table(text, "config (block, inner, warps, stages)")
    assert len(rows) == 2 and all(row[-1] == "ok" for row in rows), rows  # the default and one more, both match
    assert_finite([cell for row in rows for cell in row[1:4]])
    assert_finite([cell for row in table(text, "configs") for cell in row[1:]])
    assert "```python\n_CONFIG_FP32 = {" in text


def test_packed_bench(tmp_path):
    out = tmp_path / "packed.md"
    args = ["--device", "cpu", "--seqlen", "256", "--documents", "128:0.9", *SHAPE, "--out", str(out)]
    assert packed_bench.main(args) == 0
    text = out.read_text()
    assert_header(text, "packed_bench")
    (row,) = table(text, "row")
    assert row[:3] == ["256", "64", "128 x 2"]
    assert_finite([*row[3:9], *row[10:13]])
    assert row[9] == "not run (GPU only)"  # compiled FlexAttention
    assert "ours dq" in row[14]


def test_kernel_breakdown(tmp_path):
    out = tmp_path / "breakdown.md"
    args = ["--device", "cpu", "--row", "256", "--cases", "128:0.9", *SHAPE, "--out", str(out)]
    assert kernel_breakdown.main(args) == 0
    text = out.read_text()
    assert_header(text, "kernel_breakdown")
    rows = table(text, "documents | index")
    assert [row[1] for row in rows] == ["planted", "no columns", "columns + diagonal", "diagonal only", "all offsets"]
    assert_finite([cell for row in rows for cell in row[2:]])
    (bound,) = table(text, "documents | planted density")
    assert_finite(bound[1:])


def test_cpu_sparse_attention(tmp_path):
    out = tmp_path / "cpu.md"
    assert cpu_sparse_attention.main(["--seqlens", "256", "--heads", "2", "--rep-ms", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert_header(text, "cpu_sparse_attention")
    (row,) = table(text, "N")
    assert row[0] == "256"
    assert_finite(row[1:])


@pytest.mark.parametrize("main", [kernel_bench.main, kernel_tune.main])
def test_kernel_benchmarks_refuse_the_cpu_without_the_interpreter(main, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        main(["--device", "cpu"])
