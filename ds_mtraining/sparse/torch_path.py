"""Vertical-slash attention in plain PyTorch: the CPU path, with the same launcher API as the Triton kernels.

Algorithm: query tiles of ``bs`` rows are processed a chunk at a time. For each (batch, query head, query
tile) the keys it may attend are gathered into one padded list: the ``bs`` keys of every slash tile
(key block ``i - o`` for each offset ``o``) followed by the vertical columns that no chosen tile of this
query tile already covers. One dense softmax over that list, with the causal mask applied per row, gives the
output and log-sum-exp. The backward recomputes the probabilities from the saved lse and scatter-adds the
key gradients back. Memory is O(chunk · (Ks · bs + Kv) · D), never O(N²); compute is in fp32 (fp64 for
fp64 inputs), accumulation of dk/dv in that dtype.
"""

from __future__ import annotations

import torch

from .index import VerticalSlashIndex
from .merge import merge_attention_

# Elements of one chunk's gathered keys (B · Hq · tiles · keys-per-tile · D): bounds the working set.
_CHUNK_ELEMENTS = 1 << 24


class _KeyPlan:
    """Gathered key positions ``[B, Hq, T, L]`` for the query tiles ``[t0, t1)`` and their validity mask."""

    def __init__(self, index: VerticalSlashIndex, offsets: torch.Tensor, seqlen: int, t0: int, t1: int):
        bs, device = index.block_size, index.device
        tiles = torch.arange(t0, t1, device=device)[None, None, :, None]  # query block i
        # Slash part: the whole key tile i - o of every chosen offset o.
        key_block = tiles - index.slash[:, :, None, :]
        tile_ok = (index.slash[:, :, None, :] >= 0) & (key_block >= 0)
        slash_keys = (key_block[..., None] * bs + torch.arange(bs, device=device)).flatten(-2)
        slash_ok = tile_ok[..., None].expand(*tile_ok.shape, bs).flatten(-2) & (slash_keys < seqlen)
        # Vertical part: a column already inside a chosen tile of this query tile is attended there, not twice.
        col = index.vertical[:, :, None, :]
        col_offset = tiles - col.div(bs, rounding_mode="floor")
        covered = offsets.gather(-1, col_offset.clamp(0, offsets.shape[-1] - 1).flatten(2)).view(col_offset.shape)
        col_ok = (col >= 0) & (col_offset >= 0) & ~covered
        self.keys = torch.cat([slash_keys, col.expand_as(col_offset)], dim=-1).clamp(0, seqlen - 1)
        self.valid = torch.cat([slash_ok, col_ok], dim=-1)
        self.rows = torch.arange(t0 * bs, t1 * bs, device=device).view(t1 - t0, bs)  # query positions
        self.lo, self.hi = t0 * bs, min(seqlen, t1 * bs)  # the real (unpadded) query rows


def _trimmed(index: VerticalSlashIndex) -> VerticalSlashIndex:
    """Drop the padding columns no row uses (canonical rows keep -1 last), so no work is spent on them."""
    width = lambda x: int((x >= 0).sum(-1).max()) if x.numel() else 0  # noqa: E731
    return VerticalSlashIndex(index.vertical[..., : width(index.vertical)], index.slash[..., : width(index.slash)],
                              index.block_size)


def _chunks(index: VerticalSlashIndex, seqlen: int, head_dim: int):
    index = _trimmed(index)
    nb = index.num_blocks(seqlen)
    keys_per_tile = index.slash.shape[-1] * index.block_size + index.vertical.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // (index.batch * index.heads * keys_per_tile * head_dim))
    offsets = index.offset_mask(seqlen)
    for t0 in range(0, nb, step):
        yield _KeyPlan(index, offsets, seqlen, t0, min(nb, t0 + step))


def _gather(x: torch.Tensor, plan: _KeyPlan, heads: int) -> torch.Tensor:
    """Rows of ``x [B, Hkv, N, D]`` at ``plan.keys`` for every query head: ``[B, Hq, T, L, D]``."""
    b, hkv = x.shape[:2]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    kv_head = (torch.arange(heads, device=x.device) // (heads // hkv))[None, :, None, None]
    return x[batch, kv_head, plan.keys]


def _tile_rows(x: torch.Tensor, plan: _KeyPlan, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``plan.rows`` of ``x [B, H, N, D|]``, zero-padded past N: ``[B, H, T, bs, ...]``."""
    t, bs = plan.rows.shape
    rows = x[:, :, plan.lo : plan.hi].to(dtype)
    pad = t * bs - rows.shape[2]
    if pad:
        rows = torch.cat([rows, rows.new_zeros(*rows.shape[:2], pad, *rows.shape[3:])], dim=2)
    return rows.view(*rows.shape[:2], t, bs, *rows.shape[3:])


def _probabilities(q_t, k_sel, plan: _KeyPlan, lse_t, scale: float):
    """Scores and, given the tile's lse ``[B, H, T, bs]``, probabilities ``[B, H, T, bs, L]``."""
    scores = torch.einsum("bhtrd,bhtld->bhtrl", q_t, k_sel) * scale
    allowed = plan.valid[:, :, :, None, :] & (plan.keys[:, :, :, None, :] <= plan.rows[None, None, :, :, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    if lse_t is None:
        lse_t = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isneginf(lse_t), 0.0, lse_t)
    return torch.exp(scores - safe[..., None]), lse_t


def vertical_slash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward. q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]``, same float dtype.

    Returns out ``[B, N, Hq, D]`` in q's dtype and lse ``[B, Hq, N]`` fp32. When a running fp32 ``out`` and
    ``lse`` are given, the result is merged into them in place (see ``merge_attention_``) and they are returned.
    """
    n, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    compute = torch.promote_types(q.dtype, torch.float32)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    block_out = torch.empty(q.shape[0], heads, n, dim, dtype=compute, device=q.device)
    block_lse = torch.empty(q.shape[0], heads, n, dtype=torch.float32, device=q.device)
    for plan in _chunks(index, n, dim):
        q_t = _tile_rows(qt, plan, compute)
        probs, lse_t = _probabilities(q_t, _gather(kt, plan, heads).to(compute), plan, None, softmax_scale)
        o_t = torch.einsum("bhtrl,bhtld->bhtrd", probs, _gather(vt, plan, heads).to(compute))
        rows = plan.hi - plan.lo
        block_out[:, :, plan.lo : plan.hi] = o_t.flatten(2, 3)[:, :, :rows]
        block_lse[:, :, plan.lo : plan.hi] = lse_t.flatten(2)[:, :, :rows].float()
    block_out = block_out.transpose(1, 2)
    if out is None:
        return block_out.to(q.dtype), block_lse
    return merge_attention_(out, lse, block_out, block_lse)


def vertical_slash_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    index: VerticalSlashIndex,
    softmax_scale: float,
    *,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the sparse attention: dq ``[B, N, Hq, D]``, dk/dv ``[B, N, Hkv, D]`` in the inputs' dtypes.

    ``out`` and ``lse`` are the *final* output and lse of the rows (after any merging), so the same call
    gives a ring step's share of the gradient. This path is always deterministic; the flag exists for the API
    shared with the Triton kernels.
    """
    del deterministic
    b, n, heads, dim = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
    delta = (do.to(compute) * out.to(compute)).sum(-1).transpose(1, 2)  # [B, Hq, N]
    dq = torch.empty(b, heads, n, dim, dtype=compute, device=q.device)
    dk = torch.zeros(kt.shape, dtype=compute, device=q.device)
    dv = torch.zeros(vt.shape, dtype=compute, device=q.device)
    hkv = k.shape[2]
    kv_row = (torch.arange(b, device=q.device)[:, None] * hkv + torch.arange(heads, device=q.device) // (heads // hkv)) * n
    for plan in _chunks(index, n, dim):
        q_t, do_t = _tile_rows(qt, plan, compute), _tile_rows(dot, plan, compute)
        lse_t, delta_t = _tile_rows(lse[..., None], plan, torch.float32)[..., 0], _tile_rows(delta[..., None], plan, compute)
        k_sel, v_sel = _gather(kt, plan, heads).to(compute), _gather(vt, plan, heads).to(compute)
        probs, _ = _probabilities(q_t, k_sel, plan, lse_t, softmax_scale)
        dprobs = torch.einsum("bhtrd,bhtld->bhtrl", do_t, v_sel)
        dscores = probs * (dprobs - delta_t) * softmax_scale
        dq_t = torch.einsum("bhtrl,bhtld->bhtrd", dscores, k_sel)
        dq[:, :, plan.lo : plan.hi] = dq_t.flatten(2, 3)[:, :, : plan.hi - plan.lo]
        # index_add_ accumulates in index order on CPU (index_put_ does not): bitwise-repeatable dk/dv.
        rows = (kv_row[:, :, None, None] + plan.keys).flatten()
        dk.view(-1, dim).index_add_(0, rows, torch.einsum("bhtrl,bhtrd->bhtld", dscores, q_t).reshape(-1, dim))
        dv.view(-1, dim).index_add_(0, rows, torch.einsum("bhtrl,bhtrd->bhtld", probs, do_t).reshape(-1, dim))
    return dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)
