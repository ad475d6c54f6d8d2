"""The attention the evaluations run through: dense, or estimated vertical-slash sparse, with an optional probe.

Importing this module registers ``attn_implementation="mtraining_eval"`` with transformers'
``AttentionInterface``. It is the training attention's single-device path (``estimate_index`` +
``vertical_slash_attention``) plus what evaluation needs and training does not: a KV cache for generation
(the prompt — the long part — is *prefilled* with sparse attention; each generated token then attends
densely to the cache, as sparse-prefill inference does) and a per-layer probe that sees q/k/v (attention
fidelity). ``ds_mtraining.integration.transformers`` registers the training attention as ``"mtraining"``;
the two share the kernels and the estimator, not this file.

The handle travels as a forward keyword::

    model = load_pretrained("smollm2-135m", attn_implementation=NAME)[0]
    logits = model(ids, eval_attention=EvalAttention(sparse=SparseAttentionConfig())).logits

Batch size 1 and no padding: sequences are whole, so no mask is built (a padding mask is refused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ds_mtraining.integration.transformers import whole_sequences_mask
from ds_mtraining.sparse import estimate_index, index_to_dense_mask, vertical_slash_attention

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.sparse import VerticalSlashIndex

__all__ = ["NAME", "EvalAttention", "Probe", "dense_causal_attention", "masked_sparse_attention"]

NAME = "mtraining_eval"
"""The ``attn_implementation`` name registered by this module."""

Probe = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]
"""``probe(layer, q, k, v, scale)`` with q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]`` (post-RoPE), prefill only."""


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over ``[B, N, H, D]`` tensors; q may be shorter than k (its rows are the last ones)."""
    nq, nk = q.shape[1], k.shape[1]
    kwargs = {"is_causal": True} if nq == nk else {}
    if 1 < nq < nk:  # a chunk of new rows after a cache: causal with an offset
        rows = torch.arange(nk - nq, nk, device=q.device)
        kwargs = {"attn_mask": torch.arange(nk, device=q.device)[None, :] <= rows[:, None]}
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, enable_gqa=True, **kwargs
    )
    return out.transpose(1, 2)


def masked_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, scale: float
) -> torch.Tensor:
    """The index's attention computed as dense SDPA under its boolean mask (same semantics, O(N²) memory).

    For accelerators where the sparse kernels are not available; the numbers it gives (perplexity, recall,
    NIAH) are those of the index, whatever computes it.
    """
    mask = index_to_dense_mask(index, q.shape[1])  # [B, Hq, N, N]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@dataclass
class EvalAttention:
    """Settings and statistics of one evaluation run.

    Attributes:
        sparse: ``None`` for dense attention; else the sparse settings (per-layer overrides applied).
        masked: compute sparse attention as masked dense SDPA instead of the sparse kernels.
        probe: called with each layer's prefill q/k/v (the layer's output stays dense when ``sparse`` is None).
        stats: layer -> (mean density, mean observed recall over heads) of the latest prefill; (1, 1) when dense.
    """

    sparse: SparseAttentionConfig | None = None
    masked: bool = False
    probe: Probe | None = None
    stats: dict[int, tuple[float, float]] = field(default_factory=dict)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        prefill = q.shape[1] == k.shape[1]
        if prefill and self.probe is not None:
            self.probe(layer, q, k, v, scale)
        config = self.sparse.for_layer(layer) if self.sparse is not None else None
        if not prefill or config is None or config.pattern == "dense":
            if prefill:
                self.stats[layer] = (1.0, 1.0)
            return dense_causal_attention(q, k, v, scale)
        index, report = estimate_index(q, k, config, softmax_scale=scale, return_report=True)
        self.stats[layer] = (float(report.density.mean()), float(report.recall.mean()))
        if self.masked:
            return masked_sparse_attention(q, k, v, index, scale)
        return vertical_slash_attention(q, k, v, index, softmax_scale=scale)

    def mean_density(self) -> float:
        """Mean density over the layers of the latest prefill (dense layers count as 1)."""
        return sum(d for d, _ in self.stats.values()) / max(len(self.stats), 1)

    def mean_recall(self) -> float:
        """Mean observed recall over the layers of the latest prefill (dense layers count as 1)."""
        return sum(r for _, r in self.stats.values()) / max(len(self.stats), 1)


def eval_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    eval_attention: EvalAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q ``[B, Hq, N, D]``, k/v ``[B, Hkv, Nk, D]`` in, ``[B, N, Hq, D]`` out."""
    if eval_attention is None:
        raise ValueError(
            f'attn_implementation="{NAME}" needs its settings: call the model with eval_attention=EvalAttention(...)'
        )
    if query.shape[0] != 1:
        raise ValueError(f"{NAME!r} evaluates one sequence at a time; got batch {query.shape[0]}")
    if attention_mask is not None:  # a padding mask (whole_sequences_mask drops all-ones ones)
        raise ValueError(
            f'attn_implementation="{NAME}" evaluates whole sequences and takes no padding mask; pass the sequence '
            "unpadded"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return eval_attention.attend(module.layer_idx, q, k, v, scale), None


AttentionInterface.register(NAME, eval_attention_forward)
AttentionMaskInterface.register(NAME, whole_sequences_mask)
