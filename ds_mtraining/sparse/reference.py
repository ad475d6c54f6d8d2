"""Masked softmax attention computed the plain way: the reference every fast path is tested against.

O(N²) memory; meant for tests in float64, never for training.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the keys that ``mask`` allows, in the dtype of the inputs.

    Args:
        q: ``[B, N, Hq, D]``.
        k, v: ``[B, N, Hkv, D]`` with ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        mask: BoolTensor ``[B, Hq, N, N]`` (query, key), or ``[B, 1, N, N]`` for every head, e.g. from
            ``index_to_dense_mask`` (with its ``documents``) or ``Documents.mask()[:, None]``.
        softmax_scale: defaults to ``1 / sqrt(D)``.

    Returns:
        out ``[B, N, Hq, D]`` and lse ``[B, Hq, N]`` (natural log). Rows with no allowed key get out 0 and lse -inf.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].clamp(min=torch.finfo(scores.dtype).min))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse
