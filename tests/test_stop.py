"""Stopping cleanly: a non-finite step ends the job before it saves; SIGTERM to the job or to the ``deepspeed``
command stops every rank after a step with a complete ``latest`` checkpoint and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_train import REPO, SEQLEN, metrics, train, write_config

from ds_mtraining.training.finite import NonFiniteError, check_step
from ds_mtraining.training.manifest import read_manifest, verify_files


def test_check_step_names_the_cause_and_the_checkpoint_kept():
    check_step(3, 1.5, 0.2, "step2")
    check_step(3, 1.5, None, None)  # a norm that was not computed is no evidence
    with pytest.raises(NonFiniteError, match=r"^step 3: loss nan; checkpoint step2 stays latest"):
        check_step(3, float("nan"), 0.2, "step2")
    with pytest.raises(NonFiniteError, match=r"^step 4: loss inf and gradient norm nan; no checkpoint was written"):
        check_step(4, float("inf"), float("nan"), None)


def _run_with_fault(tmp_path: Path, fault: str, steps: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """``launch/train.py``'s job with ``Trainer.train_step`` wrapped by ``fault`` (a function ``faulty(self, real)``
    source), checkpointing every step, as one process; returns the run, its output folder and its config."""
    config = write_config(tmp_path / "config.json")
    out = tmp_path / "out"
    script = tmp_path / "fault.py"
    script.write_text(
        "import sys, torch\nfrom ds_mtraining.training import cli, trainer\nreal = trainer.Trainer.train_step\n"
        + fault + "\ntrainer.Trainer.train_step = lambda self: faulty(self, real)\nsys.exit(cli.main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    argv = ["--seqlen", SEQLEN, "--deepspeed", str(config), "--steps", str(steps), "--save-interval", "1"]
    run = subprocess.run(
        [sys.executable, str(script), *argv, "--output-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    return run, out, config


NAN_AT_STEP_3 = """
def faulty(self, real):
    if self.cursor.next_micro == 4:  # before step 3 (2 micro-batches a step)
        with torch.no_grad():
            self.engine.module.model.embed_tokens.weight.fill_(float("nan"))
    return real(self)
"""


def test_nan_weights_stop_the_job_and_latest_stays_on_the_last_finite_checkpoint(tmp_path):
    run, out, _ = _run_with_fault(tmp_path, NAN_AT_STEP_3, steps=5)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [("error: step 3: loss nan and gradient norm inf; checkpoint step2 stays latest; lower the learning rate or check the "
                       "data, then train again (--resume continues from latest)")], run.stderr[-2000:]  # fmt: skip
    assert (out / "checkpoints" / "latest").read_text() == "step2"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step1", "step2"]
    records = [json.loads(line, parse_constant=_reject) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["loss"] is None  # strict JSON: NaN is null


def _reject(token: str):
    raise ValueError(f"metrics.jsonl holds the non-JSON token {token}")


def _launch(cmd: list[str], out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_steps(out: Path, proc: subprocess.Popen, steps: int, deadline: float = 300.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        path = out / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps within {deadline} s")


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize(
    ("launcher", "sig"), [("python", "SIGTERM"), ("python", "SIGINT"), ("deepspeed", "SIGTERM")], ids=str
)
def test_a_signal_stops_every_process_after_a_step_with_a_complete_latest(tmp_path, launcher, sig):
    """SIGTERM or SIGINT (Ctrl-C) to the process the user started: ``python launch/train.py`` itself, or the
    ``deepspeed`` command (which forwards nothing on one node: the ranks notice their launcher orphaned)."""
    config = write_config(tmp_path / "config.json")
    out = tmp_path / "out"
    job = [str(REPO / "launch" / "train.py"), "--seqlen", SEQLEN, "--deepspeed", str(config), "--steps", "50",
           "--output-dir", str(out)]  # fmt: skip
    if launcher == "python":
        cmd = [sys.executable, *job]
    else:
        port = str(29500 + (os.getpid() + 7) % 1000)
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port", port, *job]
    proc = _launch(cmd, out)
    try:
        _wait_for_steps(out, proc, 2)
        processes = _tree(proc)
        assert len(processes) >= (1 if launcher == "python" else 3)  # runner, launcher, rank
        proc.send_signal(getattr(signal, sig))
        gone, alive = psutil.wait_procs(processes, timeout=120)  # psutil reaps them: Popen.wait would say 0
        assert not alive, f"still running 120 s after {sig}: {alive}"
        status = next(p.returncode for p in gone if p.pid == proc.pid)
    finally:
        _kill_session(proc)
    log = (tmp_path / "out.log").read_text()
    done = metrics(out)[-1]["step"]
    assert done < 50, log[-2000:]
    assert f"stopped   by {sig} after step {done}: checkpoint step{done} is latest; continue with --resume" in log
    assert (out / "checkpoints" / "latest").read_text() == f"step{done}"
    if launcher == "python":
        assert status == 128 + getattr(signal, sig)
    # The final checkpoint is complete: every file its manifest lists, with its checksum (what --resume checks first).
    folder = out / "checkpoints" / f"step{done}"
    verify_files(folder, read_manifest(folder))
    if (launcher, sig) == ("python", "SIGTERM"):  # one resume suffices: every signal takes the same save path
        train("--deepspeed", str(config), "--steps", str(done + 1), "--resume", "--output-dir", str(out))
        assert [r["step"] for r in metrics(out)] == list(range(1, done + 2))


OOM_AT_STEP_2 = """
def faulty(self, real):
    if self.cursor.next_micro == 2:  # before step 2 (2 micro-batches a step)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    return real(self)
"""


def test_a_step_out_of_gpu_memory_ends_in_one_line_with_the_fixes(tmp_path):
    run, out, config = _run_with_fault(tmp_path, OOM_AT_STEP_2, steps=3)
    assert run.returncode == 5, run.stdout[-2000:] + run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    offload = "offload_optimizer" in json.loads(config.read_text())["zero_optimization"]
    assert errors == [
        f"error: out of GPU memory in a step of {SEQLEN} tokens a sequence: "
        + 'offload the optimizer state ("zero_optimization": {"offload_optimizer": {"device": "cpu"}} (as in '
          'ds_configs/zero2_offload.json)); or ' * (not offload)
        + 'turn the fused kernels on ("fused_kernels": {"enabled": true}); or keep the activation checkpoints in CPU '
        'memory ("activation_checkpointing": {"cpu_checkpointing": true}); or run the MLP in tiles ("tiled_mlp": '
        '{"tokens_per_tile": 32768}); or shorten --seqlen, or spread each sequence over more GPUs ("parallel": '
        '{"sequence_parallel_size"})'
    ], run.stderr[-2000:]  # fmt: skip
    assert "Traceback" not in run.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step1"
