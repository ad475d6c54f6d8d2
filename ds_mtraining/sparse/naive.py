"""``vertical_slash_attention`` computed the plain way, with its signature: the reference its kernels are tested
against (as flash-linear-attention keeps a ``naive.py`` beside each op).

The mask is the index contract itself (``index_to_dense_mask``: causal, and a vertical column or a slash offset of
the head; inside the query's document with ``documents``), applied to a dense softmax in the inputs' dtype. O(N²)
memory: meant for tests in float64, never for training.
"""

from __future__ import annotations

import torch

from .documents import Documents
from .index import VerticalSlashIndex, index_to_dense_mask
from .reference import reference_attention

__all__ = ["vertical_slash_attention_naive"]


def vertical_slash_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex | None,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    documents: Documents | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What ``vertical_slash_attention(q, k, v, index, ...)`` computes, by its definition: q ``[B, N, Hq, D]``, k/v
    ``[B, N, Hkv, D]`` (any dtype; float64 for a reference), ``index`` ``[B, Hq, ...]`` or ``None`` (dense causal),
    ``documents`` ``[B, N]`` or ``None``. Returns out ``[B, N, Hq, D]`` and, with ``return_lse``, lse ``[B, Hq, N]``
    (natural log), differentiable, in q's dtype."""
    b, n, heads = q.shape[0], q.shape[1], q.shape[2]
    if index is None:
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().expand(b, 1, n, n)
        if documents is not None:
            mask = mask & documents.mask()[:, None]
        mask = mask.expand(b, heads, n, n)
    else:
        mask = index_to_dense_mask(index, n, documents)
    out, lse = reference_attention(q, k, v, mask, softmax_scale)
    return (out, lse) if return_lse else out
