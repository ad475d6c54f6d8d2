"""Merging partial attention results computed over disjoint key sets (ring steps, kernel passes), and the check of
the buffers a ring step's backward adds its gradients into."""

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


def check_gradient_buffers(
    q: torch.Tensor,
    k: torch.Tensor,
    delta: torch.Tensor | None,
    dq: torch.Tensor | None,
    dkv: torch.Tensor | None,
    caller: str,
) -> None:
    """Raise ``ValueError`` naming ``caller`` unless the backward's optional buffers fit q ``[B, N, Hq, D]`` and
    k ``[B, N_kv, Hkv, D]``, each in the compute dtype (fp32; fp64 for fp64 inputs): ``delta`` ``[B, Hq, N]``
    contiguous (``rowsum(dO * out)``, which a ring computes once for all its steps), ``dq`` shaped and strided like q
    (a running dq the call adds into), ``dkv`` ``[2, B, N_kv, Hkv, D]`` with unit stride in the head dim (the call
    writes dk and dv into it)."""
    b, n, hq, d = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    if delta is not None and (delta.dtype != compute or delta.shape != (b, hq, n) or not delta.is_contiguous()):
        raise ValueError(
            f"{caller}: delta must be {compute} {(b, hq, n)} contiguous; got {delta.dtype} {tuple(delta.shape)}"
        )
    if dq is not None and (dq.dtype != compute or dq.shape != q.shape or dq.stride() != q.stride()):
        raise ValueError(
            f"{caller}: dq must be {compute} with q's shape {tuple(q.shape)} and strides {q.stride()} "
            f"(torch.zeros_like(q, dtype={compute})); got {dq.dtype} {tuple(dq.shape)} strides {dq.stride()}"
        )
    want = (2, *k.shape)
    if dkv is not None and (dkv.dtype != compute or dkv.shape != want or dkv.stride(-1) != 1):
        raise ValueError(
            f"{caller}: dkv must be {compute} {want} with unit last stride; got {dkv.dtype} {tuple(dkv.shape)}"
        )
