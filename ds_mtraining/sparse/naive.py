"""``vertical_slash_attention`` computed the plain way, with its signature: the reference its kernels are tested
against (as flash-linear-attention keeps a ``naive.py`` beside each op).

The mask is the pattern's definition itself (``AttentionPattern.dense_mask``: causal, a vertical column or a slash
offset of the head, inside the query's document), applied to a dense softmax in the inputs' dtype. O(N²) memory:
meant for tests in float64, never for training.
"""

from __future__ import annotations

import torch

from .pattern import AttentionPattern
from .reference import reference_attention

__all__ = ["vertical_slash_attention_naive"]


def vertical_slash_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: AttentionPattern | None,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What ``vertical_slash_attention(q, k, v, pattern, ...)`` computes, by its definition: q ``[B, N, Hq, D]``, k/v
    ``[B, N, Hkv, D]`` (any dtype; float64 for a reference), ``pattern`` over the ``N`` tokens or ``None`` (dense
    causal). Returns out ``[B, N, Hq, D]`` and, with ``return_lse``, lse ``[B, Hq, N]`` (natural log),
    differentiable, in q's dtype."""
    b, n, heads = q.shape[0], q.shape[1], q.shape[2]
    mask = (pattern or AttentionPattern(n)).dense_mask(q.device)
    out, lse = reference_attention(q, k, v, mask.expand(b, heads, n, n), softmax_scale)
    return (out, lse) if return_lse else out
