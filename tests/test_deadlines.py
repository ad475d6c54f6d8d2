"""Deadlines of the attention path's waits (``mtraining.parallel.timeout_s``): a stalled peer ends in one line.

On real gloo processes: rank 1 stops taking part (it sleeps) while rank 0 runs a ring exchange, the ring attention,
the distributed estimator and the Ulysses all-to-all on groups with a 3 s deadline; each raises
``CommTimeoutError`` naming the operation and the peer within seconds. End to end: a 2-process ring training run
of ``launch/train.py`` whose rank 1 gets SIGSTOP after the first step exits non-zero with that line soon after
the deadline, leaving no process behind. Every test has its own outer deadline: it fails rather than hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from distributed import run_distributed
from train_job import launched_job

from ds_mtraining.config import MTrainingConfig
from ds_mtraining.parallel import comm
from ds_mtraining.parallel.comm import CommTimeoutError, RingComm, deadline, is_timeout
from ds_mtraining.parallel.estimate import estimate_index_distributed
from ds_mtraining.parallel.mesh import Mesh, MeshShape
from ds_mtraining.parallel.ring import sparse_ring_attention
from ds_mtraining.parallel.ulysses import scatter_heads

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 3.0
JOB_TIMEOUT = 10
N = 256
SPARSE = {
    "estimator": {"strategy": "spread", "rows": 32, "exclusion": 64, "max_columns": 16, "max_offsets": 3},
    "sink_tokens": 8,
}


def _expect_timeout(call, *needles: str) -> str:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        call()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 0.8 * TIMEOUT <= elapsed < TIMEOUT + 7, f"{elapsed:.1f} s: {message}"
    assert "\n" not in message and f"within {TIMEOUT:g} s (mtraining.parallel.timeout_s)" in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    print(f"rank 0 after {elapsed:.1f} s: {message}", flush=True)
    return message


def _stalled_peer(rank: int, world: int, done: str) -> None:
    torch.manual_seed(0)
    ring = MeshShape.build(world=world, ulysses=1, ring=2, q_heads=4, kv_heads=2)
    ulysses = MeshShape.build(world=world, ulysses=2, ring=1, q_heads=4, kv_heads=2)
    # Every group is created by both ranks (a collective), one mesh per case: a timed-out gloo pair stays closed.
    meshes = [Mesh(ring, timeout_s=TIMEOUT) for _ in range(3)] + [Mesh(ulysses, timeout_s=TIMEOUT)]
    assert all(m.timeout_s == TIMEOUT for m in meshes)
    if rank == 1:  # the stalled peer: alive, its sockets open, but it never joins the groups' operations
        deadline_at = time.monotonic() + 90
        while not os.path.exists(done) and time.monotonic() < deadline_at:
            time.sleep(0.1)
        return
    try:
        layout = ring.layout(N, kind="striped", block_size=64, stripe=None)
        q, k, v = (torch.randn(1, layout.local_len, h, 16, dtype=torch.float64) for h in (4, 2, 2))

        hop = RingComm(meshes[0].ring.inner, name="KV")
        hop.send_recv(k, step=0)
        _expect_timeout(hop.wait, "rank 0: ring send of KV to rank 1 at ring step 0 did not complete")

        with comm.context(step=3):
            _expect_timeout(
                lambda: sparse_ring_attention(q, k, v, None, groups=meshes[1].ring, layout=layout, layer=2),
                "rank 0 step 3 layer 2: ring send of KV to rank 1 at ring step 0 (forward)",
            )
        config = MTrainingConfig.model_validate({"sparse_attention": SPARSE}).sparse_attention
        _expect_timeout(
            lambda: estimate_index_distributed(q, k, config, groups=meshes[2].ring, layout=layout, layer=1),
            "rank 0 layer 1: all-reduce in the index estimator with rank 1",
        )
        chunk = torch.randn(1, 32, 4, 16)
        _expect_timeout(
            lambda: scatter_heads(chunk, chunk[:, :, :2], chunk[:, :, :2], group=meshes[3].ulysses, layer=0),
            "rank 0 layer 0: Ulysses all-to-all (scatter q heads, forward) with rank 1",
        )
    finally:
        Path(done).touch()


def test_a_stalled_peer_raises_comm_timeout_naming_the_operation(tmp_path):
    run_distributed(2, _stalled_peer, str(tmp_path / "done"), timeout=150)


def test_only_backend_timeouts_are_translated():
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    assert is_timeout(RuntimeError(gloo)) and is_timeout(RuntimeError("Application timeout caused pair closure"))
    assert not is_timeout(RuntimeError("Connection closed by peer")) and not is_timeout(ValueError(gloo))
    with pytest.raises(RuntimeError, match="^boom$"), deadline("ring recv from rank 0"):
        raise RuntimeError("boom")
    with pytest.raises(CommTimeoutError) as info, comm.context(step=7, layer=1), deadline("ring recv from rank 0"):
        raise RuntimeError(gloo)
    assert str(info.value) == (
        "step 7 layer 1: ring recv from rank 0 did not complete within 3 s (mtraining.parallel.timeout_s); "
        "a rank is stalled or dead"
    )


def test_timeout_setting():
    assert MTrainingConfig().parallel.timeout_s == comm.DEFAULT_TIMEOUT_S == 600
    assert MTrainingConfig.model_validate({"parallel": {"timeout_s": 2.5}}).parallel.timeout_s == 2.5
    for bad in (0, -1, "inf"):
        with pytest.raises(ValueError):
            MTrainingConfig.model_validate({"parallel": {"timeout_s": bad}})


def _job_processes(launcher: psutil.Process) -> list[psutil.Process]:
    try:
        return launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_sigstopped_rank_ends_the_training_job(tmp_path):
    """Ring of 2 ranks, ``timeout_s`` 10: SIGSTOP rank 1 after step 1; rank 0 reports the wait and exits 3, the
    launcher ends the stopped rank (SIGTERM, then SIGKILL after its 30 s grace). The deadline is 10 s rather than
    5: on a loaded 2-core machine the ranks' first steps can drift apart by more than 5 s."""
    config = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    sparse = config["mtraining"]["sparse_attention"]
    sparse |= SPARSE | {"estimator": sparse["estimator"] | SPARSE["estimator"] | {"recall": 0.9}}
    config["mtraining"]["parallel"] |= {"sequence_parallel_size": 2, "ring_degree": 2, "timeout_s": JOB_TIMEOUT}
    config["scheduler"]["params"] |= {"warmup_num_steps": 2, "total_num_steps": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    command, env = launched_job(
        tmp_path, 2, "--deepspeed", str(tmp_path / "config.json"), "--seqlen", "512", "--steps", "100", "--no-save",
        "--output-dir", str(out),
    )  # fmt: skip
    log = (tmp_path / "log").open("w+")
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    launcher, seen, stopped = psutil.Process(job.pid), {}, None
    try:
        start = time.monotonic()
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert job.poll() is None, (
                f"the job ended before its first step (a drift > {JOB_TIMEOUT} s?):\n{Path(log.name).read_text()[-4000:]}"
            )
            assert time.monotonic() - start < 300, "no first step within 300 s"
            seen |= {p.pid: p for p in _job_processes(launcher)}
            time.sleep(0.05)
        ranks = [p for p in _job_processes(launcher) if "--local_rank=1" in " ".join(p.cmdline())]
        assert len(ranks) == 1, [p.cmdline() for p in _job_processes(launcher)]
        stopped = ranks[0]
        seen |= {p.pid: p for p in _job_processes(launcher)}
        os.kill(stopped.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            code = job.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs 90 s after SIGSTOP:\n{Path(log.name).read_text()[-4000:]}")
        elapsed = time.monotonic() - stopped_at
        text = Path(log.name).read_text()
        lines = [
            line
            for line in text.splitlines()
            if f"did not complete within {JOB_TIMEOUT} s (mtraining.parallel.timeout_s)" in line
        ]
        print(f"job exited {code} {elapsed:.1f} s after SIGSTOP; {lines}")
        assert code != 0, text[-4000:]
        assert elapsed < 60, f"{elapsed:.1f} s\n{text[-4000:]}"
        assert len(lines) == 1 and lines[0].startswith("error: rank 0 "), text[-4000:]
        assert "rank 1" in lines[0] and "a rank is stalled or dead" in lines[0], lines[0]
        left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [(p.pid, p.cmdline()) for p in left]
    finally:
        for p in [*seen.values(), *([stopped] if stopped else [])]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
        log.close()


@pytest.mark.parametrize(
    "raised,expected",
    [
        pytest.param(
            CommTimeoutError("ring recv from rank 0", timeout_s=5, rank=1, layer=2),
            "error: rank 1 layer 2: ring recv from rank 0 did not complete within 5 s",
            id="attention",
        ),
        pytest.param(
            RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"),
            "error: a collective of the world group (gradient reduction or metrics) did not complete within 5 s",
            id="world-group",
        ),
    ],
)
def test_main_reports_a_timeout_in_one_line_and_exits_3(monkeypatch, capsys, raised, expected):
    from ds_mtraining.training import cli, trainer

    class Exited(BaseException):
        pass

    class Trainer(contextlib.nullcontext):  # raises what a stalled peer makes a real one raise
        error = raised

        def __init__(self, p, stop, banner):
            super().__init__(self)
            assert comm.group_timeout().total_seconds() == 5  # main set the deadline before anything ran

        def fit(self):
            raise self.error

    def exit_now(code):
        raise Exited(code)

    plan = type("P", (), {"mtraining": MTrainingConfig.model_validate({"parallel": {"timeout_s": 5}})})()
    monkeypatch.setattr(cli, "plan", lambda settings: plan)
    monkeypatch.setattr(cli, "describe", lambda p: "")
    stub = {"watch_launcher": lambda self: self, "install": lambda self: None}
    monkeypatch.setattr(cli, "StopRequest", lambda: type("S", (), stub)())
    monkeypatch.setattr(trainer, "Trainer", Trainer)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    try:
        with pytest.raises(Exited) as info:
            cli.main([])
        assert info.value.args == (3,)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected), lines
        Trainer.error = RuntimeError("boom")
        with pytest.raises(RuntimeError, match="^boom$"):  # any other error is not a timeout
            cli.main([])
    finally:
        comm.set_timeout(comm.DEFAULT_TIMEOUT_S)


def _rank_of_two(tmp_path: Path, rank: int, addr: str, port: int, rendezvous_s: float) -> subprocess.CompletedProcess:
    """``launch/train.py`` as rank ``rank`` of a two-process world whose master is ``addr:port`` (the environment a
    launcher gives it), with ``rendezvous_timeout_s``."""
    config = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    config["mtraining"]["parallel"] = {"rendezvous_timeout_s": rendezvous_s}
    path = tmp_path / f"ds-{rank}.json"
    path.write_text(json.dumps(config))
    env = os.environ | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": addr,
                        "MASTER_PORT": str(port)}  # fmt: skip
    command = [sys.executable, str(REPO / "launch" / "train.py"), "--deepspeed", str(path), "--seqlen", "512",
               "--steps", "1", "--output-dir", str(tmp_path / f"run-{rank}")]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unresolvable_master_ends_every_rank_at_once(tmp_path, rank):
    """``deepspeed --master_addr nosuchhost`` waited past 180 s printing c10d warnings (default deadline 600 s)."""
    start = time.monotonic()
    done = _rank_of_two(tmp_path, rank, "nosuchhost-xyz.invalid", 29517, rendezvous_s=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: MASTER_ADDR 'nosuchhost-xyz.invalid' does not resolve") and "--master_addr" in lines[0]
    assert time.monotonic() - start < 60


def test_a_silent_master_ends_a_rank_after_the_rendezvous_deadline(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    done = _rank_of_two(tmp_path, 1, "127.0.0.1", port, rendezvous_s=3)
    elapsed = time.monotonic() - start
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"error: rank 1 reached no rendezvous at 127.0.0.1:{port}") and "in 3 s" in lines[0]
    assert "rendezvous_timeout_s" in lines[0] and 3 <= elapsed < 60


def test_the_job_runs_under_torchrun(tmp_path):
    """torchrun's agent serves the store on MASTER_PORT itself: the start-up port check took it for another job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(port), str(REPO / "launch" / "train.py"),
               "--deepspeed", str(REPO / "ds_configs" / "zero2_offload.json"), "--seqlen", "512", "--steps", "1",
               "--output-dir", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "port" not in done.stderr.lower() or "in use" not in done.stderr
    assert (tmp_path / "run" / "checkpoints" / "step1" / "manifest.json").is_file()


NOT_HERE = "198.51.100.1"
"""An address of no machine here (TEST-NET-2, RFC 5737): a master there refuses, is unreachable, or never answers."""


def test_a_master_address_that_is_not_rank_0s_machine_ends_rank_0(tmp_path):
    """Rank 0 serves the store but its own client connects through MASTER_ADDR: ``deepspeed --master_addr
    192.0.2.1`` hung rank 0 for its 10-minute deadline and printed a traceback (the check returned early on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    done = _rank_of_two(tmp_path, 0, NOT_HERE, port, rendezvous_s=3)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: rank 0 serves the rendezvous on this machine") and f"{NOT_HERE}:{port}" in lines[0]
    assert "in 3 s" in lines[0] and "--master_addr" in lines[0] and time.monotonic() - start < 60


def _launched_with_silent_master(tmp_path: Path, rendezvous_s: float) -> tuple[subprocess.Popen, int]:
    """``deepspeed --hostfile H --master_addr <no machine>`` with two local ranks, in its own session, output in
    ``tmp_path/job.log``; returns the runner and the master port."""
    config = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    config["mtraining"]["parallel"] = {"rendezvous_timeout_s": rendezvous_s}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    command, env = launched_job(tmp_path, 2, "--deepspeed", str(path), "--seqlen", "1024", "--steps", "1",
                                "--output-dir", str(tmp_path / "run"))  # fmt: skip
    command[command.index("--master_addr") + 1] = NOT_HERE
    port = int(command[command.index("--master_port") + 1])
    log = (tmp_path / "job.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), port


def _session_alive(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of session ``pgid``: the job's runner, launcher and ranks."""
    alive = []
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if os.getsid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def test_a_silent_master_ends_a_launched_job_with_a_line_on_every_rank(tmp_path):
    """The issue's command: every rank, the serving one included, says it in one line and the job exits 3 in
    seconds, leaving no process."""
    start = time.monotonic()
    runner, port = _launched_with_silent_master(tmp_path, rendezvous_s=5)
    try:
        status = runner.wait(timeout=90)
    finally:
        alive = _session_alive(runner.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
    log = (tmp_path / "job.log").read_text()
    errors = sorted(line for line in log.splitlines() if line.startswith("error:"))
    assert status == 3 and len(errors) == 2, log[-3000:]
    assert errors[0].startswith("error: rank 0 serves the rendezvous") and f"{NOT_HERE}:{port}" in errors[0], errors
    assert errors[1].startswith(f"error: rank 1 reached no rendezvous at {NOT_HERE}:{port}"), errors
    assert "Traceback" not in log and not alive and time.monotonic() - start < 60, (alive, log[-3000:])


def test_sigterm_to_the_deepspeed_command_during_start_up_leaves_no_process(tmp_path):
    """The ``deepspeed`` command forwards no signal on one node: SIGTERM to it left the launcher and the ranks
    waiting on the master, re-parented to PID 1."""
    runner, port = _launched_with_silent_master(tmp_path, rendezvous_s=120)
    try:
        end = time.monotonic() + 120
        while not any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                      for p in _session_alive(runner.pid) for c in _connections(p)):  # fmt: skip
            assert runner.poll() is None and time.monotonic() < end, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.2)  # until rank 0 serves the rendezvous: past its imports and its plan
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=10)
        end = time.monotonic() + 20
        while (alive := _session_alive(runner.pid)) and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
    log = (tmp_path / "job.log").read_text()
    assert not alive, (alive, log[-3000:])
    assert "the deepspeed command" in log and "is gone" in log and "Traceback" not in log, log[-3000:]


def _connections(process: psutil.Process) -> list:
    with contextlib.suppress(psutil.Error):
        return process.net_connections(kind="tcp")
    return []


def test_a_lost_race_for_the_port_is_the_port_line(monkeypatch):
    """Two jobs started at once: both port checks passed, and the loser's store failed to bind with a traceback."""
    from ds_mtraining.training import distributed
    from ds_mtraining.training.settings import UsageError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check = distributed.check_rendezvous
    with socket.socket() as winner:

        def checked_then_taken(*args, **kwargs):  # the other job binds between this job's check and its store
            check(*args, **kwargs)
            winner.bind(("", port))
            winner.listen()

        monkeypatch.setattr(distributed, "check_rendezvous", checked_then_taken)
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
            monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=f"^port {port} .*--master_port {port + 1}"):
            distributed.init_distributed(timeout_s=5, rendezvous_timeout_s=5)


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "::1"])
def test_rank_0_reaches_itself_through_a_local_master_address(addr):
    """The serving rank's check passes for every way of naming this machine, IPv6 included (its listener takes the
    address's family, as torch's store does)."""
    from ds_mtraining.training.distributed import check_rendezvous

    if addr == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    check_rendezvous(addr, port, serving=True, deadline_s=5)
    assert time.monotonic() - start < 3
