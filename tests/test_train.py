"""launch/train.py end to end on one CPU process (DeepSpeed ZeRO-2, CPU optimizer offload, accumulation, gloo).

One module-scoped set of short runs at 512 tokens: an uninterrupted run, a run that stops at a checkpoint and
a ``--resume`` run (with the debris of an interrupted save in the directory; those two with their activation
checkpoints in CPU memory), and a run with a lower recall target. Each run starts a fresh ``python launch/train.py``
as users do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_job import launched_job, save_model_with_tokenizer, save_packed_rows
from transformers import Qwen2Config

REPO = Path(__file__).resolve().parents[1]
SEQLEN = "512"


def write_config(path: Path, *, recall: float = 0.9, **overrides) -> Path:
    config = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    config["gradient_accumulation_steps"] = 2
    config["optimizer"]["params"]["lr"] = 2e-3
    config["scheduler"]["params"] |= {"warmup_max_lr": 2e-3, "warmup_num_steps": 2, "total_num_steps": 50}
    sparse = config["mtraining"]["sparse_attention"]
    assert sparse["estimator"]["strategy"] == "spread"
    sparse["estimator"] |= {
        "recall": recall,
        "rows": 32,
        "max_columns": 512,  # columns only: the recall target alone decides the density
        "max_offsets": 0,
    }
    sparse["sink_tokens"] = 4
    for key, value in overrides.items():
        config["mtraining"][key] |= value
    path.write_text(json.dumps(config))
    return path


def train(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--seqlen", SEQLEN, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    config = write_config(tmp / "config.json")
    # The interrupted run and its resume keep their activation checkpoints in CPU memory: the same losses.
    offloaded = tmp / "offloaded.json"
    offload = {"activation_checkpointing": {"cpu_checkpointing": True}}
    offloaded.write_text(json.dumps(json.loads(config.read_text()) | offload))
    full, cut = tmp / "full", tmp / "cut"
    first = train("--deepspeed", str(config), "--steps", "4", "--save-interval", "3", "--output-dir", str(full))
    train("--deepspeed", str(offloaded), "--steps", "2", "--save-interval", "2", "--output-dir", str(cut))
    # An interrupted save of step 4 left a partial tag behind; `latest` still names step 2.
    (cut / "checkpoints" / "step4.partial").mkdir()
    (cut / "checkpoints" / "step4.partial" / "junk").write_text("half-written")
    latest_before = (cut / "checkpoints" / "latest").read_text()
    resumed = train(
        "--deepspeed", str(offloaded), "--steps", "4", "--save-interval", "2", "--resume", "--output-dir", str(cut)
    )
    low = tmp / "low"
    low_config = write_config(tmp / "low.json", recall=0.3)
    train("--deepspeed", str(low_config), "--steps", "1", "--no-save", "--output-dir", str(low))
    return dict(full=full, cut=cut, low=low, first=first, resumed=resumed, latest_before=latest_before)


def test_loss_goes_down_and_outputs(runs):
    records = metrics(runs["full"])
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["loss"] < records[0]["loss"] - 0.05, [r["loss"] for r in records]
    assert (runs["full"] / "loss.png").stat().st_size > 1000
    checkpoints = runs["full"] / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step4" and (checkpoints / "step3").is_dir()  # interval and end
    assert not (runs["low"] / "checkpoints").exists()  # --no-save
    out = runs["first"].stdout
    assert "training summary" in out and "layers 1-3    vertical_slash" in out and "bf16 off" in out
    assert all(0 < d <= 1 for d in records[0]["density"]) and records[0]["density"][0] == 1.0  # layer 0 dense


def test_learning_rate_is_the_one_each_step_used(runs):
    """Linear warm-up over 2 steps from the base config's floor (not 0): DeepSpeed's scheduler starts at the floor
    when it is built and steps once after every optimizer step, so steps 1 and 2 both run at the floor."""
    params = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())["scheduler"]["params"]
    low, high = params["warmup_min_lr"], 2e-3
    assert low > 0
    expected = [low, low, low + (high - low) / 2, high]
    assert [r["lr"] for r in metrics(runs["full"])] == pytest.approx(expected, rel=1e-12)


def test_resume_reproduces_the_uninterrupted_run(runs):
    """The interrupted run and its resume (checkpoints in CPU memory, ``cpu_checkpointing``) give the losses of the
    uninterrupted one (checkpoints in GPU memory), exactly."""
    assert "checkpoints in CPU memory (cpu_checkpointing)" in runs["resumed"].stdout
    assert "checkpoints in GPU memory" in runs["first"].stdout
    full, cut = metrics(runs["full"]), metrics(runs["cut"])
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    assert [r["loss"] for r in cut] == [r["loss"] for r in full]  # exactly, not approximately
    assert [r.get("resumed", False) for r in cut] == [False, False, True, False]  # loss.png marks it
    assert "resumed" in runs["resumed"].stdout and runs["latest_before"] == "step2"
    checkpoints = runs["cut"] / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step4"
    assert not (checkpoints / "step4.partial").exists() and (checkpoints / "step2").is_dir()


def test_lower_recall_target_gives_lower_density(runs):
    high = metrics(runs["full"])[0]["density"][1:]
    low = metrics(runs["low"])[0]["density"][1:]
    assert sum(low) < sum(high), (low, high)


def test_hostfile_launch_matches_single_process(runs, tmp_path):
    """Launched like a multi-node job (``deepspeed --hostfile``, localhost with 4 slots): DP 2 x ring 2 with
    ZeRO-2 gradients reduced over DP x SP must reproduce the single-process run that accumulates the same two
    samples per step (run ``-k hostfile`` alone: it starts 4 processes)."""
    config = write_config(tmp_path / "config.json", parallel={"sequence_parallel_size": 2, "ring_degree": 2})
    data = json.loads(config.read_text())
    data["gradient_accumulation_steps"] = 1
    config.write_text(json.dumps(data))
    out = tmp_path / "out"
    command, env = launched_job(
        tmp_path, 4, "--deepspeed", str(config), "--seqlen", SEQLEN, "--steps", "4", "--output-dir", str(out)
    )
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "world 4 = DP 2 x SP 2 (Ulysses 1 x ring 2, flat ring)" in result.stdout
    # None of the four ranks prints the libraries' known notices about themselves (ds_mtraining.notices); the
    # accelerator line left comes from the launcher's two processes, which run before the job.
    text = result.stdout + result.stderr
    assert "all_gather_into_tensor" not in text and "Attempting to get learning rate" not in text
    assert "built successfully" not in text  # DeepSpeed's print on every start, the op cached or not
    assert text.count("Setting accelerator to CPU") == 2, text[-4000:]
    launched, single = metrics(out), metrics(runs["full"])
    for a, b in zip(launched, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5), (a["step"], a["loss"], b["loss"])


def test_heldout_loss_is_the_loss_of_its_rows_over_data_and_sequence_ranks(tmp_path):
    """With the learning rate 0 the weights never change, so the held-out loss of the one row a run trains on
    equals each step's training loss: the held-out mean is taken over the right rows, ranks and weights (a wrong
    factor, a row left out or stale weights would show). Four processes, data parallelism 2 x a ring of 2 (each DP
    rank evaluates every row, the all-reduce adding DP copies; the ring's ranks' parts add up to the row's mean),
    three steps with the held-out loss logged at every second step and after the last. The model is a
    random 2-layer Qwen2 with a tokenizer of its own: the held-out mean does not depend on the model, and a
    pretrained one takes a minute a job to start."""
    model_config = Qwen2Config(
        vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, use_cache=False,
    )  # fmt: skip
    model = save_model_with_tokenizer(tmp_path / "model", model_config)
    data = save_packed_rows(tmp_path / "rows", rows=1, vocab=model_config.vocab_size)
    config = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    config["optimizer"]["params"] |= {"lr": 0.0, "weight_decay": 0.0}
    del config["scheduler"]
    config["mtraining"]["parallel"] |= {"sequence_parallel_size": 2, "ring_degree": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    command, env = launched_job(
        tmp_path, 4, "--model", str(model), "--deepspeed", str(tmp_path / "config.json"), "--seqlen", "512",
        "--data", str(data), "--heldout", str(data), "--heldout-rows", "1", "--steps", "3", "--heldout-every", "2",
        "--no-save", "--output-dir", str(out),
    )  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "world 4 = DP 2 x SP 2" in done.stdout
    records = metrics(out)
    assert [r["step"] for r in records if "heldout_loss" in r] == [2, 3]
    for record in records:
        if "heldout_loss" in record:
            assert abs(record["heldout_loss"] - record["loss"]) <= 1e-5 * record["loss"], record
    assert len({r["loss"] for r in records}) == 1  # lr 0: the weights did not move
