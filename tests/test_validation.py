"""Bad inputs to the entry points end with one ``error:`` line (status 2) at start-up, before anything is written.

launch/train.py: a packed ``--data`` folder (missing, truncated or garbage files, wrong dtype or shape, no rows, bad
``meta.json``, ids past the model's vocabulary), the DeepSpeed part of the config, ``--output-dir`` naming a file,
budgets out of range, overrides of layers the model does not have. launch/eval.py, launch/prepare_data.py and
launch/demo.py: usage errors alike. And a good packed folder still trains.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from train_job import refusal

from ds_mtraining.data.packing import pack_documents, save_packed
from ds_mtraining.training import plan
from ds_mtraining.training.cli import main, parse_args

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "ds_configs" / "zero2_offload.json"
SEQLEN = 256
VOCAB = 300  # the byte-level tokenizer's 257 ids fit; 400 does not


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_main", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A config-only tiny Qwen2 (4 layers, vocabulary 300, random init) with a byte-level tokenizer next to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    folder = tmp_path_factory.mktemp("tiny-bytes")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True, use_cache=False,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def _packed(directory: Path, rows: int = 4) -> Path:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(50, 300, size=rows * 3)]
    packed = pack_documents(docs, SEQLEN, 256)
    return save_packed(packed, directory, source="test")


def _config(tmp_path: Path, edit=None, **sparse) -> Path:
    config = json.loads(BASE.read_text())
    config["mtraining"]["sparse_attention"] |= sparse
    if edit is not None:
        edit(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _fails(capsys, argv: list[str], *needles: str) -> str:
    status = main(argv)
    captured = capsys.readouterr()
    assert "error" not in captured.out, captured.out
    return refusal(status, captured, *needles)


# ------------------------------------------------------------------------------------------------------------
# launch/train.py --data
# ------------------------------------------------------------------------------------------------------------


def _truncate(d: Path) -> None:
    data = (d / "tokens.npy").read_bytes()
    (d / "tokens.npy").write_bytes(data[: len(data) // 2])


def _set_meta(d: Path, **changes) -> None:
    meta = json.loads((d / "meta.json").read_text())
    meta |= changes
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    (d / "meta.json").write_text(json.dumps(meta))


BAD_DATA = {
    "tokens_missing": (lambda d: (d / "tokens.npy").unlink(), ["tokens.npy", "not found", "prepare_data.py"]),
    "tokens_truncated": (_truncate, ["tokens.npy", "not a readable .npy", "prepare_data.py"]),
    "tokens_garbage": (
        lambda d: (d / "tokens.npy").write_bytes(b"\x00garbage" * 100),
        ["tokens.npy", "not a .npy file"],
    ),
    "tokens_float": (
        lambda d: np.save(d / "tokens.npy", np.load(d / "tokens.npy").astype(np.float32)),
        ["tokens.npy", "float32", "int64"],
    ),
    "tokens_1d": (
        lambda d: np.save(d / "tokens.npy", np.load(d / "tokens.npy").reshape(-1)),
        ["tokens.npy", "1-D", "2-D [rows, seqlen]"],
    ),
    "zero_rows": (
        lambda d: np.save(d / "tokens.npy", np.zeros((0, SEQLEN), dtype=np.int64)),
        ["tokens.npy", "holds no tokens", "--seqlen"],
    ),
    "meta_missing": (lambda d: (d / "meta.json").unlink(), ["no meta.json", "prepare_data.py"]),
    "meta_not_json": (lambda d: (d / "meta.json").write_text("{rows: 4,"), ["meta.json", "not valid JSON"]),
    "meta_no_separator": (lambda d: _set_meta(d, separator=None), ["meta.json", '"separator"']),
    "meta_wrong_rows": (lambda d: _set_meta(d, rows=99), ["rows=99", "different runs"]),
    "documents_missing": (lambda d: (d / "documents.npy").unlink(), ["documents.npy", "not found"]),
    "out_of_vocabulary": (
        lambda d: np.save(d / "tokens.npy", np.full_like(np.load(d / "tokens.npy"), 400)),
        ["max id 400", "vocabulary of 300", "tiny-bytes", "tokenizer"],
    ),
    "negative_id": (
        lambda d: np.save(d / "tokens.npy", np.full_like(np.load(d / "tokens.npy"), -3)),
        ["min id -3", "vocabulary of 300"],
    ),
    "not_a_folder": (lambda d: None, ["does not exist", "prepare_data.py"]),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_folder(tmp_path, capsys, model_dir, case):
    edit, needles = BAD_DATA[case]
    data = tmp_path / "data"
    if case == "not_a_folder":
        data = tmp_path / "nope"
    else:
        _packed(data)
        edit(data)
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--data", str(data), "--seqlen", str(SEQLEN), "--output-dir", str(out)]
    _fails(capsys, argv, *needles)
    assert not out.exists()


def test_good_data_trains(tmp_path, model_dir):
    """The checks pass a folder launch/prepare_data.py's format describes, and one step trains on it."""
    data, out = _packed(tmp_path / "data"), tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--model", str(model_dir), "--data", str(data),
         "--seqlen", str(SEQLEN), "--steps", "1", "--no-save", "--output-dir", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "note: layer 0" not in result.stdout  # the shipped config keeps layer 0 dense
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and np.isfinite(records[0]["loss"])


# ------------------------------------------------------------------------------------------------------------
# launch/train.py: the DeepSpeed part of the config, --output-dir, the "mtraining" budgets and overrides
# ------------------------------------------------------------------------------------------------------------


def _top(**values):
    return lambda config: config.update(values)


def _section(name, **values):
    return lambda config: config[name].update(values)


BAD_DEEPSPEED = {
    "accumulation_zero": (_top(gradient_accumulation_steps=0), ["gradient_accumulation_steps", "integer >= 1", "0"]),
    "accumulation_negative": (_top(gradient_accumulation_steps=-2), ["gradient_accumulation_steps", "-2"]),
    "accumulation_float": (_top(gradient_accumulation_steps=1.5), ["gradient_accumulation_steps", "1.5"]),
    "micro_batch_word": (_top(train_micro_batch_size_per_gpu="one"), ["train_micro_batch_size_per_gpu", "'one'"]),
    "zero_stage_7": (_section("zero_optimization", stage=7), ["zero_optimization.stage", "0, 1, 2 or 3", "got 7"]),
    "zero_unknown_key": (_section("zero_optimization", stagee=2), ["zero_optimization.stagee", "unknown key"]),
    "offload_device": (
        lambda c: c["zero_optimization"]["offload_optimizer"].update(device="gpu"),
        ["zero_optimization.offload_optimizer.device", "'cpu'", "'gpu'"],
    ),
    "optimizer_unknown": (_section("optimizer", type="AdamWW"), ["optimizer.type", "'AdamWW'", "adamw", "SGD"]),
    "optimizer_max_grad_norm": (
        lambda c: c["optimizer"]["params"].update(max_grad_norm=1.0),
        ["max_grad_norm", "gradient_clipping"],
    ),
    "clipping_word": (_top(gradient_clipping="big"), ["gradient_clipping", "'big'", "finite number >= 0"]),
    "clipping_negative": (_top(gradient_clipping=-1.0), ["gradient_clipping", "-1.0"]),
    "scheduler_unknown": (_section("scheduler", type="Warmup"), ["scheduler.type", "'Warmup'", "WarmupDecayLR"]),
    "section_not_object": (_top(optimizer="AdamW"), ["optimizer: must be an object"]),
    # DeepSpeed ignores keys it does not know: misspelled, this section would train as ZeRO-0 without a word
    "misspelled_section": (
        lambda c: c.update(zero_optimisation=c.pop("zero_optimization")),
        ["zero_optimisation: not a key DeepSpeed knows", "did you mean 'zero_optimization'?"],
    ),
    "unknown_key": (_top(learning_rate_of_doom=1), ["learning_rate_of_doom: not a key DeepSpeed knows", "remove it"]),
}


@pytest.mark.parametrize("case", list(BAD_DEEPSPEED))
def test_bad_deepspeed_config(tmp_path, capsys, case):
    edit, needles = BAD_DEEPSPEED[case]
    path, out = _config(tmp_path, edit), tmp_path / "out"
    err = _fails(capsys, ["--deepspeed", str(path), "--output-dir", str(out)], *needles)
    assert f"DeepSpeed config {path}" in err
    assert not out.exists()


def test_auto_values_stay_legal(tmp_path):
    """``"auto"`` for bf16 and the scheduler's steps is resolved later: the shipped configs pass the checks."""
    from ds_mtraining.integration.ds_config import check_ds_config

    for name in ("zero2_offload.json", "zero2.json", "dense_baseline.json"):
        check_ds_config(json.loads((REPO / "ds_configs" / name).read_text()), name)


@pytest.mark.parametrize("where", ["itself", "parent"])
def test_output_dir_naming_a_file(tmp_path, capsys, where):
    (tmp_path / "taken").write_text("a file")
    out = tmp_path / "taken" if where == "itself" else tmp_path / "taken" / "run"
    before = (tmp_path / "taken").read_text()
    _fails(capsys, ["--output-dir", str(out)], "--output-dir", "is a file, not a folder")
    assert (tmp_path / "taken").read_text() == before


BAD_SECTION = {
    "max_columns_huge": (
        {"estimator": {"strategy": "spread", "max_columns": 10**30}},
        ["sparse_attention.estimator.max_columns", "at most 1048576 tokens"],
    ),
    "sink_tokens_huge": ({"sink_tokens": 2**21}, ["sparse_attention.sink_tokens", "at most 1048576"]),
    "local_blocks_huge": ({"local_blocks": 10**9}, ["sparse_attention.local_blocks", "at most 16384 blocks"]),
    "override_budget_huge": (
        {"overrides": [{"layers": [0], "pattern": "dense"}, {"layers": [2], "estimator": {"max_offsets": 10**30}}]},
        ["overrides[1] (layers [2]) merged with the base: estimator.max_offsets", "at most 1048576"],
    ),
    "override_missing_layer": (
        {"overrides": [{"layers": [0], "pattern": "dense"}, {"layers": [2, 99], "estimator": {"max_columns": 64}}]},
        ["overrides[1]", "layer 99", "tiny-qwen2 has 4 layers", "0..3"],
    ),
    "flat_key": (
        {"spread_recall": 0.9},
        ['mtraining.sparse_attention: "spread_recall" is now estimator spread.recall', '"estimator": {"strategy"'],
    ),
    "estimator_without_strategy": (
        {"estimator": {"recall": 0.9}},
        ['estimator needs its "strategy": one of baseline, spread'],
    ),
    "override_merge_min_gt_max": (
        {
            "estimator": {"strategy": "baseline", "max_columns": 512},
            "overrides": [{"layers": [0], "pattern": "dense"}, {"layers": [2], "estimator": {"min_columns": 1000}}],
        },
        ["overrides[1] (layers [2]) merged with the base", "min_columns=1000 > max_columns=512"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_SECTION))
def test_bad_mtraining_section(tmp_path, capsys, case):
    sparse, needles = BAD_SECTION[case]
    path, out = _config(tmp_path, **sparse), tmp_path / "out"
    _fails(capsys, ["--deepspeed", str(path), "--output-dir", str(out)], *needles)
    assert not out.exists()


def test_sparse_layer_0_is_noted(tmp_path, capsys):
    """A user overrides list replaces the shipped one: dropping its dense layer 0 is allowed, with a note."""
    path = _config(tmp_path, overrides=[{"layers": [3], "pattern": "dense"}])
    plan(parse_args(["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")]))
    out = capsys.readouterr().out
    assert "note: layer 0 attends sparsely" in out and '{"layers": [0], "pattern": "dense"}' in out
    plan(parse_args(["--output-dir", str(tmp_path / "out")]))  # shipped config: layer 0 dense, no note
    assert "note" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------------
# launch/eval.py, launch/prepare_data.py, launch/demo.py
# ------------------------------------------------------------------------------------------------------------


def _script_fails(capsys, monkeypatch, name: str, argv: list[str], *needles: str) -> str:
    module = _module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    return refusal(module.main(), capsys.readouterr(), *needles)


def _bad_section(tmp_path: Path) -> Path:
    return _config(tmp_path, vertical_recal=0.5)


SCRIPT_ERRORS = {
    "eval_unknown_model": ("eval", ["perplexity", "--model", "no-such-model"], ["unknown model", "smollm2-135m"]),
    "eval_folder_without_config": ("eval", ["perplexity", "--model", "{tmp}/empty"], ["has no config.json"]),
    "eval_missing_config": ("eval", ["niah", "--ds-config", "{tmp}/nope.json"], ["nope.json", "not found"]),
    "eval_bad_section": ("eval", ["ruler", "--ds-config", "{bad}"], ["vertical_recal", "unknown key"]),
    "eval_bad_length": ("eval", ["fidelity", "--length", "0"], ["--length", "at least 2"]),
    "eval_out_is_file": ("eval", ["perplexity", "--out", "{file}"], ["--out", "is a file"]),
    "prepare_unknown_model": (
        "prepare_data",
        ["--out", "{tmp}/data", "--model", "no-such-model"],
        ["unknown model", "no-such-model"],
    ),
    "prepare_missing_corpus": (
        "prepare_data",
        ["--out", "{tmp}/data", "--corpus", "{tmp}/nope.jsonl"],
        ["--corpus", "nope.jsonl", "does not exist"],
    ),
    "prepare_out_is_file": ("prepare_data", ["--out", "{file}"], ["--out", "is a file"]),
    "prepare_bad_heldout": ("prepare_data", ["--out", "{tmp}/data", "--heldout", "1.5"], ["--heldout", "[0, 1)"]),
    "prepare_unknown_source": (
        "prepare_data",
        ["--out", "{tmp}/data", "--sources", "wiki", "--model", "{model}"],
        ["unknown corpus source 'wiki'"],
    ),
    "demo_missing_config": ("demo", ["--deepspeed", "{tmp}/nope.json"], ["nope.json", "not found"]),
    "demo_bad_section": ("demo", ["--deepspeed", "{bad}"], ["vertical_recal", "unknown key"]),
    "demo_short": ("demo", ["--seqlen", "100"], ["--seqlen", "> 512"]),
}


@pytest.mark.parametrize("case", list(SCRIPT_ERRORS))
def test_script_usage_errors(tmp_path, capsys, monkeypatch, model_dir, case):
    name, argv, needles = SCRIPT_ERRORS[case]
    (tmp_path / "file").write_text("a file")
    (tmp_path / "empty").mkdir()
    values = {"tmp": str(tmp_path), "bad": str(_bad_section(tmp_path)), "file": str(tmp_path / "file"),
              "model": str(model_dir)}  # fmt: skip
    before = sorted(p.name for p in tmp_path.iterdir())
    _script_fails(capsys, monkeypatch, name, [a.format(**values) for a in argv], *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_check_token_ids_on_packed_rows():
    """The check build_data runs on the bundled corpus it packs with the model's tokenizer (added tokens can lie past
    the embedding)."""
    from ds_mtraining.data.packing import PackedDataError, check_token_ids

    packed = pack_documents([[1, 2, 3, 299], [5, 6]], 4, 0)
    check_token_ids(packed, 300, "m")
    with pytest.raises(PackedDataError, match=r"max id 299, separator 0\), outside m's vocabulary of 299"):
        check_token_ids(packed, 299, "m")
