"""Perplexity vs context length on held-out long text, dense and sparse.

The same held-out tokens are scored at every context length: each row of ``max(lengths)`` tokens is cut
into windows of ``length`` tokens, each window is one forward pass, and the perplexity is
``exp(mean NLL)`` over every predicted token of every window. Longer windows give each token more context,
so a model that uses long context gets a lower perplexity as the length grows; the sparse/dense gap at
a length is the price of the sparse attention there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_mtraining.integration.transformers import MTrainingAttention

__all__ = ["PerplexityResult", "perplexity", "perplexity_table"]


@dataclass(frozen=True)
class PerplexityResult:
    length: int
    attention: str
    perplexity: float
    tokens: int
    density: float
    """Mean attention density over layers and windows (1 for dense)."""
    recall: float
    """Mean observed recall over layers and windows (1 for dense)."""


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, attention: MTrainingAttention) -> tuple[float, int]:
    """Summed next-token NLL of one window ``[1, n]`` and the number of predicted tokens (``n - 1``)."""
    hidden = model.model(ids, mtraining=attention, use_cache=False).last_hidden_state[0, :-1]
    targets = ids[0, 1:]
    total = 0.0
    for start in range(0, hidden.shape[0], 2048):  # the vocabulary is large: logits a chunk at a time
        logits = model.lm_head(hidden[start : start + 2048]).float()
        total += float(F.cross_entropy(logits, targets[start : start + 2048], reduction="sum"))
    return total, targets.numel()


def perplexity(
    model,
    rows: torch.Tensor,
    lengths: Sequence[int],
    attentions: dict[str, MTrainingAttention],
    advance: Callable[[int], object] | None = None,
) -> list[PerplexityResult]:
    """Perplexity of ``rows`` ``[R, L]`` (``L`` divisible by every length) per length and attention kind, in the
    order of ``lengths`` and ``attentions``.

    ``advance(tokens)`` is called after each window's forward pass with its token count (``R · L`` per length and
    attention kind in all). The work runs longest windows first and each window under every attention in turn, so
    that a progress ETA extrapolated from the work done so far prices the attentions' mix as the rest has it (on a
    CPU a sparse window cost 8x a dense one) and errs long, not short, across lengths (a token of a longer window
    costs more).
    """
    device = next(model.parameters()).device
    for length in lengths:
        if rows.shape[1] % length:
            raise ValueError(f"row length {rows.shape[1]} is not a multiple of context length {length}")
    results = []
    for length in sorted(lengths, reverse=True):
        windows = rows.reshape(-1, length)
        sums = {name: [0.0, 0, 0.0, 0.0] for name in attentions}  # nll, tokens, density, recall
        for window in windows:
            for name, attention in attentions.items():
                s, c = window_nll(model, window[None].to(device), attention)
                total = sums[name]
                total[0] += s
                total[1] += c
                total[2] += attention.mean_density()
                total[3] += attention.mean_recall()
                if advance is not None:
                    advance(length)
        n = windows.shape[0]
        for name, (nll, count, density, recall) in sums.items():
            results.append(PerplexityResult(length, name, math.exp(nll / count), count, density / n, recall / n))
    order = {(length, name): i for i, (length, name) in enumerate((l, a) for l in lengths for a in attentions)}
    return sorted(results, key=lambda r: order[(r.length, r.attention)])


def perplexity_table(results: Sequence[PerplexityResult], baseline: str = "dense") -> str:
    """Markdown: per length and attention kind, perplexity, gap to ``baseline`` at that length, density, recall."""
    ref = {r.length: r.perplexity for r in results if r.attention == baseline}
    lines = [
        "| context | attention | perplexity | gap vs dense | mean density | mean observed recall | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        gap = f"{100 * (r.perplexity / ref[r.length] - 1):+.2f} %" if r.length in ref else "n/a"
        lines.append(
            f"| {r.length} | {r.attention} | {r.perplexity:.3f} | {gap} | {r.density:.3f} | {r.recall:.3f} | {r.tokens} |"
        )
    return "\n".join(lines)
