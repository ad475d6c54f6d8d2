"""Observation rows: a few query rows' exact causal softmax over all keys, the evidence every strategy uses.

A strategy picks the rows (positions ``p_i``); their attention

    A = softmax(q_obs · Kᵀ · scale)   causal (key j <= row position p_i), fp32, [B, Hq, m, n], rows sum to 1

and, with packed documents, inside the row's document (key j >= s_i, the row's document start: ``row_starts``),
so a row never votes for another document's keys
is computed exactly on the keys this rank holds, with the row statistics combined over all keys by the caller's
:class:`~ds_mtraining.estimator.reduce.Reducer` (:func:`row_statistics` returns the sum in fp64 so the order in
which shards add up does not matter).

Layout: q ``[B, N, Hq, D]``, k ``[B, n, Hkv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads kv head
``h // (Hq // Hkv)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_mtraining.sparse.index import VerticalSlashIndex

from .reduce import Reducer

__all__ = [
    "Observation",
    "index_mask",
    "key_lookup",
    "normalise",
    "observation_attention",
    "observation_logits",
    "observed_recall",
    "reduce_row_statistics",
    "row_statistics",
    "visible",
]


@dataclass(frozen=True)
class Observation:
    """What a strategy looked at.

    Attributes:
        rows: LongTensor ``[m]``, global positions ``p_i`` of the observation rows.
        attn: float32 ``[B, Hq, m, n]``, their causal softmax over the keys at ``keys``; zero at keys ``j > p_i``.
            Each row sums to 1 over all keys of the sequence (over every shard, when sharded).
        keys: LongTensor ``[n]``, global positions of ``attn``'s key columns (``arange(N)`` on one device).
        seqlen: tokens in the whole sequence.
    """

    rows: torch.Tensor
    attn: torch.Tensor
    keys: torch.Tensor
    seqlen: int


def visible(rows: torch.Tensor, keys: torch.Tensor, row_starts: torch.Tensor | None) -> torch.Tensor:
    """Which keys each observation row sees: Bool ``[m, n]`` (causal, ``keys <= rows``), or ``[B, 1, m, n]``
    inside each row's document as well (``keys >= row_starts``, LongTensor ``[B, m]``), to broadcast against
    ``[B, Hq, m, n]``."""
    causal = keys[None, :] <= rows[:, None]
    if row_starts is None:
        return causal
    return (causal & (keys[None, None, :] >= row_starts[:, :, None]))[:, None]


def observation_logits(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    key_positions: torch.Tensor,
    softmax_scale: float,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled logits of the observation rows against keys, ``-inf`` where not seen (:func:`visible`): float32
    ``[B, Hq, m, n]``.

    Args:
        q_obs: ``[B, m, Hq, D]``, the observation rows' queries, any float dtype.
        k: ``[B, n, Hkv, D]``, ``Hq % Hkv == 0`` (all keys, or one rank's shard).
        rows: LongTensor ``[m]``, global positions of the rows.
        key_positions: LongTensor ``[n]``, global positions of the keys (keys past the sequence: pass a
            position larger than every row, so they are masked).
        row_starts: LongTensor ``[B, m]``, each row's document start (``Documents.starts`` at ``rows``), or
            ``None`` for one sequence a row.
    """
    batch, m, hq, dim = q_obs.shape
    hkv = k.shape[2]
    # Query head h = kv * group + g, so splitting Hq as (Hkv, group) pairs every query head with its kv head
    # inside one batched matmul: K is never repeated.
    q_obs = (q_obs.float() * softmax_scale).view(batch, m, hkv, hq // hkv, dim)
    logits = torch.einsum("bmhgd,bnhd->bhgmn", q_obs, k.float()).reshape(batch, hq, m, k.shape[1])
    return logits.masked_fill_(~visible(rows, key_positions, row_starts), float("-inf"))


def normalise(logits: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities from logits and their row statistics: float32 like ``logits``.

    ``row_max`` ``[B, Hq, m]`` (fp32) and ``row_sum`` = Σ exp(logit − row_max) ``[B, Hq, m]`` (fp64) may come
    from all keys of a sharded sequence (reduced across ranks), so every shard normalises identically.
    """
    return (torch.exp(logits - row_max[..., None]) / row_sum[..., None]).float()


def row_statistics(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max (fp32; ``-inf`` for a row with no causal key here) and Σ exp(logit − max) (fp64, so the order of
    a sharded sum does not matter)."""
    row_max = logits.amax(dim=-1)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)  # a shard may hold no key of a row: sum 0, not nan
    return row_max, torch.exp(logits - shift[..., None]).sum(dim=-1, dtype=torch.float64)


def reduce_row_statistics(row_max: torch.Tensor, row_sum: torch.Tensor, reducer: Reducer) -> None:
    """Combine the shards' :func:`row_statistics` in place into those over all keys.

    Every rank ends with the same global max and the sum rescaled to it, so all shards normalise identically.
    """
    if not reducer.sharded:  # one device: the statistics already span every key
        return
    local_max = row_max.clone()
    reducer.max_(row_max)
    row_sum.mul_(torch.exp((local_max - row_max).double()))  # a shard with no key of a row: 0 * exp(-inf) = 0
    reducer.sum_(row_sum)


def observation_attention(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    softmax_scale: float,
    reducer: Reducer,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax of the observation rows at this rank's keys, normalised over all keys: float32
    ``[B, Hq, m, n]``.

    Args:
        q_obs: ``[B, m, Hq, D]``, the rows' queries (:meth:`Reducer.gather_rows`), any float dtype.
        k: ``[B, n, Hkv, D]`` at global positions ``keys [n]``; rows at ``rows [m]``.
        reducer: combines the row statistics over all keys (the identity on one device).
        row_starts: LongTensor ``[B, m]``, the rows' document starts, or ``None`` (:func:`observation_logits`).

    Row ``i`` is zero at keys ``j > rows[i]`` (and before its document); over all ranks' keys it sums to 1.
    """
    logits = observation_logits(q_obs, k, rows, keys, softmax_scale, row_starts)
    row_max, row_sum = row_statistics(logits)
    reduce_row_statistics(row_max, row_sum, reducer)
    return normalise(logits, row_max, row_sum)


def key_lookup(keys: torch.Tensor, seqlen: int) -> torch.Tensor:
    """This rank's column of every global position: LongTensor ``[seqlen + 1]``, -1 where the key is held
    elsewhere and at the spare last slot (where ``keys``' padding positions ``>= seqlen`` land)."""
    lookup = torch.full((seqlen + 1,), -1, dtype=torch.long, device=keys.device)
    lookup[keys.clamp(max=seqlen)] = torch.arange(keys.numel(), device=keys.device)
    lookup[seqlen:].fill_(-1)  # not `lookup[seqlen] = -1`: a host-to-device copy, which a CUDA graph cannot capture
    return lookup


def index_mask(index: VerticalSlashIndex, rows: torch.Tensor, keys: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Which (row, key) entries ``index`` attends: Bool ``[B, Hq, m, n]`` for rows at ``rows`` ``[m]`` and keys at
    global ``keys`` ``[n]`` (positions ``>= seqlen`` are padding and never attended).

    Row ``p`` sees key ``j`` iff ``j <= p`` and (``j`` is a column or the offset ``p // bs - j // bs`` is chosen):
    O(m·n) per head, no dense ``N × N`` mask.
    """
    batch, heads, bs = index.batch, index.heads, index.block_size
    real = keys < seqlen
    keys = torch.where(real, keys, 0)
    offset = rows[:, None] // bs - keys[None, :] // bs  # [m, n]
    flat = offset.clamp(min=0).view(1, 1, -1).expand(batch, heads, -1)
    tiles = index.offset_mask(seqlen).gather(-1, flat).view(batch, heads, rows.numel(), keys.numel())
    inside = index.column_mask(seqlen)[:, :, keys][:, :, None, :] | tiles
    return inside & (keys[None, :] <= rows[:, None]) & real


def observed_recall(index: VerticalSlashIndex, observation: Observation) -> torch.Tensor:
    """Mass of the observation rows inside ``index``'s mask (:func:`index_mask`), / number of rows: float32
    ``[B, Hq]``. With a sharded observation this is the shard's part; the parts add up."""
    inside = index_mask(index, observation.rows, observation.keys, observation.seqlen)
    mass = torch.where(inside, observation.attn, 0.0).sum(dim=(-2, -1), dtype=torch.float64)
    return (mass / observation.rows.numel()).float()
