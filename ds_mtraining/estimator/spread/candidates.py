"""The columns the spread greedy may choose, and the observation rows' attention at them.

The candidates are the sinks plus the ``2 * max_columns`` columns with the best initial estimated mass per
entry. Their attention ``A[:, c]`` is recomputed from their keys (``[m, Kc]``) and everything else about columns
is forgotten, so the greedy works on small tensors.
"""

from __future__ import annotations

import torch

from ds_mtraining.sparse.backends import uses_triton

from ..kernels import estimator_kernels
from ..observe import key_lookup, normalise
from .evidence import SpreadEvidence
from .settings import SpreadSettings
from .spikes import SPIKES

__all__ = ["candidate_attention", "candidate_columns", "far_rows"]


def far_rows(rows: torch.Tensor, keys: torch.Tensor, exclusion: int) -> torch.Tensor:
    """Per key ``k`` (any shape), how many of the ascending ``rows [m]`` are at least ``exclusion`` behind it:
    LongTensor like ``keys``."""
    return rows.numel() - torch.searchsorted(rows, (keys + exclusion).contiguous())


def candidate_columns(
    evidence: SpreadEvidence, rows: torch.Tensor, seqlen: int, settings: SpreadSettings
) -> torch.Tensor:
    """Columns the greedy may choose: LongTensor ``[B, Hq, Kc]``, ascending, sinks first, padded with ``seqlen``.

    ``Kc = sinks + min(2 * max_columns, N - sinks)``: the free columns whose far entries have the largest
    mean with the ``SPIKES`` largest dropped — the greedy's column ratio before any offset is chosen. On CUDA the
    ratio is one Triton launch (``estimator.triton.candidates``).
    """
    sinks = min(settings.sink_tokens, seqlen)
    # Ranked in fp32, like the fp32 sums it comes from: half the top-k's radix passes of fp64 (~0.1 ms at 128K).
    if uses_triton(evidence.column_sum.device):
        ratio = estimator_kernels().candidates.column_ratio(
            evidence.column_sum, evidence.column_top, rows, sinks, settings.exclusion
        )
    else:
        seen = far_rows(rows, torch.arange(seqlen, device=rows.device), settings.exclusion)
        ratio = (evidence.column_sum - evidence.column_top) / (seen - SPIKES).clamp(min=1)
        ratio = torch.where(seen > SPIKES, ratio, -1.0)[..., sinks:]
    width = min(2 * settings.max_columns, seqlen - sinks)
    top = ratio.topk(width, dim=-1, sorted=False).indices + sinks  # the set; sorted by position below
    forced = torch.arange(sinks, device=rows.device).expand(*top.shape[:-1], sinks)
    # Positions sort as int32 where they fit: half the radix passes (H200, [16, 2048]: 0.038 -> 0.033 ms).
    ordered = top.int().sort(dim=-1).values.long() if seqlen < 2**31 else top.sort(dim=-1).values
    return torch.cat([forced, ordered], dim=-1)


def candidate_attention(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    softmax_scale: float,
    seqlen: int,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The observation rows' attention at the candidate columns, recomputed from their keys: float32 ``[B, Hq, m, Kc]``.

    ``q_obs`` ``[B, m, Hq, D]`` and ``k`` ``[B, n, Hkv, D]`` at global ``keys`` ``[n]`` (a shard: candidates held
    elsewhere read 0, so the shards' results add up to the whole); ``row_max`` / ``row_sum`` ``[B, Hq, m]`` the
    rows' statistics over all keys (:func:`estimator.observe.row_statistics`, reduced); ``candidates`` from
    :func:`candidate_columns` (padding = ``seqlen``); ``row_starts`` LongTensor ``[B, m]``, the rows' document
    starts (a row reads 0 at a candidate before its document), or ``None``. Values are fp32-rounded like the evidence's attention. On CUDA
    one Triton pass (``estimator.triton.evidence.candidate_attention``) from the keys in their dtype, like the
    evidence; elsewhere an fp32 einsum.
    """
    batch, _, hq, _ = q_obs.shape
    where = key_lookup(keys, seqlen)[candidates]  # [B, Hq, Kc]: the candidate's column here, -1 if elsewhere
    if uses_triton(q_obs.device):
        return estimator_kernels().evidence.candidate_attention(
            q_obs.to(k.dtype), k, rows, candidates, where, row_max, row_sum, softmax_scale, row_starts
        )
    kv_head = (torch.arange(hq, device=k.device) // (hq // k.shape[2]))[None, :, None]
    k_cand = k[torch.arange(batch, device=k.device)[:, None, None], where.clamp(min=0), kv_head]  # [B, Hq, Kc, D]
    logits = torch.einsum("bmhd,bhcd->bhmc", q_obs.float() * softmax_scale, k_cand.float())
    attn = normalise(logits, row_max, row_sum)
    held = (where >= 0)[:, :, None, :] & (candidates[:, :, None, :] <= rows[:, None])
    if row_starts is not None:
        held &= candidates[:, :, None, :] >= row_starts[:, None, :, None]
    return torch.where(held, attn, 0.0)
