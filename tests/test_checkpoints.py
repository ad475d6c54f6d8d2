"""Verified checkpoints: every tag's ``manifest.json`` (files, sizes, SHA-256, the run's settings) is checked before
DeepSpeed reads anything, and ``metrics.jsonl`` survives the state a crash leaves.

One real training run (2 steps at 512 tokens, a tag per step) is copied for each case; the case damages the copy
the way a disk, a person or a crash would, and ``--resume`` must refuse it in one ``error:`` line naming the file
and the fix, leaving every byte as it was. Refusals run ``main`` in this process (they end before any process
group exists); the resumes that must succeed start ``python launch/train.py`` as users do.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_train import metrics, train, write_config
from train_job import refusal

from ds_mtraining.config import BaselineEstimator, LayerOverride, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.training import manifest
from ds_mtraining.training.checkpoints import CheckpointError
from ds_mtraining.training.cli import main
from ds_mtraining.training.metrics_log import Metrics

REPO = Path(__file__).resolve().parents[1]
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    config = write_config(tmp / "config.json")
    out = tmp / "out"
    train("--deepspeed", str(config), "--steps", "2", "--save-interval", "1", "--output-dir", str(out))
    return {"config": config, "out": out}


@pytest.fixture
def run(base, tmp_path):
    """A fresh copy of the base run's output folder, and the arguments that resume it."""
    out = tmp_path / "out"
    shutil.copytree(base["out"], out)
    argv = ["--deepspeed", str(base["config"]), "--seqlen", "512", "--steps", "3", "--resume", "--output-dir", str(out)]
    return out, argv


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(capsys, out: Path, argv: list[str], *needles: str) -> str:
    """``main(argv)`` ends with one ``error:`` line holding every needle, and ``out`` is byte for byte unchanged."""
    before = _snapshot(out)
    err = refusal(main(argv), capsys.readouterr(), *needles)
    assert _snapshot(out) == before
    return err


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_its_checksum(base):
    folder = base["out"] / "checkpoints" / "step2"
    recorded = json.loads((folder / "manifest.json").read_text())
    assert recorded["step"] == 2 and recorded["tag"] == "step2"
    assert {MODEL, OPTIM} <= set(recorded["files"])
    for name, entry in recorded["files"].items():
        assert entry == {"size": (folder / name).stat().st_size, "sha256": manifest.sha256_file(folder / name)}
    settings = recorded["settings"]
    assert settings["seqlen"] == 512 and settings["gradient_accumulation"] == 2 and settings["world_size"] == 1
    assert settings["model.num_hidden_layers"] == 4 and settings["zero_stage"] == 2 and settings["block_size"] == 64
    estimator = recorded["notes"]["sparse_attention"]["estimator"]
    assert estimator["strategy"] == "spread" and estimator["max_columns"] == 512 and recorded["notes"]["lr"] == 2e-3
    assert not list((base["out"] / "checkpoints").glob("*.partial"))


@pytest.mark.parametrize("name", [MODEL, OPTIM])
def test_flipped_bytes_are_refused(run, capsys, name):
    out, argv = run
    _flip(out / "checkpoints" / "step2" / name)
    _refused(capsys, out, argv, f"step2/{name}", "SHA-256", "previous tag step1", "step1, step2")


def test_truncated_file_is_refused(run, capsys):
    out, argv = run
    path = out / "checkpoints" / "step2" / MODEL
    path.write_bytes(path.read_bytes()[:1000])
    _refused(capsys, out, argv, f"step2/{MODEL}", "has 1000 bytes", "truncated", "previous tag step1")


def test_missing_optimizer_partition_is_refused(run, capsys):
    out, argv = run
    (out / "checkpoints" / "step2" / OPTIM).unlink()
    _refused(capsys, out, argv, f"step2/{OPTIM}", "is missing", "previous tag step1")


def test_file_of_another_step_is_refused(run, capsys):
    out, argv = run
    checkpoints = out / "checkpoints"
    shutil.copy(checkpoints / "step1" / MODEL, checkpoints / "step2" / MODEL)  # same name, another save's bytes
    _refused(capsys, out, argv, f"step2/{MODEL}", "another save", "previous tag step1")


def test_extra_optimizer_partition_is_refused(run, capsys):
    out, argv = run
    checkpoints = out / "checkpoints"
    foreign = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # e.g. left by a save on two ranks
    shutil.copy(checkpoints / "step1" / OPTIM, checkpoints / "step2" / foreign)
    _refused(capsys, out, argv, f"step2/{foreign}", "not in manifest.json", "previous tag step1")


@pytest.mark.parametrize(
    "content,needle",
    [
        pytest.param(b"\x00\xff\x13\x80garbage", "bytes of binary data", id="binary"),
        pytest.param(b"../elsewhere/step2", "'../elsewhere/step2'", id="path"),
        pytest.param(b"", "holds nothing", id="empty"),
    ],
)
def test_garbage_latest_is_one_line(run, capsys, content, needle):
    out, argv = run
    (out / "checkpoints" / "latest").write_bytes(content)
    _refused(capsys, out, argv, "checkpoints/latest", needle, "not a checkpoint tag", "step1, step2")


def test_tag_without_manifest_is_refused(run, capsys):
    out, argv = run
    (out / "checkpoints" / "step2" / "manifest.json").unlink()
    _refused(capsys, out, argv, "no manifest.json", "older version", "previous tag step1", "without --resume")


def test_only_tag_without_manifest_says_train_anew(run, capsys):
    out, argv = run
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints / "step1")
    (checkpoints / "step2" / "manifest.json").unlink()
    _refused(capsys, out, argv, "no manifest.json", "no other checkpoint tag", "train without --resume")


@pytest.mark.parametrize(
    "change,needles",
    [
        pytest.param(["--seqlen", "1024"], ["seqlen 512 (this run: 1024)", "--seqlen 512"], id="seqlen"),
        pytest.param(["--seed", "7"], ["seed 0 (this run: 7)", "--seed 0"], id="seed"),
    ],
)
def test_changed_setting_is_refused(run, capsys, change, needles):
    out, argv = run
    _refused(capsys, out, [*argv, *change], "must match", *needles)


def test_changed_accumulation_is_refused(run, capsys, tmp_path):
    out, argv = run
    config = json.loads(Path(argv[1]).read_text())
    config["gradient_accumulation_steps"] = 1
    (tmp_path / "acc1.json").write_text(json.dumps(config))
    argv[1] = str(tmp_path / "acc1.json")
    _refused(
        capsys,
        out,
        argv,
        "gradient_accumulation 2 (this run: 1)",
        "gradient_accumulation_steps 2 in the DeepSpeed config",
    )


def test_changed_world_size_is_refused(run, capsys, monkeypatch):
    """Two processes (DP 2) resuming a one-process checkpoint: ZeRO partitions do not fit; refused at plan time."""
    out, argv = run
    monkeypatch.setenv("WORLD_SIZE", "2")
    _refused(capsys, out, argv, "world_size 1 (this run: 2)", "dp_degree 1 (this run: 2)", "ds_to_universal")


def test_changed_budget_resumes_with_a_note_and_cut_metrics_line_is_dropped(base, run, tmp_path):
    """A changed ``estimator.max_columns`` is a note, not a refusal; the half-written line a crash during step 3's record
    left in ``metrics.jsonl`` is dropped with a note and the records are the complete ones."""
    out, _ = run
    before = metrics(out)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 5.4')  # no newline: the write was cut off
    config = write_config(tmp_path / "wider.json")
    data = json.loads(config.read_text())
    data["mtraining"]["sparse_attention"]["estimator"]["max_columns"] = 1024
    config.write_text(json.dumps(data))
    result = train("--deepspeed", str(config), "--steps", "3", "--resume", "--output-dir", str(out))
    assert "note: resuming with estimator.max_columns 1024 (checkpoint: 512)" in result.stdout, result.stdout
    assert result.stdout.count("note: resuming with") == 1, result.stdout  # the other settings are unchanged
    assert "metrics.jsonl line 3 was cut off" in result.stdout and "dropped" in result.stdout, result.stdout
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[:2] == before
    assert (
        json.loads((out / "checkpoints" / "step3" / "manifest.json").read_text())["notes"]["sparse_attention"][
            "estimator"
        ]["max_columns"]
        == 1024
    )


def _run_settings(
    sparse: SparseAttentionConfig, block_size: int | None = None, document_masking: bool = False
) -> manifest.RunSettings:
    """What ``launch/train.py`` records for a run with these sparse settings (the rest fixed)."""
    model = SimpleNamespace(
        model_type="qwen2", num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=None, vocab_size=256, tie_word_embeddings=True,
    )  # fmt: skip
    dumped = sparse.model_dump(mode="json")
    if block_size is not None:
        dumped["block_size"] = block_size
    return manifest.run_settings(
        model_config=model, world_size=1, dp_degree=1, ulysses_degree=1, ring_degree=1, hierarchical_ring=False,
        zero_stage=2, seqlen=512, micro_batch=1, gradient_accumulation=2, seed=0, sparse_attention=dumped,
        ds_config={"optimizer": {"params": {"lr": 2e-3}}, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
        document_masking=document_masking,
    )  # fmt: skip


def _saved(tmp_path: Path, run: manifest.RunSettings) -> dict:
    """The manifest a tag saved with ``run`` holds, read back from disk as a resume reads it."""
    folder = tmp_path / "step1"
    folder.mkdir()
    (folder / MODEL).write_bytes(b"weights")
    manifest.write_manifest(folder, tag="step1", step=1, run=run)
    return manifest.read_manifest(folder)


SAVED = SparseAttentionConfig(
    estimator=SpreadEstimator(rows=32, recall=0.9, max_columns=512, max_offsets=0),
    overrides=[{"layers": [0], "pattern": "dense"}],
)


def test_unchanged_sparse_settings_give_no_note(tmp_path):
    assert manifest.compare_run(_saved(tmp_path, _run_settings(SAVED)), _run_settings(SAVED), "step1") == []


@pytest.mark.parametrize(
    "change, notes",
    [
        pytest.param({"recall": 0.98}, ["note: resuming with estimator.recall 0.98 (checkpoint: 0.9)"], id="recall"),
        pytest.param(
            {"max_columns": 1024, "rows": 64},
            [
                "note: resuming with estimator.rows 64 (checkpoint: 32)",
                "note: resuming with estimator.max_columns 1024 (checkpoint: 512)",
            ],
            id="two-keys",
        ),
    ],
)
def test_changed_estimator_key_is_a_note(tmp_path, change, notes):
    """Each changed key of the same strategy's estimator is one note by its dotted name; nothing is refused."""
    resumed = SAVED.model_copy(update={"estimator": SAVED.estimator.model_copy(update=change)})
    assert manifest.compare_run(_saved(tmp_path, _run_settings(SAVED)), _run_settings(resumed), "step1") == notes


def test_changed_strategy_is_one_note_of_the_whole_estimator(tmp_path):
    """Another strategy has other keys: one note with both estimators, not a note per key of either."""
    resumed = SAVED.model_copy(update={"estimator": BaselineEstimator(last_q=32)})
    notes = manifest.compare_run(_saved(tmp_path, _run_settings(SAVED)), _run_settings(resumed), "step1")
    new = json.dumps(BaselineEstimator(last_q=32).model_dump(mode="json"), separators=(",", ":"))
    old = json.dumps(SAVED.estimator.model_dump(mode="json"), separators=(",", ":"))
    assert notes == [f"note: resuming with estimator {new} (checkpoint: {old})"]


def test_changed_override_estimator_is_a_note(tmp_path):
    resumed = SAVED.model_copy(
        update={"overrides": (*SAVED.overrides, LayerOverride(layers=(2,), estimator={"recall": 0.99}))}
    )
    notes = manifest.compare_run(_saved(tmp_path, _run_settings(SAVED)), _run_settings(resumed), "step1")
    assert len(notes) == 1 and notes[0].startswith("note: resuming with overrides ["), notes
    assert '"estimator":{"recall":0.99}' in notes[0], notes


def test_changed_document_masking_is_a_note(tmp_path):
    """Masking packed documents changes positions, labels and attention from the resumed step on: a note. A tag saved
    before the key existed trained unmasked."""
    saved = _saved(tmp_path, _run_settings(SAVED))
    notes = manifest.compare_run(saved, _run_settings(SAVED, document_masking=True), "step1")
    assert notes == ["note: resuming with document_masking true (checkpoint: false)"]
    del saved["notes"]["document_masking"]
    assert manifest.compare_run(saved, _run_settings(SAVED), "step1") == []


def test_changed_block_size_is_still_refused(tmp_path):
    saved = _saved(tmp_path, _run_settings(SAVED))
    with pytest.raises(manifest.SettingsMismatch, match=r"block_size 64 \(this run: 128\)") as info:
        manifest.compare_run(saved, _run_settings(SAVED, block_size=128), "step1")
    assert "mtraining.sparse_attention.block_size 64" in str(info.value)


def test_manifest_of_the_flat_releases_resumes_with_notes(tmp_path):
    """A tag saved before the estimator was nested (its strategy a name beside flat budget keys) resumes; the
    estimator is one note, the flat keys are notes of their own."""
    saved = _saved(tmp_path, _run_settings(SAVED))
    flat = {k: v for k, v in saved["notes"]["sparse_attention"].items() if k != "estimator"}
    saved["notes"]["sparse_attention"] = flat | {"estimator": "spread", "spread_recall": 0.9, "vertical_max": 512}
    notes = manifest.compare_run(saved, _run_settings(SAVED), "step1")
    new = json.dumps(SAVED.estimator.model_dump(mode="json"), separators=(",", ":"))
    assert notes == [
        f"note: resuming with estimator {new} (checkpoint: spread)",
        "note: resuming with spread_recall None (checkpoint: 0.9)",
        "note: resuming with vertical_max None (checkpoint: 512)",
    ]


def test_unparsable_metrics_line_names_the_line(tmp_path):
    lines = ['{"step": 1, "loss": 5.0}', '{"step": 2, "loss": oops}', '{"step": 3, "loss": 4.0}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl line 2 is not a JSON record"):
        Metrics(tmp_path, resumed_step=2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_metrics_are_strict_json(tmp_path):
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    recorder = Metrics(tmp_path, resumed_step=0)
    recorder.add({"step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "density": [0.5, -math.inf]})
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line, parse_constant=no_constants)
    assert record == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "density": [0.5, None]}
