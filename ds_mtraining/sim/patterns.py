"""The patterns the cluster simulator prices: planted and real vertical-slash indices at any length, and dense.

Real indices are the ones the evaluation code saves (``eval.fidelity.measure_fidelity(keep_indices=True)``, committed
under ``benchmarks/results/*_indices.pt``) from a short sequence, stretched to the simulated length: each column and
each block offset scaled by ``N / n``, so each keeps its share of the sequence. Block-sparse generators (MoBA- and
XAttention-style) live in ``sim.block_patterns``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..sparse.index import VerticalSlashIndex
from ..sparse.planted import planted_index

__all__ = ["cycled_heads", "dense_index", "load_saved_index", "planted_pattern_index", "stretched_index"]


def load_saved_index(path: Path | str, layer: int) -> dict[str, torch.Tensor | int]:
    """Layer ``layer`` of a saved index file: ``{"vertical" [B, H, Kv], "slash" [B, H, Ks], "seqlen"?}``. Reads both
    ``measure_fidelity``'s ``{layer: {...}}`` and the committed form that wraps it with its length and block size."""
    data = torch.load(path, map_location="cpu")
    layers = data.get("indices", data)
    if layer not in layers:
        raise SystemExit(f"{path} has no layer {layer}; it has layers {sorted(layers)}")
    saved = dict(layers[layer])
    if "indices" in data and data.get("seqlen") is not None:
        saved["seqlen"] = int(data["seqlen"])
    return saved


def stretched_index(saved: dict, seqlen: int, block_size: int, device: str = "cpu") -> VerticalSlashIndex:
    """A saved ``{"vertical", "slash"}`` index of ``n`` tokens stretched to ``seqlen`` (columns and offsets times
    ``seqlen / n``); ``n`` is the saved ``seqlen``, else the highest column + 1."""
    vertical, slash = (saved[k].long() for k in ("vertical", "slash"))
    n = int(saved.get("seqlen", (vertical.max() + 1).item()))
    ratio = seqlen / n
    vertical = torch.where(vertical >= 0, (vertical.double() * ratio).long(), -1)
    slash = torch.where(slash >= 0, (slash.double() * ratio).long(), -1)
    return VerticalSlashIndex.build(vertical.to(device), slash.to(device), block_size)


def cycled_heads(index: VerticalSlashIndex, heads: int) -> VerticalSlashIndex:
    """``index`` ``[B, H, ·]`` on ``heads`` heads, its own heads taken in turn (head ``h`` is head ``h mod H``): a
    saved model's pattern priced at another model's head count (SmolLM2's 9 heads as the 3B shape's 16)."""
    if heads < 1:
        raise ValueError(f"heads must be positive; got {heads}")
    pick = torch.arange(heads, device=index.vertical.device) % index.heads
    return VerticalSlashIndex(index.vertical[:, pick], index.slash[:, pick], index.block_size)


def planted_pattern_index(
    batch: int, heads: int, seqlen: int, block_size: int, *, density: float, seed: int, device: str = "cpu"
) -> VerticalSlashIndex:
    """docs/design.md's planted index grown to ``density``, with its local band (``seqlen / 64`` tokens) and random
    columns (960 per 128K tokens) scaled to ``seqlen`` so the density is reached at every length (the unscaled
    pattern alone is 15 % dense at 32K); ``[batch, heads, ·]``, the same in every process for the same seed."""
    return planted_index(
        batch,
        heads,
        seqlen,
        block_size,
        density=density,
        sinks=min(64, seqlen // block_size),
        columns=max(8, seqlen * 960 // 131072),
        local_tokens=max(2 * block_size, seqlen // 64),
        generator=torch.Generator().manual_seed(seed),
        device=device,
    )


def dense_index(heads: int, seqlen: int, block_size: int) -> VerticalSlashIndex:
    """Dense causal attention as an index (every block offset, no columns): the baseline's work."""
    return VerticalSlashIndex.dense(1, heads, seqlen, block_size)
