"""Reading the benchmarks' markdown reports in their tests: the header, a table's rows, the numbers in a cell."""

from __future__ import annotations

import math
import re

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*(?:e[-+]?\d+)?|inf|nan)", re.IGNORECASE)


def assert_header(text: str, module: str, launcher: str = "python -m") -> None:
    """``text`` opens with ``benchmarks.harness.header``'s lines for ``module``: title and UTC date, the machine and
    the versions, the command."""
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[0].endswith(" UTC"), lines[0]
    assert all(f"{package} " in lines[2] for package in ("torch", "triton", "transformers", "deepspeed")), lines[2]
    assert lines[4].startswith(f"command: `{launcher} benchmarks.{module}"), lines[4]


def table(text: str, header: str) -> list[list[str]]:
    """The body rows, cells stripped, of the table whose header row starts with ``| {header} |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    body = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        body.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return body


def numbers(cell: str) -> list[float]:
    """Every number written in ``cell`` (``1,234.5``, ``2.1x``, ``0.8 (12.5%)``, ``nan``)."""
    return [float(x.replace(",", "")) for x in NUMBER.findall(cell)]


def assert_finite(cells: list[str]) -> None:
    """Each cell holds at least one number and all its numbers are finite."""
    for cell in cells:
        found = numbers(cell)
        assert found and all(math.isfinite(x) for x in found), cells
