"""The README's Python example runs as written (a renamed import or config key breaks it, not just the prose)."""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_python_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert blocks, "README.md has no python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    monkeypatch.chdir(REPO)  # the example reads ds_configs/ by a relative path
    runpy.run_path(os.fspath(script), run_name="__main__")
    printed = capsys.readouterr().out.split()
    assert len(printed) >= 2 and printed[0].startswith("tensor("), printed  # recall, density


def _run_scripts(rank: int, world: int, scripts: list[str]) -> None:
    """Run each script in this process, in the repository (they read ``ds_configs/`` by a relative path) and in a
    process group of one, as a launcher would start them."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(REPO)
    for script in scripts:
        runpy.run_path(script, run_name="__main__")


def test_train_from_python_runs(tmp_path):
    """The "Train from Python" examples run as written: the job's loop on the caller's batches (its outputs written
    where the example says, here under ``tmp_path``), and a loop of one's own."""
    from distributed import run_distributed

    section = re.search(r"^## Train from Python\n(.*?)^## ", (REPO / "README.md").read_text(), re.S | re.M)
    assert section, 'README.md has no "## Train from Python" section'
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 2 and '"runs/mine"' in blocks[0], blocks
    out = tmp_path / "mine"
    blocks[0] = blocks[0].replace('"runs/mine"', repr(str(out)))
    scripts = []
    for i, block in enumerate(blocks):
        scripts.append(str(tmp_path / f"example{i}.py"))
        Path(scripts[-1]).write_text(block)
    run_distributed(1, _run_scripts, scripts, timeout=300)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
