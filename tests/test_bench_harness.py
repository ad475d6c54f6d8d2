"""``benchmarks.harness``: the one timing, header and report every benchmark uses."""

from __future__ import annotations

import time

import torch
from bench_reports import assert_header

from benchmarks import harness


def test_median_ms_on_cpu_times_each_call_and_repeats_within_the_budget():
    calls = []

    def sleep() -> None:
        calls.append(None)
        time.sleep(0.01)

    ms = harness.median_ms(sleep, rep_ms=60, warmup_ms=0, device="cpu")
    assert 9 <= ms <= 40, ms
    assert 1 + 1 <= len(calls) <= 1 + 6, len(calls)  # the warm-up call, then up to 60 / 10 timed ones
    calls.clear()
    harness.median_ms(sleep, rep_ms=0, warmup_ms=0, device="cpu")
    assert len(calls) == 2  # a slow call: the warm-up and one timed call


def test_forward_backward_ms_times_both_and_leaves_the_inputs_alone():
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    fwd, both = harness.forward_backward_ms(lambda a, b: a @ b, [x, w], torch.ones(64, 64), rep_ms=5)
    assert 0 < fwd and 0 < both
    assert x.grad is None and not x.requires_grad


def test_profile_ms_names_the_ops_of_the_call():
    x = torch.randn(128, 128)
    times = harness.profile_ms(lambda: x @ x, device="cpu")
    assert "aten::mm" in times and times["aten::mm"] > 0
    assert list(times.values()) == sorted(times.values(), reverse=True)


def test_clock_intervals_between_marks():
    clock = harness.Clock(torch.device("cpu"))
    clock.mark()
    time.sleep(0.01)
    clock.mark()
    clock.mark()
    first, second = clock.intervals()
    assert first >= 9 and 0 <= second < first


def test_header_names_date_machine_versions_and_the_exact_command():
    lines = harness.header("A title", "benchmarks.example", ["--out", "a b.md"], device="cpu", packages=("pytest",))
    assert_header("\n".join(lines), "example")
    assert "pytest " in lines[2] and "no GPU" in lines[2]
    assert lines[4] == "command: `python -m benchmarks.example --out 'a b.md'`"  # quoted: it runs as written


def test_report_prints_each_addition_and_rewrites_the_file(tmp_path, capsys):
    path = tmp_path / "report.md"
    report = harness.Report(path)
    report.add("# title", "")
    report.add("| a |")
    assert path.read_text() == "# title\n\n| a |\n"
    assert capsys.readouterr().out == "# title\n\n| a |\n"
    report.replace("whole")
    assert path.read_text() == "whole\n" and capsys.readouterr().out == ""
    harness.Report(None, echo=False).add("nothing written, nothing printed")
    assert capsys.readouterr().out == ""


def test_tokens():
    assert [harness.tokens(n) for n in (32768, 131072, 1000)] == ["32K", "128K", "1000"]
