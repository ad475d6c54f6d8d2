"""The dense and FlexAttention baselines the sparse kernels are measured against."""

from __future__ import annotations

import contextlib

import torch

from ds_mtraining.sparse.index import VerticalSlashIndex


def flex_block_mask(index: VerticalSlashIndex, seqlen: int):
    """FlexAttention's ``BlockMask`` of the tiles our kernels touch (every slash tile, plus every tile holding a
    column no slash tile covers, computed whole; the causal mask on the diagonal tiles only), and the fraction of
    the causal tiles it holds (mean over batch and heads). Tiles are the index's blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, nb = index.block_size, index.num_blocks(seqlen)
    offm = index.offset_mask(seqlen)  # [B, H, nb]
    i = torch.arange(nb, device=offm.device)
    rel = i[:, None] - i[None, :]  # i - j
    causal = rel >= 0
    slash = offm.gather(-1, rel.clamp(min=0).flatten().expand(*offm.shape[:2], -1)).view(*offm.shape[:2], nb, nb)
    colmask = index.column_mask(seqlen)
    pad = nb * bs - seqlen
    tilecol = torch.nn.functional.pad(colmask, (0, pad)).view(*colmask.shape[:2], nb, bs).any(-1)  # [B, H, nb]
    blocks = causal & (slash | tilecol[:, :, None, :])
    full = blocks & (rel > 0)
    full_num = full.sum(-1, dtype=torch.int32)
    full_idx = torch.argsort(full.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    diag_num = torch.ones_like(full_num)
    diag_idx = i.to(torch.int32)[:, None].expand(*full.shape).contiguous()

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = BlockMask.from_kv_blocks(
        diag_num, diag_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=causal_mod, seq_lengths=(seqlen, seqlen)
    )
    tiles = blocks.float().sum((-1, -2)).mean().item() / (nb * (nb + 1) / 2)
    return mask, tiles


def as_batch(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, N, H, D]`` -> ``[N / length, length, H, D]``: a row of equal documents as a batch."""
    return x.reshape(-1, length, *x.shape[2:])


def dense_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """Causal SDPA over a row of equal documents of ``length`` tokens taken as a batch, which is the dense varlen
    attention exactly: q ``[1, N, Hq, D]``, k / v ``[1, N, Hkv, D]`` -> ``[1, N, Hq, D]``. cuDNN's kernel on a GPU
    (the dense baseline of the results), PyTorch's choice on CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qb, kb, vb = (as_batch(x, length).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if q.is_cuda else contextlib.nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


DENSE_VARLEN_TARGET = 0.6
"""Issue 26's target on packed rows: ours fwd+bwd at least ``DENSE_VARLEN_TARGET / density`` times faster than dense
varlen cuDNN."""
