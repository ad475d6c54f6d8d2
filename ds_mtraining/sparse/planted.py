"""Planted vertical-slash structure: indices for benchmarks, and q/k whose attention has a known pattern.

Benchmarks must not estimate indices from random q/k (noise makes the estimator pick scattered diagonals that
cover most tiles), so they use indices shaped like real ones: the authors' planted pattern of docs/design.md — per
head, sink columns, random far columns, a local band of recent tokens and far bands at random distances — with
the number of far bands chosen to reach a target density.
"""

from __future__ import annotations

import math

import torch

from .index import VerticalSlashIndex

FREQS = 63  # rotary pairs in the diagonal sub-space; with 1 column dim and 1 noise dim, D = 128
BASE = 30.0  # logit of a share-1 entry; background logits stay below ~14, so ~3e-4 of the mass leaks


def planted_index(
    batch: int,
    heads: int,
    seqlen: int,
    block_size: int,
    *,
    density: float,
    sinks: int = 64,
    columns: int = 960,
    local_tokens: int = 2048,
    band_tokens: int = 512,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> VerticalSlashIndex:
    """A planted index per (batch, head), grown with far bands until its density reaches ``density``.

    Args:
        density: target fraction of causal entries; the result reaches it and passes it by at most one block
            offset (the sinks, columns and local band alone may already pass it — check ``index.density``).
        sinks: key positions ``0 .. sinks-1`` as columns.
        columns: further columns at random positions.
        local_tokens: recent tokens every query sees, as block offsets ``0 .. local_tokens / block_size - 1``.
        band_tokens: width of each far band (block offsets at a random distance).
    """
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    nb = -(-seqlen // block_size)
    local = max(1, min(nb, local_tokens // block_size))
    band = max(1, band_tokens // block_size)
    vertical = torch.full((batch, heads, sinks + columns), -1, dtype=torch.long)
    slash = torch.full((batch, heads, nb), -1, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            cols = torch.randint(0, seqlen, (columns,), generator=generator)
            vertical[b, h] = torch.cat([torch.arange(sinks).clamp(max=seqlen - 1), cols])
            slash[b, h, :local] = torch.arange(local)
            taken = local
            covered = _Coverage(vertical[b, h], range(local), block_size, seqlen)
            # Offsets are added one by one inside each band, so the target is passed by at most one offset.
            while taken < nb and covered.density() < density:
                start = int(torch.randint(local, max(local + 1, nb - band + 1), (1,), generator=generator))
                for offset in range(start, min(nb, start + band)):
                    if taken == nb or covered.density() >= density:
                        break
                    if offset not in covered.offsets:
                        slash[b, h, taken] = offset
                        covered.add(offset)
                        taken += 1
    return VerticalSlashIndex.build(vertical.to(device), slash.to(device), block_size)


class _Coverage:
    """The causal entries one head's columns and slash offsets cover, kept exact as offsets are added one at a time.

    ``VerticalSlashIndex.density``'s count, in integers: an offset o >= 1 adds its tiles, ``(nb - 1 - o) · bs² +
    last · bs`` entries (offset 0: the diagonal's triangles), and takes from every column whose block lies at least o
    blocks before the last the rows of query block ``cb + o``, which that offset now covers: ``bs`` rows, or ``last``
    in the partial last block. The density is then the same float as ``density()``'s (its sums are of integers below
    2^53, exact in float64) at O(1) an offset instead of a whole index built each time: at 4M tokens the planted
    pattern took 69 s that way, most of a simulator run.
    """

    def __init__(self, vertical: torch.Tensor, offsets: range, block_size: int, seqlen: int):
        bs = block_size
        self.bs, self.seqlen = bs, seqlen
        self.nb = -(-seqlen // bs)
        self.last = seqlen - (self.nb - 1) * bs
        self.offsets: set[int] = set()
        self.slash_entries = 0
        # reach: the largest offset a column in block cb sees, nb - 1 - cb; columns counted once (the index's
        # canonical rows drop duplicates).
        blocks = torch.unique(vertical[vertical >= 0]) // bs
        reach = torch.bincount(self.nb - 1 - blocks, minlength=self.nb)
        self.at_reach = reach.tolist()  # columns whose reach is exactly r
        self.beyond = (reach.flip(0).cumsum(0).flip(0) - reach).tolist()  # columns whose reach exceeds r
        # Before any offset >= 1: every column sees bs rows in each later block, last in the partial one.
        self.column_entries = sum(r * bs - (bs - self.last) * (r >= 1) for r in (self.nb - 1 - blocks).tolist())
        for offset in offsets:
            self.add(offset)

    def add(self, offset: int) -> None:
        """Cover block offset ``offset`` (not covered yet)."""
        bs, nb, last = self.bs, self.nb, self.last
        self.offsets.add(offset)
        if offset == 0:
            self.slash_entries += (nb - 1) * bs * (bs + 1) // 2 + last * (last + 1) // 2
            return
        self.slash_entries += (nb - 1 - offset) * bs * bs + last * bs
        self.column_entries -= bs * self.beyond[offset] + last * self.at_reach[offset]

    def density(self) -> float:
        """The covered share of the ``seqlen (seqlen + 1) / 2`` causal entries."""
        return (self.slash_entries + self.column_entries) / (self.seqlen * (self.seqlen + 1) / 2)


def plant_head(
    seqlen: int, *, columns: dict[int, float], diagonals: dict[int, float], sink: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[seqlen, 128]`` float64 whose logits (scale 1) are ``BASE + log(share)`` at the planted entries.

    Logits add over sub-spaces of the head dim:
    - diagonal sub-space (``FREQS`` rotary pairs at random frequencies θ_f in (0, π)):
      ``q_i = (cos θ i, sin θ i)`` and ``k_j = R(θ j) w_f`` give ``q_i·k_j = Σ_f Re(e^{iθ_f (i-j)} conj(w_f))``,
      a function of ``i - j`` only; ``w`` is the min-norm solution putting exactly ``BASE + log(share_d)`` at
      each planted distance ``d``, and random-looking sidelobes (< ~14) everywhere else;
    - column direction: every q has a 1 there; planted column keys (and the sink, key 0) carry
      ``BASE + log(share)`` there and nothing in the diagonal sub-space, so their logit is exact for every row;
    - a noise direction: small Gaussian noise on every q and every unplanted k (logit jitter ~0.003).
    So a row that sees all planted entries puts ``share`` on each of them, whatever its position.
    """
    gen = torch.Generator().manual_seed(seed)
    theta = torch.rand(FREQS, generator=gen, dtype=torch.float64) * math.pi
    dist = torch.tensor(list(diagonals), dtype=torch.float64)
    peak = torch.tensor([BASE + math.log(s) for s in diagonals.values()], dtype=torch.float64)
    basis = torch.cat([torch.cos(theta * dist[:, None]), torch.sin(theta * dist[:, None])], dim=1)  # [T, 2F]
    a, b = (basis.T @ torch.linalg.solve(basis @ basis.T, peak)).split(FREQS)
    angle = theta * torch.arange(seqlen, dtype=torch.float64)[:, None]  # [N, F]
    cos, sin = angle.cos(), angle.sin()
    noise = 0.05 * torch.randn(2, seqlen, 1, generator=gen, dtype=torch.float64)  # ~0.003 logit jitter
    ones, zeros = torch.ones(seqlen, 1, dtype=torch.float64), torch.zeros(seqlen, 1, dtype=torch.float64)
    q = torch.cat([cos, sin, ones, noise[0]], dim=1)
    k = torch.cat([a * cos - b * sin, a * sin + b * cos, zeros, noise[1]], dim=1)
    for col, share in {0: sink, **columns}.items():
        k[col] = 0.0
        k[col, 2 * FREQS] = BASE + math.log(share)
    return q, k
