"""``benchmarks.mapped_call`` on a tiny CPU case (the Triton interpreter): its table has the five calls with finite
times, each direction's first call the baseline, and identity maps give the one-device results."""

from __future__ import annotations

import pytest
from bench_reports import assert_finite, assert_header, table

pytest.importorskip("triton")

from benchmarks import mapped_call  # noqa: E402


def test_mapped_call(tmp_path):
    out = tmp_path / "mapped.md"
    # 4 blocks of 64 and one GQA group of 2 query heads: the interpreter's time grows with the tiles and heads (512
    # tokens and 4 / 2 heads: 90 s against 26 s), the table and the identity maps' exact results do not.
    args = ["--device", "cpu", "--dtype", "fp32", "--seqlen", "256", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "64", "--rep-ms", "1", "--out", str(out)]  # fmt: skip
    assert mapped_call.main(args) == 0
    text = out.read_text()
    assert_header(text, "mapped_call")
    rows = table(text, "call")
    assert [row[0] for row in rows] == ["forward, one device", "forward, maps", "forward, maps + merge",
                                        "backward, one device", "backward, maps"]  # fmt: skip
    assert_finite([cell for row in rows for cell in row[1:3]])
    assert rows[0][2] == "1.00" and rows[3][2] == "1.00"
    errors = text.split("(out, lse, dq, dk, dv): ")[1].splitlines()[0].split(", ")
    assert len(errors) == 5 and all(float(e) < 1e-5 for e in errors), errors
