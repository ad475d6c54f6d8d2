"""``benchmarks.trainer_route`` end to end on the CPU's tiny case (the job and ``examples/hf_trainer.py``, one step
timed each): the report's table has both routes with their tokens/s and the ratio between them, and a route that
fails shows its last lines and makes the benchmark fail."""

from __future__ import annotations


import pytest
from bench_reports import assert_finite, assert_header, numbers, table

from benchmarks import trainer_route

# The shipped default: the CPU Adam it builds is the one every job test uses (zero2.json's fused Adam would be a JIT
# build of its own, 1.5 minutes of CI).
TINY = ["--model", "tiny-qwen2", "--seqlen", "512", "--steps", "2", "--deepspeed", "ds_configs/zero2_offload.json"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """One thread a run (as ``torchrun`` sets it): the runs pass this environment on, and on two cores shared with
    other processes torch's default threads oversubscribe them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(trainer_route.REPO)


def test_the_report_compares_both_routes(tmp_path, capsys):
    out = tmp_path / "report.md"
    assert trainer_route.main([*TINY, "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out  # printed as written
    assert_header(text, "trainer_route")
    rows = {cells[0]: cells[1:] for cells in table(text, "route")}
    assert list(rows) == ["job", "Trainer"], text
    for cells in rows.values():
        assert_finite(cells)
    rates = {route: numbers(cells[0])[0] for route, cells in rows.items()}
    assert all(r > 0 for r in rates.values()), rates
    ratios = {route: numbers(cells[1])[0] for route, cells in rows.items()}
    assert ratios["job"] == 1.0
    # tokens/s to 0.1, the ratio to 0.001: equal within what the rounding of the three allows
    exact = rates["Trainer"] / rates["job"]
    slack = 0.0005 + 0.05 * (1 / rates["job"] + exact / rates["job"])
    assert ratios["Trainer"] == pytest.approx(exact, abs=slack), (ratios, rates)
    assert {cells[2] for cells in rows.values()} == {"1"}  # 2 steps, the first not timed
    for script, route in (("launch/train.py --no-save", "job"), ("examples/hf_trainer.py", "trainer")):
        # As a reader reruns it: no interpreter path or temporary directory of the machine that ran it.
        shown = f"`python {script} --deepspeed ds_configs/zero2_offload.json --model tiny-qwen2 --seqlen 512 --steps 2"
        assert f"{shown} --seed 0 --output-dir DIR/{route}`" in text, text


def test_a_failed_run_shows_its_output_and_fails(capsys):
    assert trainer_route.main([*TINY[2:], "--model", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("job run failed (exit status 2); its last 40 lines of output:"), err
    assert "no-such-model" in err and len(err.splitlines()) <= 41
