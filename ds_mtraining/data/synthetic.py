"""Synthetic long "text" whose attention is sparse and whose loss can go down: phrases and long-range copies.

A dataset fixes a small grammar: ``phrases`` phrases of ``phrase_len`` tokens, each starting with its own token
(so the first token names the phrase and the rest is predictable from local context). A sequence is ``BOS``
followed by phrases drawn from a Zipf-like distribution, interleaved with *copies*: a ``COPY`` marker and then a
verbatim repeat of a span from far back (hundreds to thousands of tokens earlier). Predicting inside a phrase
needs only the last few tokens (a slash line near the diagonal); predicting a copy needs the copied span (a
diagonal at the copy distance) — the vertical-slash structure the sparse attention is built for.

Sample ``i`` depends only on ``(seed, i)``, so a data position (the sampler's cursor) fully determines the
data: resuming from a checkpoint continues with exactly the samples an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, COPY = 0, 1, 2
_SPECIAL = 3


@dataclass(frozen=True)
class SyntheticCopyData:
    """Deterministic synthetic sequences of ``seqlen`` tokens over ``vocab_size`` ids (0 = pad, 1 = BOS, 2 = COPY).

    Attributes:
        seqlen: tokens per sample.
        vocab_size: token ids ``0 .. vocab_size - 1``; needs ``phrases`` + 3 ids at least.
        seed: the grammar and every sample derive from it.
        phrases, phrase_len: the grammar's size.
        copy_prob: chance that the next piece is a copy rather than a phrase.
        copy_len: tokens per copy; ``copy_distance``: (min, max) distance back to the copied span.
    """

    seqlen: int
    vocab_size: int = 512
    seed: int = 0
    phrases: int = 64
    phrase_len: int = 16
    copy_prob: float = 0.25
    copy_len: int = 128
    copy_distance: tuple[int, int] = (512, 4096)

    def __post_init__(self) -> None:
        if self.seqlen < 2:
            raise ValueError(f"seqlen must be >= 2; got {self.seqlen}")
        if self.vocab_size < self.phrases + _SPECIAL:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= phrases + 3 = {self.phrases + _SPECIAL}")

    pad_id = PAD

    def _grammar(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        starts = _SPECIAL + torch.randperm(self.vocab_size - _SPECIAL, generator=gen)[: self.phrases]
        body = torch.randint(_SPECIAL, self.vocab_size, (self.phrases, self.phrase_len - 1), generator=gen)
        return torch.cat([starts[:, None], body], dim=1)

    def sample(self, i: int) -> torch.Tensor:
        """Sample ``i``: LongTensor ``[seqlen]``."""
        grammar = self._grammar()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 1)
        weights = 1.0 / torch.arange(1, self.phrases + 1, dtype=torch.float64)
        out = torch.empty(self.seqlen + self.copy_len + self.phrase_len, dtype=torch.long)
        out[0], n = BOS, 1
        low, high = self.copy_distance
        while n < self.seqlen:
            if n > low + self.copy_len and float(torch.rand((), generator=gen)) < self.copy_prob:
                distance = int(torch.randint(low, min(high, n - 1) + 1, (), generator=gen))
                start = n + 1 - distance
                out[n] = COPY
                out[n + 1 : n + 1 + self.copy_len] = out[start : start + self.copy_len]
                n += 1 + self.copy_len
            else:
                phrase = int(torch.multinomial(weights, 1, generator=gen))
                out[n : n + self.phrase_len] = grammar[phrase]
                n += self.phrase_len
        return out[: self.seqlen].clone()

    def batch(self, indices: list[int]) -> torch.Tensor:
        """Samples ``indices`` stacked: LongTensor ``[len(indices), seqlen]``."""
        return torch.stack([self.sample(i) for i in indices])
