"""The benchmarks that launch the training job (``launch/train.py``, ``launch/export.py``) on tiny CPU cases.

A real launch costs 10-40 s on CPU, and the job itself is tested by ``test_train*.py``; here a stand-in for
``subprocess.run`` takes each command the benchmark launches, parses it with the job's own argument parser (a
renamed or dropped flag fails), checks the DeepSpeed config it names with the package's config model, and writes
what the finished run writes (``metrics.jsonl``; the export's folder). The benchmark's own steps all run: its configs,
its commands, its reading of the metrics and its report.
"""

from __future__ import annotations

import json
import runpy
import subprocess
from pathlib import Path

import pytest
from bench_reports import assert_finite, assert_header, table

from benchmarks import context_extension, train_scaling, zero_stage_losses
from ds_mtraining.config import MTrainingConfig
from ds_mtraining.training.cli import parse_args as train_args

REPO = Path(__file__).resolve().parents[1]
export_args = runpy.run_path(str(REPO / "launch" / "export.py"))["parse_args"]


class Jobs:
    """Stands in for ``subprocess.run`` (module docstring); ``commands`` holds what was launched, as the job's
    parsed settings."""

    def __init__(self) -> None:
        self.commands: list = []

    def __call__(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        script = next(i for i, part in enumerate(command) if part.endswith(("launch/train.py", "launch/export.py")))
        if command[script].endswith("export.py"):
            args = export_args(command[script + 1 :])
            (args.out / "config.json").parent.mkdir(parents=True)
            (args.out / "config.json").write_text("{}")
        else:
            args = train_args(command[script + 1 :])
            config = MTrainingConfig.from_deepspeed_config(args.deepspeed)
            processes = int(command[command.index("--nproc_per_node") + 1]) if "--nproc_per_node" in command else 1
            assert config.parallel.sequence_parallel_size == processes, "one sequence-parallel rank a process"
            self.write_metrics(args, processes)
        self.commands.append(args)
        if kwargs.get("stdout") is not None:  # a log file
            kwargs["stdout"].write("done\n")
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    @staticmethod
    def write_metrics(args, processes: int) -> None:
        """Records as the Trainer writes them: a loss that falls, ``heldout_loss`` where it is evaluated."""
        out = Path(args.output_dir)
        out.mkdir(parents=True)
        records = []
        for step in range(1, args.steps + 1):
            record = {"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "seconds": 0.5,
                      "tokens_per_s": 1000.0 * processes}  # fmt: skip
            if args.heldout and (step == args.steps or (args.heldout_every and step % args.heldout_every == 0)):
                record["heldout_loss"] = 5.5 - 0.1 * step
            records.append(record)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def jobs(monkeypatch) -> Jobs:
    jobs = Jobs()
    monkeypatch.setattr(subprocess, "run", jobs)
    return jobs


def test_train_scaling(tmp_path, jobs):
    out = tmp_path / "scaling.md"
    assert train_scaling.main(["--gpus", "2", "--seqlen", "256", "--steps", "3", "--out", str(out)]) == 0
    assert [(c.seqlen, c.steps) for c in jobs.commands] == [(256, 3)] * 4
    text = out.read_text()
    assert_header(text, "train_scaling")
    rows = table(text, "attention")
    assert [row[:2] for row in rows] == [["sparse", "1"], ["sparse", "2"], ["dense", "1"], ["dense", "2"]]
    assert [row[3] for row in rows] == ["1.00x", "2.00x", "1.00x", "2.00x"]
    assert_finite([cell for row in rows for cell in row[2:]])


def test_zero_stage_losses(tmp_path, jobs):
    out = tmp_path / "zero.md"
    assert zero_stage_losses.main(["--seqlen", "128", "--steps", "2", "--out", str(out)]) == 0
    assert len(jobs.commands) == len(zero_stage_losses.VARIANTS)
    text = out.read_text()
    assert_header(text, "zero_stage_losses")
    rows = table(text, "variant")
    assert [row[:2] for row in rows] == [[name, str(step)] for name in zero_stage_losses.VARIANTS for step in (1, 2)]
    assert_finite([cell for row in rows for cell in row[2:]])
    assert text.rstrip().splitlines()[-1].startswith("PASS: ")


def test_context_extension(tmp_path, jobs):
    work, out = tmp_path / "work", tmp_path / "extension.md"
    args = ["--model", "smollm2-135m", "--data", str(tmp_path / "train"), "--heldout", str(tmp_path / "heldout"),
            "--seqlen", "256", "--steps", "4", "--heldout-every", "2", "--rope-kind", "yarn", "--lr", "1e-3",
            "--work", str(work), "--out", str(out)]  # fmt: skip
    assert context_extension.main(args) == 0
    trained = [c for c in jobs.commands if hasattr(c, "output_dir")]
    assert [Path(c.output_dir).name for c in trained] == ["dense", "sparse"]
    config = json.loads(Path(trained[1].deepspeed).read_text())
    assert config["optimizer"]["params"]["lr"] == 1e-3 and config["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    text = out.read_text()
    assert_header(text, "context_extension")
    rows = table(text, "run")
    assert [row[0] for row in rows] == ["dense", "sparse"] and rows[1][2] == "1.00x" and rows[1][5] == "+0.00%"
    assert_finite([cell for row in rows for cell in row[1:]])
    assert out.with_suffix(".png").stat().st_size > 0
    # A second call keeps both exported runs and trains nothing.
    count = len(jobs.commands)
    assert context_extension.main(args) == 0 and len(jobs.commands) == count
