"""Needle in a haystack: one fact hidden at a given depth of a long essay text, asked for at the end.

A grid of (context length × needle depth) cells, each scored with RULER's ``string_match_all`` (the share of
expected answers that appear in the generated text, ×100), rendered as a heatmap PNG.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_mtraining.eval.generate import greedy_generate
from ds_mtraining.integration.transformers import MTrainingAttention

__all__ = ["NiahCell", "make_niah_prompt", "niah_grid", "niah_table", "plot_niah", "string_match_all"]

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text?"
    " The special magic number for {key} mentioned in the provided text is"
)
HEADER = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n"
)
KEYS = ("quiet-harbor", "amber-violin", "brisk-lantern", "silent-orchard", "copper-meadow", "velvet-canyon")


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's niah metric for one sample: 100 × share of ``answers`` found (case-insensitive) in ``prediction``."""
    if not answers:
        raise ValueError("string_match_all needs at least one expected answer")
    return 100.0 * sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def make_niah_prompt(tokenizer, haystack: str, length: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
    """Prompt ids ``[1, <= length]`` with the needle at ``depth`` (0 = start, 1 = end of the haystack), and the answer.

    The haystack is cut at a sentence end so the prompt fits ``length`` tokens; the needle goes in at the
    sentence boundary nearest the depth.
    """
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randint(10**6, 10**7 - 1))
    needle = NEEDLE.format(key=key, value=value)
    fixed = len(tokenizer(HEADER + needle + " " + QUESTION.format(key=key), add_special_tokens=False).input_ids)
    budget = length - fixed - 8
    if budget <= 0:
        raise ValueError(f"length={length} leaves no room for a haystack (the question alone takes {fixed} tokens)")
    ids = tokenizer(haystack, add_special_tokens=False).input_ids[:budget]
    text = tokenizer.decode(ids)
    sentences = [s for s in text.split(". ")[:-1]]  # the last piece may be cut mid-sentence
    cut = max(0, min(len(sentences), round(depth * len(sentences))))
    context = ". ".join(sentences[:cut] + [needle.rstrip(".")] + sentences[cut:]) + "."
    prompt = HEADER + context + QUESTION.format(key=key)
    prompt_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    return prompt_ids[:, -length:], value


@dataclass(frozen=True)
class NiahCell:
    length: int
    depth: float
    score: float
    prediction: str
    answer: str


def niah_grid(
    model,
    tokenizer,
    haystack: str,
    attention: MTrainingAttention,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    max_new_tokens: int = 16,
    seed: int = 0,
    advance: Callable[[], object] | None = None,
) -> list[NiahCell]:
    """Score every (length, depth) cell once (the same needle seed per depth across lengths); ``advance`` is called
    after each cell."""
    cells = []
    device = next(model.parameters()).device
    for length in lengths:
        for i, depth in enumerate(depths):
            ids, answer = make_niah_prompt(tokenizer, haystack, length, depth, seed + i)
            new = greedy_generate(model, ids.to(device), attention, max_new_tokens, {tokenizer.eos_token_id})
            prediction = tokenizer.decode(new)
            cells.append(NiahCell(length, depth, string_match_all(prediction, [answer]), prediction, answer))
            if advance is not None:
                advance()
    return cells


def niah_table(cells: Sequence[NiahCell]) -> str:
    """Markdown: rows = depth, columns = length."""
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    score = {(c.length, c.depth): c.score for c in cells}
    lines = ["| depth | " + " | ".join(str(n) for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
    for d in depths:
        lines.append(f"| {d:.2f} | " + " | ".join(f"{score[(n, d)]:.0f}" for n in lengths) + " |")
    means = [sum(score[(n, d)] for d in depths) / len(depths) for n in lengths]
    lines.append("| **mean** | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    return "\n".join(lines)


def plot_niah(cells: Sequence[NiahCell], path: str | Path, title: str) -> Path:
    """Heatmap PNG: depth (rows) × length (columns), score 0–100."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    score = {(c.length, c.depth): c.score for c in cells}
    grid = [[score[(n, d)] for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.45 * len(depths) + 1.5))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
