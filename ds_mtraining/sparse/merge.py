"""Merging partial attention results computed over disjoint key sets (ring steps, kernel passes)."""

from __future__ import annotations

import torch


def merge_attention_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``(block_out, block_lse)`` into the running ``(out, lse)`` in place and return them.

    Args:
        out: fp32 (or fp64) ``[B, N, H, D]``, the running normalised output.
        lse: ``[B, H, N]`` in out's dtype, its log-sum-exp; ``-inf`` where no key has been seen yet.
        block_out: ``[B, N, H, D]`` (any float dtype), attention over a disjoint set of keys.
        block_lse: ``[B, H, N]``, its log-sum-exp; ``-inf`` for rows that saw no key.

    The weights are ``exp(lse_i - new_lse)``, each <= 1, so nothing overflows; rows where both sides are
    empty stay ``(0, -inf)`` instead of turning into NaN.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    empty = torch.isneginf(new_lse)
    safe = torch.where(empty, 0.0, new_lse)
    w_old = torch.where(empty, 0.0, torch.exp(lse - safe)).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(empty, 0.0, torch.exp(block_lse - safe)).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(w_new * block_out.to(out.dtype))
    lse.copy_(new_lse)
    return out, lse
