"""Vertical-slash attention through flash-attn-4's block-sparse kernels (``flash_attn.cute``, Hopper): the ways
issue 42's probe (``benchmarks.flash4_probe``) measures.

Imports flash-attn-4 (and with it ``nvidia-cutlass-dsl``) at module import: import this module only where it is
installed. The lists come from ``benchmarks.flash4.blocks``; here are the ``mask_mod`` functions (CuTe DSL, compiled
by flash-attn-4 on first use, a few seconds per shape family) and the calls. Why flash-attn-4 at all: its SM90
forward and backward are a maintained FA3-class Hopper kernel (warp-specialised, wgmma, TMA) with block sparsity,
where our Triton kernels reach about 0.66 of cuDNN's speed per tile. It stays a benchmark: on the planted index its
best way is 1.20x ours, short of the issue's 1.25x gate (``benchmarks/results/2026-12-05-h200-flash4_probe.md``).

The ways to serve the columns:

- :func:`merged_attention`: the slash part in one call over ``k, v`` (GQA kept), the columns in a second call over
  the gathered ``[B, C, Hq, D]`` rows, the two merged by log-sum-exp (autograd through the merge; the gather's
  backward adds the columns' dk/dv to their keys);
- :func:`joined_attention`: one call over ``k, v`` expanded to ``Hq`` heads with each head's gathered columns
  appended after the ``nb * 128`` (padded) keys, one ``mask_mod`` for both parts;
- either with ``table=True``: the column rule read from a (query block, column) table, one load per entry;
- :func:`hybrid_attention`: flash-attn-4 on the off-diagonal slash tiles only (full blocks, no ``mask_mod``), our
  Triton kernels on the diagonal tiles and the columns, merged as ring steps merge.
"""

from __future__ import annotations

import cutlass
import torch
from cutlass import cute
from flash_attn.cute import utils
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd, flash_attn_func

from benchmarks.flash4.blocks import BLOCK, BlockLists, column_blocks, column_table, joined_blocks, slash_lists
from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.triton import KernelIndex, vertical_slash_backward, vertical_slash_forward


@cute.jit
def _causal(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
    """The diagonal tile: key at or before the query."""
    return n_idx <= m_idx


@cute.jit
def _columns(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
    """A gathered column: at or before the query, and not in a slash tile the query attends
    (``blocks.column_attended``)."""
    positions, blocked = aux_tensors[0], aux_tensors[1]
    pos = utils.scalar_to_ssa(positions[batch[0], head[0], n_idx[0]], cutlass.Int32)
    block = utils.scalar_to_ssa(BLOCK, cutlass.Int32)
    base = utils.scalar_to_ssa(cute.ceil_div(seqlen_info.seqlen_q, BLOCK), cutlass.Int32)
    slot = m_idx // block - pos // block + base
    hit = utils.scalar_to_ssa(blocked[batch[0], head[0], slot[0]], cutlass.Int32)
    return (pos <= m_idx) & (hit == utils.scalar_to_ssa(0, cutlass.Int32))


@cute.jit
def _joined(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
    """One call over ``[keys padded to nb * 128 | gathered columns]``: causal on the keys' (diagonal) tiles,
    :func:`_columns`'s rule on the columns (``positions`` is the identity on the keys)."""
    positions, blocked = aux_tensors[0], aux_tensors[1]
    pos = utils.scalar_to_ssa(positions[batch[0], head[0], n_idx[0]], cutlass.Int32)
    block = utils.scalar_to_ssa(BLOCK, cutlass.Int32)
    base = utils.scalar_to_ssa(cute.ceil_div(seqlen_info.seqlen_q, BLOCK), cutlass.Int32)
    slot = m_idx // block - pos // block + base
    hit = utils.scalar_to_ssa(blocked[batch[0], head[0], slot[0]], cutlass.Int32)
    in_keys = n_idx < base * block
    return (pos <= m_idx) & (in_keys | (hit == utils.scalar_to_ssa(0, cutlass.Int32)))


@cute.jit
def _columns_table(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
    """:func:`_columns` by one load: the (query block, column) table (``blocks.column_table``)."""
    table = aux_tensors[0]
    hit = utils.scalar_to_ssa(table[batch[0], head[0], m_idx[0] // BLOCK, n_idx[0]], cutlass.Int32)
    return hit != utils.scalar_to_ssa(0, cutlass.Int32)


@cute.jit
def _joined_table(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
    """:func:`_joined` with the table on the columns: causal on the keys, one load on the columns."""
    table = aux_tensors[0]
    keys = utils.scalar_to_ssa(cute.ceil_div(seqlen_info.seqlen_q, BLOCK) * BLOCK, cutlass.Int32)
    in_columns = n_idx >= keys
    slot = cute.where(in_columns, n_idx - keys, utils.scalar_to_ssa(0, cutlass.Int32))
    hit = utils.scalar_to_ssa(table[batch[0], head[0], m_idx[0] // BLOCK, slot[0]], cutlass.Int32)
    zero = utils.scalar_to_ssa(0, cutlass.Int32)
    return (in_columns & (hit != zero)) | ((n_idx < keys) & (n_idx <= m_idx))


def _sparse(lists: BlockLists) -> BlockSparseTensorsTorch:
    return BlockSparseTensorsTorch(*lists, block_size=(BLOCK, BLOCK))


def _call(q, k, v, fwd: BlockLists, bwd: BlockLists, scale: float, mask_mod, aux=None):
    return flash_attn_func(
        q,
        k,
        v,
        softmax_scale=scale,
        mask_mod=mask_mod,
        aux_tensors=list(aux) if aux is not None else None,
        block_sparse_tensors=_sparse(fwd),
        block_sparse_tensors_bwd=_sparse(bwd),
        return_lse=True,
    )


def _gather(x: torch.Tensor, positions: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [B, N, Hkv, D]`` at ``positions [B, Hq, C]`` (clamped into the row; padding is masked) for each query
    head's KV head: ``[B, C, Hq, D]``, differentiable (the backward adds into ``x``'s rows)."""
    b, n, hkv, _ = x.shape
    group = heads // hkv
    bi = torch.arange(b, device=x.device)[:, None, None]
    hi = (torch.arange(heads, device=x.device) // group)[None, :, None]
    return x[bi, positions.clamp(max=n - 1), hi].transpose(1, 2)


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys merged: ``o [B, N, H, D]``, ``lse [B, H, N]`` fp32 (a row with no
    key in a part has lse -inf there and weight 0). Differentiable, unlike ``sparse.merge.merge_attention_`` (in
    place), so the merged way's gradient flows through it to both calls."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).transpose(1, 2)[..., None]
    w2 = torch.exp(lse2 - lse).transpose(1, 2)[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse


def slash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slash part alone (the index's columns ignored): one call over ``k, v``, GQA kept. Shapes as
    :func:`merged_attention`."""
    fwd, bwd = slash_lists(index, q.shape[1])
    return _call(q, k, v, fwd, bwd, scale, _causal)


def merged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, scale: float, *, table: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slash call + column call merged by LSE. q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]`` bf16/fp16 on CUDA; index
    ``[B, Hq, ·]`` at block 128. Returns out ``[B, N, Hq, D]`` and lse ``[B, Hq, N]`` fp32; differentiable.
    ``table``: the column mask from the (query block, column) table (one load per entry) instead of two loads."""
    n, heads = q.shape[1], q.shape[2]
    o1, lse1 = slash_attention(q, k, v, index, scale)
    cols = column_blocks(index, n)
    kc, vc = (_gather(x, cols.positions, heads) for x in (k, v))
    if table:
        mask, aux = _columns_table, (column_table(index, n, cols.positions),)
    else:
        mask, aux = _columns, cols.aux
    o2, lse2 = _call(q, kc, vc, cols.forward, cols.backward, scale, mask, aux)
    return merge(o1, lse1, o2, lse2)


def joined_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, scale: float, *, table: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call over k/v expanded to ``Hq`` heads, padded to ``nb * 128`` keys, with each head's gathered columns
    appended; same shapes and result as :func:`merged_attention`."""
    _, n, heads, _ = q.shape
    nb = -(-n // BLOCK)
    joined = joined_blocks(index, n)
    group = heads // k.shape[2]
    keys = []
    for x in (k, v):
        main = torch.nn.functional.pad(x.repeat_interleave(group, 2), (0, 0, 0, 0, 0, nb * BLOCK - n))
        keys.append(torch.cat([main, _gather(x, joined.columns, heads)], 1))
    if table:
        mask, aux = _joined_table, (column_table(index, n, joined.columns),)
    else:
        mask, aux = _joined, joined.aux
    return _call(q, keys[0], keys[1], joined.forward, joined.backward, scale, mask, aux)


def _offdiagonal_lists(index: VerticalSlashIndex, n: int) -> tuple[BlockLists, BlockLists]:
    """The slash part without the diagonal: full blocks only (the mask lists empty)."""
    fwd, bwd = slash_lists(index, n)
    empty = lambda lists: BlockLists(torch.zeros_like(lists.mask_cnt), lists.mask_idx, lists.full_cnt, lists.full_idx)
    return empty(fwd), empty(bwd)


class _Hybrid(torch.autograd.Function):
    """flash-attn-4 on the off-diagonal slash tiles + our Triton kernels on the diagonal tile and the columns (masked
    by the whole offset set, so the parts are disjoint), merged by LSE; each part's backward runs from the merged
    (out, lse), as a ring step's does, so no gradient flows through the merge."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale):
        n = q.shape[1]
        fwd, bwd = _offdiagonal_lists(index, n)
        o1, lse1 = _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=_sparse(fwd), return_lse=True)[:2]
        full = index.kernel_index(n)
        diag = KernelIndex(torch.zeros_like(full.slash[..., :1]), torch.ones_like(full.scount), *full[2:])
        # Our forward merges into the running fp32 (out, lse) in place, as a ring step does.
        out, lse = vertical_slash_forward(q, k, v, diag, scale, out=o1.float(), lse=lse1)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts = (bwd, diag, scale)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        bwd, diag, scale = ctx.parts
        do = do.contiguous()
        dq1, dk1, dv1 = _flash_attn_bwd(q, k, v, out, do, lse, softmax_scale=scale, block_sparse_tensors=_sparse(bwd))[
            :3
        ]
        dq2, dk2, dv2 = vertical_slash_backward(do, q, k, v, out, lse, diag, scale)
        return dq1 + dq2, dk1 + dk2, dv1 + dv2, None, None


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn-4 on the off-diagonal slash tiles, our kernels on the rest (see ``_Hybrid``); shapes as
    :func:`merged_attention` (the lse is not differentiable)."""
    return _Hybrid.apply(q, k, v, index, scale)
