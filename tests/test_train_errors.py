"""launch/train.py: bad inputs end with one ``error:`` line (status 2) before anything is written or touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_job import launched_job, refusal, save_packed_rows

from ds_mtraining.training import describe, plan
from ds_mtraining.training.plan import plan_model
from ds_mtraining.training.cli import main, parse_args
from ds_mtraining.training.manifest import RunSettings, write_manifest

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "ds_configs" / "zero2_offload.json"


def _config(tmp_path: Path, **sections) -> Path:
    config = json.loads(BASE.read_text())
    for name, values in sections.items():
        config["mtraining"][name] = config["mtraining"][name] | values
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _fails(capsys, argv: list[str], *needles: str) -> str:
    return refusal(main(argv), capsys.readouterr(), *needles)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def smollm2() -> None:
    """The pretrained model converted before a test reads its one error line: the first conversion on a fresh
    machine reports its progress on stderr too."""
    from ds_mtraining.models.smollm2 import ensure_converted

    ensure_converted()


def test_pretrained_usage_errors(smollm2, tmp_path, capsys):
    out = ["--output-dir", str(tmp_path / "out")]
    _fails(capsys, ["--model", "smollm2-135m", *out, "--seqlen", "16384"], "--rope-kind yarn --rope-factor 2.0")
    _fails(capsys, ["--rope-kind", "yarn", *out], "tiny-qwen2 is built for its length",
           "--model smollm2-135m --seqlen 16384 --rope-kind yarn --rope-factor 2")  # fmt: skip
    # The fix it names works: that model, stretched to that length, passes the model's checks.
    spec = plan_model(parse_args(["--model", "smollm2-135m", "--seqlen", "16384", "--rope-kind", "yarn", "--rope-factor", "2"]))
    assert spec.config.max_position_embeddings == 16384
    _fails(capsys, ["--model", "smollm2-135m", "--data", str(tmp_path / "nope"), *out], "nope")


def test_heldout_usage_errors(smollm2, tmp_path, capsys):
    data, out = save_packed_rows(tmp_path / "rows", rows=1), ["--seqlen", "512", "--output-dir", str(tmp_path / "out")]
    _fails(
        capsys, ["--model", "smollm2-135m", "--heldout", str(data), "--heldout-rows", "2", *out],
        "holds 1 rows; pass --heldout-rows 1 or fewer",
    )  # fmt: skip
    _fails(capsys, ["--heldout", str(data), *out], "--heldout needs a --model with a tokenizer")
    _fails(capsys, ["--heldout-every", "-1", *out], "--heldout-every >= 0")
    assert not (tmp_path / "out").exists()


def test_unknown_config_key(tmp_path, capsys):
    path = _config(tmp_path, sparse_attention={"vertical_recal": 0.5})
    _fails(capsys, ["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")], "vertical_recal", "unknown key")
    assert not (tmp_path / "out").exists()


def test_invalid_json(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"mtraining": {,}}')
    _fails(capsys, ["--deepspeed", str(path)], "invalid JSON", "bad.json:1:")


def test_missing_config_file(tmp_path, capsys):
    _fails(capsys, ["--deepspeed", str(tmp_path / "nope.json")], "nope.json", "not found")


@pytest.mark.parametrize(
    "parallel,world,needles",
    [
        pytest.param(
            {"sequence_parallel_size": 2, "ring_degree": 2},
            "1",
            ["world size 1", "sequence_parallel_size=2"],
            id="world",
        ),
        pytest.param(
            {"sequence_parallel_size": 3, "ulysses_degree": 3},
            "3",
            ["ulysses_degree=3", "4 attention heads"],
            id="heads",
        ),
        pytest.param(
            {"sequence_parallel_size": 4, "ring_degree": 2}, "4", ["ulysses_degree=1 * ring_degree=2"], id="product"
        ),
    ],
)
def test_impossible_degrees(tmp_path, capsys, monkeypatch, parallel, world, needles):
    monkeypatch.setenv("WORLD_SIZE", world)
    path = _config(tmp_path, parallel=parallel)
    _fails(capsys, ["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")], *needles)


@pytest.mark.parametrize("seqlen", ["1", "-5"])
def test_bad_seqlen(tmp_path, capsys, seqlen):
    _fails(capsys, ["--seqlen", seqlen, "--output-dir", str(tmp_path / "out")], "--seqlen")


def test_resume_without_checkpoint(tmp_path, capsys):
    _fails(capsys, ["--resume", "--output-dir", str(tmp_path / "out")], "not found")


def _fake_checkpoint(out: Path, tag: str = "step2") -> Path:
    directory = out / "checkpoints"
    (directory / tag).mkdir(parents=True)
    (directory / "latest").write_text(tag)
    (directory / tag / "mp_rank_00_model_states.pt").write_bytes(b"model states")
    (directory / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optimizer states")
    write_manifest(directory / tag, tag=tag, step=int(tag.removeprefix("step")), run=RunSettings())
    return directory


def test_corrupt_checkpoint_is_reported_and_untouched(tmp_path, capsys):
    directory = _fake_checkpoint(tmp_path / "out")
    (directory / "step2" / "mp_rank_00_model_states.pt").write_bytes(b"model statez")  # same size, other bytes
    before = _snapshot(tmp_path / "out")
    _fails(capsys, ["--resume", "--output-dir", str(tmp_path / "out")], "corrupt", "mp_rank_00_model_states.pt")
    assert _snapshot(tmp_path / "out") == before and directory.exists()


def test_latest_naming_a_missing_tag(tmp_path, capsys):
    directory = _fake_checkpoint(tmp_path / "out")
    (directory / "latest").write_text("step9")
    _fails(capsys, ["--resume", "--output-dir", str(tmp_path / "out")], "step9", "does not exist")


def test_existing_checkpoints_need_resume(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "out")
    before = _snapshot(tmp_path / "out")
    _fails(capsys, ["--output-dir", str(tmp_path / "out")], "--resume")
    assert _snapshot(tmp_path / "out") == before


def test_startup_print_shows_effective_sparse_settings(tmp_path):
    estimator = json.loads(BASE.read_text())["mtraining"]["sparse_attention"]["estimator"] | {"recall": 0.5}
    path = _config(
        tmp_path, sparse_attention={"estimator": estimator, "overrides": [{"layers": [0, 3], "pattern": "dense"}]}
    )
    planned = plan(parse_args(["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")]))
    text = describe(planned)
    lines = text.splitlines()
    assert lines[4] == (
        "kernels   fused kernels: off: no GPU (Liger's Triton kernels need a GPU); dense attention: SDPA (cuDNN first)"
    ), text
    assert [line.split()[:2] for line in lines[5:]] == [["layer", "0"], ["layers", "1-2"], ["layer", "3"]], text
    assert "dense" in lines[5] and "dense" in lines[7] and "vertical_slash" in lines[6]
    assert "estimator=spread" in lines[6] and "recall=0.5" in lines[6]
    assert lines[6].endswith(planned.mtraining.sparse_attention.for_layer(1).describe()), text
    assert lines[5].endswith("dense causal attention") and lines[7].endswith("dense causal attention"), text


def test_startup_print_shows_each_layers_strategy(tmp_path):
    """A layer whose override names another strategy prints that strategy's settings."""
    path = _config(
        tmp_path,
        sparse_attention={
            "overrides": [
                {"layers": [0], "pattern": "dense"},
                {"layers": [2], "estimator": {"strategy": "baseline", "last_q": 32, "max_columns": 256}},
            ]
        },
    )
    planned = plan(parse_args(["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")]))
    text = describe(planned)
    lines = text.splitlines()
    assert [line.split()[:2] for line in lines[5:]] == [["layer", "0"], ["layer", "1"], ["layer", "2"], ["layer", "3"]]
    assert "estimator=spread" in lines[6] and "estimator=spread" in lines[8], text
    assert lines[7].endswith(
        "vertical_slash bs=64 sinks=4 local_blocks=1 estimator=baseline last_q=32 recall columns=0.9 diagonals=0.9 "
        "columns [0, 256] diagonals [0, 1024]"
    ), text
    assert 'bf16 off ("auto": CPU has no bf16)' in text and "WarmupDecayLR warm-up 2 of 8 steps" in text


def test_a_taken_master_port_is_one_line(tmp_path, capsys, monkeypatch):
    """Launched as rank 0 of a job whose MASTER_PORT another process holds (a second job on the machine)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        _fails(capsys, ["--output-dir", str(tmp_path / "out")], f"port {port}", f"--master_port {port + 1}")
    assert not (tmp_path / "out").exists()


def test_schedule_shorter_than_the_run(tmp_path, capsys):
    config = json.loads(BASE.read_text())
    config["scheduler"]["params"]["total_num_steps"] = 5
    path = tmp_path / "short.json"
    path.write_text(json.dumps(config))
    _fails(capsys, ["--deepspeed", str(path), "--steps", "8"], "total_num_steps=5 < --steps 8", '"auto"')


@pytest.mark.parametrize("device,shown", [("cpu", True), ("none", False)])
def test_the_banner_names_offload_only_where_the_state_leaves_the_gpu(tmp_path, device, shown):
    """``"offload_optimizer": {"device": "none"}`` is DeepSpeed's spelling of no offload: the engine line says so."""
    config = json.loads(BASE.read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": device}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    text = describe(plan(parse_args(["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")])))
    engine = next(line for line in text.splitlines() if line.startswith("engine"))
    assert ("CPU optimizer offload" in engine) == shown, engine


def test_a_rank_other_than_0_says_its_input_error_when_rank_0_does_not(tmp_path, capsys, monkeypatch):
    """Only rank 0 printed input errors: when another rank's exit made the launcher end rank 0 first, the job ended
    in status 2 with no line at all. Now the others wait for rank 0 to end the job, then say it themselves."""
    from ds_mtraining.training import cli

    monkeypatch.setattr(cli, "INPUT_ERROR_WAIT_S", 0.1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    path = _config(tmp_path, parallel={"sequence_parallel_size": 3, "ulysses_degree": 3})
    err = _fails(capsys, ["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")], "ulysses_degree=3")
    assert err.startswith("error: rank 1: ")


def test_a_launched_job_says_its_input_error_once(tmp_path):
    """``ulysses_degree`` 3 on a 4-head model, three processes under the ``deepspeed`` launcher: rank 0's line,
    whichever rank reaches the check first (it ended with no line in 1 of 3 runs)."""
    import subprocess

    path = _config(tmp_path, parallel={"sequence_parallel_size": 3, "ulysses_degree": 3})
    command, env = launched_job(tmp_path, 3, "--deepspeed", str(path), "--output-dir", str(tmp_path / "out"))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("error: ulysses_degree=3 does not divide the model's 4 attention heads"), errors
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
