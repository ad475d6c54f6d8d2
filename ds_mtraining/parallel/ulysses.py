"""Ulysses: a differentiable all-to-all that trades a sequence split for a head split, GQA-aware.

Before attention each of the ``U`` ranks of a Ulysses group holds a contiguous chunk of its ring shard for all
heads, ``[B, n, H, D]``; :func:`scatter_heads` gives every rank the whole ring shard for ``H / U`` heads,
``[B, U * n, H / U, D]`` (rank ``u`` gets heads ``u * H / U ...``), and :func:`gather_heads` undoes it on the
attention output. The backward of one all-to-all is the other. Key/value heads: when ``U`` divides ``Hkv``
they are split like the query heads; when ``Hkv`` divides ``U`` each is first repeated ``U / Hkv`` times
(``repeat_interleave``, so query head ``h`` still reads the copy of kv head ``h // (Hq / Hkv)``); the
repeats' gradients sum back in the backward. An all-to-all that passes the group's timeout raises
``comm.CommTimeoutError`` naming it, its peers and the layer (``layer=``, default ``comm.current_layer()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import current_layer, deadline

__all__ = ["all_to_all", "gather_heads", "scatter_heads"]


def _all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, what: str, layer: int | None
) -> torch.Tensor:
    size = dist.get_world_size(group)
    # One buffer of the pieces end to end and all_to_all_single: gloo has only that form before the list form came
    # (pytorch#88245, merged 2026-04): torch 2.11's gloo raised "Backend gloo does not support alltoall". NCCL has both.
    pieces = torch.stack(x.chunk(size, dim=scatter_dim))
    received = torch.empty_like(pieces)
    with deadline(f"Ulysses all-to-all ({what})", group=group, layer=layer):
        dist.all_to_all_single(received, pieces, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, what, layer):
        ctx.args = (scatter_dim, gather_dim, group, what, layer)
        return _all_to_all(x, scatter_dim, gather_dim, group, f"{what}, forward", layer)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group, what, layer = ctx.args
        grad = _all_to_all(grad.contiguous(), gather_dim, scatter_dim, group, f"{what}, backward", layer)
        return grad, None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    *,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup,
    what: str = "all-to-all",
    layer: int | None = None,
) -> torch.Tensor:
    """Split ``x`` into ``|group|`` chunks along ``scatter_dim``, send chunk ``i`` to rank ``i``, and concatenate
    what arrives (in rank order) along ``gather_dim``; differentiable (the backward swaps the two dims). ``what``
    and ``layer`` name it in a ``CommTimeoutError``."""
    if x.shape[scatter_dim] % dist.get_world_size(group):
        raise ValueError(
            f"all_to_all: dim {scatter_dim} of {tuple(x.shape)} does not split over {dist.get_world_size(group)} ranks"
        )
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, what, layer)


def scatter_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, n, H, D]`` sequence chunks -> ``[B, U * n, H / U, D]`` head groups, for q and (GQA-aware) k, v."""
    size = dist.get_world_size(group)
    hq, hkv = q.shape[2], k.shape[2]
    if hq % size or (hkv % size and size % hkv):
        raise ValueError(
            f"Ulysses over {size} ranks needs {size} | Hq and ({size} | Hkv or Hkv | {size}); got Hq={hq}, Hkv={hkv}"
        )
    if hkv % size:
        k, v = (x.repeat_interleave(size // hkv, dim=2) for x in (k, v))
    layer = current_layer(layer)
    return tuple(  # type: ignore[return-value]
        all_to_all(x, scatter_dim=2, gather_dim=1, group=group, what=f"scatter {name} heads", layer=layer)
        for name, x in zip("qkv", (q, k, v))
    )


def gather_heads(out: torch.Tensor, *, group: dist.ProcessGroup, layer: int | None = None) -> torch.Tensor:
    """``[B, U * n, H / U, D]`` -> ``[B, n, H, D]``: the inverse of :func:`scatter_heads` on the query side."""
    layer = current_layer(layer)
    return all_to_all(out, scatter_dim=1, gather_dim=2, group=group, what="gather heads", layer=layer)
