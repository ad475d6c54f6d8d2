"""The inputs benchmarks share: planted indices for the attention kernels, rows of equal packed documents, and
planted q/k heads for the estimators.

The kernels' planted index here (:func:`planted_index`, :func:`index_for_density`) is the one the kernel results
in ``benchmarks/results/`` were measured on: a local band searched for a target density. The package's
``ds_mtraining.sparse.planted.planted_index`` grows far bands instead; the multi-GPU and CPU benchmarks use that one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.planted import plant_head

HeadSpec = Callable[[torch.Generator], tuple[dict[int, float], dict[int, float]]]


def _band_offsets(d0: torch.Tensor, width: int, bs: int, nb: int) -> torch.Tensor:
    """Block offsets crossed by token diagonals ``[d0, d0 + width)``: ``[..., L]`` (-1 beyond ``nb``)."""
    lo = d0 // bs
    hi = -((-(d0 + width - 1)) // bs)  # ceil
    span = int((width - 1) // bs + 2)
    off = lo[..., None] + torch.arange(span, device=d0.device)
    return torch.where((off <= hi[..., None]) & (off < nb), off, -1)


def planted_index(
    batch: int,
    heads: int,
    seqlen: int,
    block_size: int,
    *,
    sinks: int = 64,
    columns: int = 960,
    local: int = 2048,
    bands: int = 2,
    band: int = 512,
    seed: int = 0,
    device: torch.device | str,
) -> VerticalSlashIndex:
    """docs/design.md's planted pattern, ``[batch, heads, ·]`` on ``device``: per head ``sinks`` sink columns and
    ``columns`` random ones, the diagonals of the last ``local`` tokens and ``bands`` bands of ``band`` token
    diagonals at random distances (token units, mapped to the block offsets they cross)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nb = -(-seqlen // block_size)
    sink = torch.arange(min(sinks, seqlen)).expand(batch, heads, -1)
    rand = torch.randint(min(sinks, seqlen - 1), seqlen, (batch, heads, columns), generator=gen)
    vertical = torch.cat([sink, rand], -1)
    local_off = _band_offsets(torch.zeros(batch, heads, 1, dtype=torch.long), max(local, 1), block_size, nb)
    far_lo = min(local, max(seqlen - band, 0))
    d0 = torch.randint(far_lo, max(seqlen - band, far_lo + 1), (batch, heads, bands), generator=gen)
    far = _band_offsets(d0, band, block_size, nb).flatten(-2)
    slash = torch.cat([local_off.flatten(-2), far], -1)
    return VerticalSlashIndex.build(vertical.to(device), slash.to(device), block_size)


def index_for_density(
    batch: int, heads: int, seqlen: int, block_size: int, target: float, *, seed: int = 0, device: torch.device | str
) -> tuple[VerticalSlashIndex, float]:
    """The :func:`planted_index` whose mean density is closest to ``target``, and that density: columns and far
    bands set from the target (about 20 % and 25 % of it), the local band's width bisected."""
    columns = max(16, int(0.2 * target * seqlen) - 2 * 64)
    band = max(1, min(512, int(0.125 * target * seqlen)))
    best = None
    lo, hi = 1, seqlen
    while lo <= hi:  # density grows with the local band
        local = (lo + hi) // 2
        index = planted_index(
            batch, heads, seqlen, block_size, columns=columns, local=local, band=band, seed=seed, device=device
        )
        density = index.density(seqlen).mean().item()
        if best is None or abs(density - target) < abs(best[1] - target):
            best = (index, density)
        if density < target:
            lo = local + block_size
        else:
            hi = local - block_size
    return best


def document_case(spec: str) -> tuple[int, float]:
    """A packed-row case from the command line: ``LENGTH:SPARSITY`` -> (document length, in-document sparsity)."""
    length, sparsity = spec.split(":")
    return int(length), float(sparsity)


def tiled_index(per_document: VerticalSlashIndex, length: int, documents: int) -> VerticalSlashIndex:
    """``per_document``'s index repeated over a row of ``documents`` documents of ``length`` tokens (columns moved
    by each document's start, offsets unchanged): ``[B, Hq, ·]``."""
    vertical = per_document.vertical
    shifted = [torch.where(vertical >= 0, vertical + d * length, -1) for d in range(documents)]
    return VerticalSlashIndex.build(torch.cat(shifted, -1), per_document.slash, per_document.block_size)


def random_row(
    seqlen: int, heads: int, kv_heads: int, dim: int, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Leaves q ``[1, seqlen, heads, dim]`` and k, v ``[1, seqlen, kv_heads, dim]`` (requiring grad, seed 0) and an
    output gradient shaped like q, all ``dtype`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, seqlen, heads, dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, seqlen, kv_heads, dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)], torch.randn_like(q)


def random_qkv(
    seqlen: int, gen: torch.Generator, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The estimator benchmarks' random inputs: q ``[1, seqlen, 16, 128]``, k and v ``[1, seqlen, 2, 128]``."""
    q = torch.randn(1, seqlen, 16, 128, generator=gen).to(device, dtype)
    k, v = (torch.randn(1, seqlen, 2, 128, generator=gen).to(device, dtype) for _ in range(2))
    return q, k, v


def _planted_heads(
    seqlen: int, heads: int, seed: int, spec: HeadSpec, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[1, seqlen, heads, 128]`` and k ``[1, seqlen, heads // 8, 128]`` (GQA 8) from ``plant_head``; ``spec(gen)``
    gives each head's planted columns and diagonals (token distance -> share); each kv head's group shares the keys
    of its first head, with light noise on q."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    for h in range(heads):
        columns, diagonals = spec(gen)
        q, k = plant_head(seqlen, columns=columns, diagonals=diagonals, sink=0.1, seed=seed * 100 + h // 8)
        qs.append(q * 128**0.5)  # the D**-0.5-scaled logits land on the planted values
        ks.append(k)
    q = torch.stack(qs, dim=1)[None]
    k = torch.stack(ks[::8], dim=1)[None]
    q = q + 0.02 * torch.randn(q.shape, generator=gen, dtype=q.dtype)
    return q.to(device, dtype), k.to(device, dtype)


@functools.lru_cache(maxsize=4)
def planted_heads(
    seqlen: int, heads: int, seed: int, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Light planted heads (:func:`_planted_heads`): sinks, 12 far columns, diagonals 0 and 1 and 4 far ones (their
    index: ~1 % dense). Cached: planting them on the CPU takes seconds at 256K, and benchmarks time them twice."""

    def spec(gen: torch.Generator) -> tuple[dict[int, float], dict[int, float]]:
        cols = torch.randperm(seqlen - 1, generator=gen)[:12] + 1
        diags = torch.randperm(seqlen // 2, generator=gen)[:4] + 300
        return {int(c): 0.03 for c in cols}, {0: 0.05, 1: 0.03, **{int(d): 0.04 for d in diags}}

    return _planted_heads(seqlen, heads, seed, spec, device, dtype)


def sparse95_heads(
    seqlen: int, heads: int, seed: int, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads (:func:`_planted_heads`) whose index lands near 95 % sparsity at 128K: sinks, 100 columns (40 % of the
    mass), 12 diagonals within 1536 tokens (25 %) and 12 far ones (20 %)."""

    def spec(gen: torch.Generator) -> tuple[dict[int, float], dict[int, float]]:
        cols = torch.randperm(seqlen - 1, generator=gen)[:100] + 1
        near = torch.randperm(1536, generator=gen)[:12]
        far = torch.randperm(seqlen // 2, generator=gen)[:12] + 2048
        diagonals = {0: 0.05, **{int(d): 0.25 / 12 for d in near}, **{int(d): 0.2 / 12 for d in far}}
        return {int(c): 0.004 for c in cols}, diagonals

    return _planted_heads(seqlen, heads, seed, spec, device, dtype)
