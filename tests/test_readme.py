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
