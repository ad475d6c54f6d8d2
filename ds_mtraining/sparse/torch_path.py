"""Vertical-slash attention in plain PyTorch: the CPU path, with the same launcher API as the Triton kernels.

Algorithm, per chunk of query tiles (``bs`` rows each), batched over batch and query heads:

- slash part: the key tiles ``i - o`` of the chosen offsets ``o`` are gathered as whole blocks
  ``[B, Hq, T, Ks, bs, D]``; only the diagonal tile (``o = 0``) needs the causal triangle.
- vertical part: each head's columns ``[B, Hq, Kv, D]`` are gathered once and shared by every tile; a column
  is masked out for a query tile whose chosen tiles already hold it, so it is attended once. Such a column
  always lies in an earlier block than the query tile (offset 0 is always chosen), so no causal mask is needed.

Packed documents (``doc_start``, the first position of each query row's document): a key tile that ends before the
document of a query tile's first row is dropped from that tile's list (the lists are compacted, so a row of short
documents gathers only the tiles its documents reach), and a chunk gathers only the columns one of its rows
attends (the other documents' columns drop out); inside what is kept, ``k >= doc_start`` is masked per row.

One softmax over both parts gives the output and log-sum-exp; the backward recomputes the probabilities from
the saved lse and index-adds the key gradients back (in index order: bitwise repeatable). Memory is
O(chunk · (Ks · bs + Kv) · D), never O(N²); compute in fp32 (fp64 for fp64 inputs).

The launchers synchronise with the host (the index's used width, the chunk plan), so ``vertical_slash_attention``
runs them as ``torch.library`` custom ops (``forward_op`` / ``backward_op``, ``ds_mtraining::torch_vertical_slash_*``)
whose fake kernels give the output shapes: ``torch.compile`` then traces the attention without graph breaks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .index import VerticalSlashIndex
from .merge import check_gradient_buffers, merge_attention_
from .scale import resolve_softmax_scale

# Elements of one chunk's gathered key blocks and scores: bounds the working set (~16 MB each in fp32).
_CHUNK_ELEMENTS = 1 << 22


def _trimmed(index: VerticalSlashIndex) -> VerticalSlashIndex:
    """Drop the padding columns no row uses (canonical rows keep -1 last), so no work is spent on them."""

    def width(x: torch.Tensor) -> int:
        return int((x >= 0).sum(-1).max()) if x.numel() else 0

    return VerticalSlashIndex(
        index.vertical[..., : width(index.vertical)], index.slash[..., : width(index.slash)], index.block_size
    )


class _Masks(NamedTuple):
    """What one chunk of ``T`` query tiles gathers and masks (``_Layout.masks``)."""

    tiles: torch.Tensor
    """Local kv tiles of each query tile, LongTensor ``[B, Hq, T, Ks]`` (``Ks`` cut to the chunk under documents)."""
    tile_ok: torch.Tensor
    """Which of them are attended, Bool ``[B, Hq, T, Ks]``."""
    col_mask: torch.Tensor
    """Which columns each row attends, Bool ``[B, Hq, T, 1, Kv]`` (``[B, Hq, T, bs, Kv']`` under documents)."""
    key_ok: torch.Tensor | None = None
    """Documents: the keys of the tiles each row may see, Bool ``[B, Hq, T, bs, Ks, bs]``."""
    col_order: torch.Tensor | None = None
    """Documents: the columns gathered, positions in the vertical rows, LongTensor ``[B, Hq, Kv']``."""


class _Layout:
    """Where the index's tiles and columns are in the local q and k/v: the gather plan of one call.

    ``q_blocks`` / ``kv_blocks`` give the global block of each local tile of q and of k/v (a ring rank's
    shard under a layout, or ``arange`` on one device); offsets, the causal triangle and the columns are
    evaluated in global positions, so a call on any pair of shards computes exactly its part of the index.
    ``doc_start`` ``[B, q_len]`` (or None) is the global first position of each local query row's document.
    """

    def __init__(self, index, kv_heads: int, q_len: int, kv_len: int, q_blocks, kv_blocks, doc_start=None):
        b, heads, device = index.batch, index.heads, index.device
        self.index = _trimmed(index)
        self.bs = bs = index.block_size
        self.q_len, self.nq = q_len, -(-q_len // bs)
        self.nk = -(-kv_len // bs)
        self.q_blocks = torch.arange(self.nq, device=device) if q_blocks is None else q_blocks.to(device)
        kv_blocks = torch.arange(self.nk, device=device) if kv_blocks is None else kv_blocks.to(device)
        if self.q_blocks.shape != (self.nq,) or kv_blocks.shape != (self.nk,):
            raise ValueError(
                f"q_blocks / kv_blocks must hold one global block per local tile: expected {self.nq} and "
                f"{self.nk} entries, got {tuple(self.q_blocks.shape)} and {tuple(kv_blocks.shape)}"
            )
        self.nb = int(max(self.q_blocks.max(), kv_blocks.max())) + 1  # global blocks the maps reach
        self.offsets = index.offset_mask(self.nb * bs)
        self.kv_tile = torch.full((self.nb,), -1, dtype=torch.long, device=device)  # global block -> local tile
        self.kv_tile[kv_blocks] = torch.arange(self.nk, device=device)
        # Row of (batch, kv head of each query head) in a [B * Hkv, ...] view of k / v.
        self.kv_row = torch.arange(b, device=device)[:, None] * kv_heads + torch.arange(heads, device=device) // (
            heads // kv_heads
        )
        vertical = self.index.vertical
        col_block = vertical.div(bs, rounding_mode="floor").clamp(0, self.nb - 1)
        col_tile = self.kv_tile[col_block]
        self.col_block = torch.where(vertical >= 0, col_block, self.nb)  # never covered, never in range
        self.col_here = (vertical >= 0) & (vertical < self.nb * bs) & (col_tile >= 0)
        self.col_local = torch.where(self.col_here, col_tile * bs + vertical % bs, 0)  # [B, Hq, Kv]
        self.triangle = torch.ones(bs, bs, dtype=torch.bool, device=device).tril()
        self.doc_start = None if doc_start is None else self._tiled_starts(doc_start)

    def _tiled_starts(self, doc_start: torch.Tensor) -> torch.Tensor:
        """``doc_start [B, q_len]`` as ``[B, nq, bs]``; the padding rows past ``q_len`` repeat the last row's start."""
        b = self.index.batch
        if doc_start.shape != (b, self.q_len) or doc_start.dtype != torch.long:
            raise ValueError(
                f"doc_start must be a LongTensor [B, Nq] = [{b}, {self.q_len}] (one start per query row); got "
                f"{doc_start.dtype} {tuple(doc_start.shape)}"
            )
        pad = self.nq * self.bs - self.q_len
        doc_start = torch.cat([doc_start, doc_start[:, -1:].expand(b, pad)], dim=1) if pad else doc_start
        return doc_start.to(self.kv_tile.device).view(b, self.nq, self.bs)

    def chunks(self, head_dim: int):
        """Consecutive query-tile ranges ``(t0, t1)`` sized to ``_CHUNK_ELEMENTS``."""
        ks, kv = self.index.slash.shape[-1], self.index.vertical.shape[-1]
        per_tile = self.index.batch * self.index.heads * (ks * self.bs * head_dim + self.bs * (ks * self.bs + kv))
        step = max(1, _CHUNK_ELEMENTS // per_tile)
        for t0 in range(0, self.nq, step):
            yield t0, min(self.nq, t0 + step)

    def masks(self, t0: int, t1: int) -> _Masks:
        """The gather plan and masks of query tiles ``[t0, t1)`` (see ``_Masks``). The diagonal tile's causal
        triangle is applied by the caller (offset 0 is the first entry of every canonical slash row, and stays first
        under documents)."""
        slash = self.index.slash[:, :, None, :]
        tiles = self.q_blocks[t0:t1][None, None, :, None]  # global blocks of the query tiles
        key_block = tiles - slash
        local = self.kv_tile[key_block.clamp(0, self.nb - 1)]
        tile_ok = (slash >= 0) & (key_block >= 0) & (local >= 0)
        # A column is attended here unless a chosen tile of this query tile holds it (offset 0 always is, so
        # an attended column is in an earlier block: no causal mask needed).
        col_offset = tiles - self.col_block[:, :, None, :]
        covered = self.offsets.gather(-1, col_offset.clamp(0, self.nb - 1).flatten(2)).view(col_offset.shape)
        col_mask = (self.col_here[:, :, None, :] & (col_offset >= 0) & ~covered)[:, :, :, None, :]
        if self.doc_start is None:
            return _Masks(local.clamp(min=0), tile_ok, col_mask)
        starts = self.doc_start[:, None, t0:t1]  # [B, 1, T, bs]
        # Starts are non-decreasing inside a tile, so its first row's is the smallest: a key tile ending before it
        # is outside every row's document. Compact the kept tiles to the front and cut the list to the chunk's
        # widest, so such tiles are never gathered. Offset 0 keeps its place first (the caller's triangle goes
        # there), even where its tile is on another shard; a stable sort keeps the others in order.
        tile_ok &= (key_block + 1) * self.bs > starts[..., :1]
        keep = tile_ok.clone()
        keep[..., 0] = True
        width = int(keep.sum(-1).max())
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
        key_block, local, tile_ok = (x.gather(-1, order) for x in (key_block, local, tile_ok))
        keys = key_block[..., None] * self.bs + torch.arange(self.bs, device=key_block.device)  # [B, Hq, T, Ks, bs]
        key_ok = keys[:, :, :, None] >= starts[..., None, None]
        col_mask = col_mask & (self.index.vertical[:, :, None, None, :] >= starts[..., None])
        # Likewise the columns no row of these tiles attends (those of other documents) are not gathered.
        col_keep = col_mask.flatten(2, 3).any(2)  # [B, Hq, Kv]
        col_width = int(col_keep.sum(-1).max())
        col_order = torch.sort((~col_keep).to(torch.uint8), dim=-1, stable=True).indices[..., :col_width]
        col_mask = col_mask.gather(-1, col_order[:, :, None, None, :].expand(*col_mask.shape[:4], col_width))
        return _Masks(local.clamp(min=0), tile_ok, col_mask, key_ok, col_order)


def _blocks(x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``x [B, Hkv, N, D]`` padded to whole tiles, viewed ``[B * Hkv, tiles, bs, D]``."""
    x = F.pad(x, (0, 0, 0, layout.nk * layout.bs - x.shape[2]))
    return x.reshape(-1, layout.nk, layout.bs, x.shape[-1])


def _columns(x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Each query head's vertical columns of ``x [B, Hkv, N, D]`` (zeros where not local): ``[B, Hq, Kv, D]``."""
    flat = x.reshape(-1, x.shape[-1])
    return flat[layout.kv_row[..., None] * x.shape[2] + layout.col_local]


def _tiles(x: torch.Tensor, layout: _Layout, t0: int, t1: int, dtype: torch.dtype) -> torch.Tensor:
    """Query-side rows of tiles ``[t0, t1)`` from ``x [B, H, N, ...]``, zero-padded past N: ``[B, H, T, bs, ...]``."""
    lo, hi = t0 * layout.bs, min(layout.q_len, t1 * layout.bs)
    rows = x[:, :, lo:hi].to(dtype)
    pad = (t1 - t0) * layout.bs - rows.shape[2]
    if pad:
        rows = torch.cat([rows, rows.new_zeros(*rows.shape[:2], pad, *rows.shape[3:])], dim=2)
    return rows.view(*rows.shape[:2], t1 - t0, layout.bs, *rows.shape[3:])


def _untile(x: torch.Tensor, layout: _Layout, t0: int) -> tuple[slice, torch.Tensor]:
    """Where tiles ``x [B, H, T, bs, ...]`` go in a ``[B, H, N, ...]`` tensor, and their unpadded rows."""
    lo = t0 * layout.bs
    hi = min(layout.q_len, lo + x.shape[2] * layout.bs)
    return slice(lo, hi), x.flatten(2, 3)[:, :, : hi - lo]


class _Chunk:
    """Gathered keys/values of one chunk of query tiles and its masked scores, kept as two parts: the slash
    tiles ``[B, H, T, bs, Ks*bs]`` and the columns ``[B, H, T, bs, Kv]`` (one softmax spans both)."""

    def __init__(self, q_t, k_blocks, v_blocks, k_cols, v_cols, layout: _Layout, t0: int, t1: int, scale: float):
        key_block, tile_ok, col_mask, key_ok, self.col_order = layout.masks(t0, t1)
        kv_row = layout.kv_row[:, :, None, None]
        self.rows = kv_row * layout.nk + key_block  # rows of the [B*Hkv*nk, bs, D] view
        self.k = k_blocks[kv_row, key_block].to(q_t.dtype).flatten(3, 4)  # [B, H, T, Ks*bs, D]
        self.v = v_blocks[kv_row, key_block].to(q_t.dtype).flatten(3, 4)
        if self.col_order is not None:
            order = self.col_order[..., None].expand(*self.col_order.shape, k_cols.shape[-1])
            k_cols, v_cols = k_cols.gather(2, order), v_cols.gather(2, order)
        self.k_cols, self.v_cols = k_cols, v_cols  # [B, H, Kv, D]
        self.shape = q_t.shape
        s_slash = torch.matmul(q_t, self.k.transpose(-1, -2)).mul_(scale)
        tiles = s_slash.unflatten(-1, key_block.shape[-1:] + (layout.bs,))  # [B, H, T, bs, Ks, bs] view
        tiles.masked_fill_(~tile_ok[:, :, :, None, :, None], float("-inf"))
        tiles[..., 0, :].masked_fill_(~layout.triangle, float("-inf"))  # the diagonal tile, offset 0
        if key_ok is not None:
            tiles.masked_fill_(~key_ok, float("-inf"))
        self.s_slash = s_slash
        self.s_cols = self.by_column(q_t, k_cols.transpose(-1, -2)).mul_(scale).masked_fill_(~col_mask, float("-inf"))

    def by_column(self, x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """``x [B, H, T, bs, ·]`` times per-head ``columns [B, H, ·, ·]``, as one matmul over all the rows."""
        out = torch.matmul(x.flatten(2, 3), columns)
        return out.view(*x.shape[:4], out.shape[-1])

    def product(self, p_slash, p_cols, blocks: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Probabilities (or dS) times gathered rows (``P @ V``, ``dS @ K``): ``[B, H, T, bs, D]``."""
        return torch.matmul(p_slash, blocks).add_(self.by_column(p_cols, columns))


def _prepare(q, k, v, index, compute, q_blocks, kv_blocks, doc_start):
    layout = _Layout(index, k.shape[2], q.shape[1], k.shape[1], q_blocks, kv_blocks, doc_start)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    k_blocks, v_blocks = _blocks(kt, layout), _blocks(vt, layout)
    k_cols, v_cols = _columns(kt, layout).to(compute), _columns(vt, layout).to(compute)
    return layout, qt, k_blocks, v_blocks, k_cols, v_cols


def vertical_slash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    q_blocks: torch.Tensor | None = None,
    kv_blocks: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward. q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D]``, same float dtype.

    Returns out ``[B, Nq, Hq, D]`` in q's dtype and lse ``[B, Hq, Nq]`` fp32 (fp64 for fp64 inputs; ``-inf`` for rows that attend
    nothing here). When a running fp32 ``out`` and ``lse`` are given, the result is merged into them in place
    (see ``merge_attention_``) and they are returned. ``q_blocks`` / ``kv_blocks`` (LongTensor, one global block
    id per local tile; default ``arange``) place q and k/v in the global sequence, for a ring step on shards.
    ``doc_start`` (LongTensor ``[B, Nq]``, global positions; ``Documents.starts`` on one device) keeps each query
    row inside its document: keys before its document's first token are not attended. ``softmax_scale``: None for
    ``1 / sqrt(D)``, else positive and finite, as the Triton launcher's (both check it the same way).
    """
    b, n, heads, dim = q.shape
    softmax_scale = resolve_softmax_scale(softmax_scale, dim, "vertical_slash_forward")
    compute = torch.promote_types(q.dtype, torch.float32)
    layout, qt, k_blocks, v_blocks, k_cols, v_cols = _prepare(q, k, v, index, compute, q_blocks, kv_blocks, doc_start)
    block_out = torch.empty(b, heads, n, dim, dtype=compute, device=q.device)
    block_lse = torch.empty(b, heads, n, dtype=compute, device=q.device)
    for t0, t1 in layout.chunks(dim):
        q_t = _tiles(qt, layout, t0, t1, compute)
        chunk = _Chunk(q_t, k_blocks, v_blocks, k_cols, v_cols, layout, t0, t1, softmax_scale)
        row_max = chunk.s_slash.amax(-1, keepdim=True)
        if chunk.s_cols.shape[-1]:
            row_max = torch.maximum(row_max, chunk.s_cols.amax(-1, keepdim=True))
        row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)  # rows with no key: p = 0, lse = -inf
        p_slash, p_cols = chunk.s_slash.sub_(row_max).exp_(), chunk.s_cols.sub_(row_max).exp_()
        total = p_slash.sum(-1, keepdim=True) + p_cols.sum(-1, keepdim=True)
        o_t = chunk.product(p_slash, p_cols, chunk.v, chunk.v_cols).div_(total.clamp(min=torch.finfo(compute).tiny))
        rows, o_rows = _untile(o_t, layout, t0)
        block_out[:, :, rows] = o_rows
        block_lse[:, :, rows] = _untile((row_max + total.log())[..., 0], layout, t0)[1]
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
    softmax_scale: float | None = None,
    *,
    q_blocks: torch.Tensor | None = None,
    kv_blocks: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dkv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients: dq ``[B, Nq, Hq, D]`` (this call's share), dk/dv ``[B, Nk, Hkv, D]``, in the inputs' dtypes.

    ``do`` ``[B, Nq, Hq, D]``; ``out`` and ``lse`` are the *final* output and lse of the rows (after any merging),
    so the same call on a pair of shards gives a ring step's share of the gradient. ``q_blocks`` / ``kv_blocks`` and
    ``doc_start`` as in the forward. ``delta`` (:func:`backward_delta`), ``dq`` (a running fp32 dq added into) and
    ``dkv`` (``[2, B, Nk, Hkv, D]`` written), in the compute dtype (fp32; fp64 for fp64 inputs), as the Triton
    launcher's: what a ring's steps share.
    """
    check_gradient_buffers(q, k, delta, dq, dkv, "vertical_slash_backward")
    b, n, heads, dim = q.shape
    softmax_scale = resolve_softmax_scale(softmax_scale, dim, "vertical_slash_backward")
    compute = torch.promote_types(q.dtype, torch.float32)
    layout, qt, k_blocks, v_blocks, k_cols, v_cols = _prepare(q, k, v, index, compute, q_blocks, kv_blocks, doc_start)
    dot = do.transpose(1, 2)
    if delta is None:
        delta = backward_delta(do, out)
    grad_q = torch.empty(b, heads, n, dim, dtype=compute, device=q.device)
    dk_blocks = torch.zeros(k_blocks.shape, dtype=compute, device=q.device)
    dv_blocks = torch.zeros(v_blocks.shape, dtype=compute, device=q.device)
    dk_cols = torch.zeros(k_cols.shape, dtype=compute, device=q.device)
    dv_cols = torch.zeros(v_cols.shape, dtype=compute, device=q.device)
    for t0, t1 in layout.chunks(dim):
        q_t, do_t = _tiles(qt, layout, t0, t1, compute), _tiles(dot, layout, t0, t1, compute)
        lse_t = _tiles(lse[..., None], layout, t0, t1, compute)
        delta_t = _tiles(delta[..., None], layout, t0, t1, compute)
        chunk = _Chunk(q_t, k_blocks, v_blocks, k_cols, v_cols, layout, t0, t1, softmax_scale)
        lse_t = torch.where(torch.isneginf(lse_t), 0.0, lse_t)
        p_slash, p_cols = chunk.s_slash.sub_(lse_t).exp_(), chunk.s_cols.sub_(lse_t).exp_()
        ds_slash = torch.matmul(do_t, chunk.v.transpose(-1, -2)).sub_(delta_t).mul_(p_slash).mul_(softmax_scale)
        ds_cols = chunk.by_column(do_t, chunk.v_cols.transpose(-1, -2)).sub_(delta_t).mul_(p_cols).mul_(softmax_scale)
        rows, dq_rows = _untile(chunk.product(ds_slash, ds_cols, chunk.k, chunk.k_cols), layout, t0)
        grad_q[:, :, rows] = dq_rows
        # index_add_ accumulates in index order on CPU: bitwise-repeatable dk/dv.
        block_rows = chunk.rows.flatten()
        for grad, weights, x in ((dk_blocks, ds_slash, q_t), (dv_blocks, p_slash, do_t)):
            grad.view(-1, layout.bs, dim).index_add_(
                0, block_rows, torch.matmul(weights.transpose(-1, -2), x).view(-1, layout.bs, dim)
            )
        dk_chunk = torch.matmul(ds_cols.flatten(2, 3).transpose(-1, -2), q_t.flatten(2, 3))
        dv_chunk = torch.matmul(p_cols.flatten(2, 3).transpose(-1, -2), do_t.flatten(2, 3))
        if chunk.col_order is None:
            dk_cols += dk_chunk
            dv_cols += dv_chunk
        else:  # the chunk's columns are a permutation's prefix: distinct targets, so the sum order is fixed
            order = chunk.col_order[..., None].expand_as(dk_chunk)
            dk_cols.scatter_add_(2, order, dk_chunk)
            dv_cols.scatter_add_(2, order, dv_chunk)
    # Columns back into their rows of the [B * Hkv * N_padded, D] view; masked columns carry zeros.
    col_rows = (layout.kv_row[..., None] * layout.nk * layout.bs + layout.col_local).flatten()
    dk_blocks.view(-1, dim).index_add_(0, col_rows, dk_cols.reshape(-1, dim))
    dv_blocks.view(-1, dim).index_add_(0, col_rows, dv_cols.reshape(-1, dim))
    hkv = k.shape[2]
    dk = dk_blocks.view(b, hkv, -1, dim)[:, :, : k.shape[1]].transpose(1, 2)
    dv = dv_blocks.view(b, hkv, -1, dim)[:, :, : k.shape[1]].transpose(1, 2)
    grad_q = grad_q.transpose(1, 2)
    dq = grad_q.to(q.dtype) if dq is None else dq.add_(grad_q)
    if dkv is None:
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    dkv[0].copy_(dk)
    dkv[1].copy_(dv)
    return dq, dkv[0], dkv[1]


def backward_delta(do: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * out)`` ``[B, Hq, N]`` (fp32; fp64 for fp64 inputs) of ``do`` and ``out`` ``[B, N, Hq, D]``."""
    compute = torch.promote_types(out.dtype, torch.float32)
    return (do.to(compute) * out.to(compute)).sum(-1).transpose(1, 2).contiguous()


def index_tensors(index: VerticalSlashIndex, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The index tensors this path's ops take: ``(vertical, slash)`` as they are (``seqlen`` is not needed)."""
    return index.vertical, index.slash


# The ops' outputs are contiguous: the launchers' own layouts depend on the dtype and on N % bs, and a fake kernel
# must give the real layout (a compiled graph reads the outputs with the fake's strides).
@torch.library.custom_op("ds_mtraining::torch_vertical_slash_forward", mutates_args=())
def forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    block_size: int,
    softmax_scale: float,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vertical_slash_forward`` on one device: out ``[B, N, Hq, D]`` (q's dtype, contiguous) and lse ``[B, Hq, N]``
    (fp32; fp64 for fp64 inputs) of the index ``(vertical, slash, block_size)``, inside the documents of
    ``doc_start`` ``[B, N]`` if given."""
    index = VerticalSlashIndex(vertical, slash, block_size)
    out, lse = vertical_slash_forward(q, k, v, index, softmax_scale, doc_start=doc_start)
    return out.contiguous(), lse


@forward_op.register_fake
def _forward_fake(q, k, v, vertical, slash, block_size, softmax_scale, doc_start=None):
    b, n, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, heads, n), dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("ds_mtraining::torch_vertical_slash_backward", mutates_args=())
def backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    block_size: int,
    softmax_scale: float,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``vertical_slash_backward`` on one device: dq ``[B, N, Hq, D]``, dk, dv ``[B, N, Hkv, D]``, in the inputs'
    dtypes, contiguous."""
    index = VerticalSlashIndex(vertical, slash, block_size)
    grads = vertical_slash_backward(do, q, k, v, out, lse, index, softmax_scale, doc_start=doc_start)
    return tuple(x.contiguous() for x in grads)


@backward_op.register_fake
def _backward_fake(do, q, k, v, out, lse, vertical, slash, block_size, softmax_scale, doc_start=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _column_mask(index: VerticalSlashIndex, q_blocks: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """Which columns each query tile (global blocks ``q_blocks [T]``) attends: Bool ``[B, Hq, T, 1, Kv]``, or
    ``[B, Hq, T, bs, Kv]`` with the tile rows' document starts ``starts`` ``[B, T, bs]``.

    Column ``c`` is attended by tile ``i`` unless a chosen tile of ``i`` holds it (offset 0 always is, so the
    column lies in an earlier block and no causal mask is needed), and by a row only from its document on.
    """
    bs, nb = index.block_size, int(q_blocks.max()) + 1
    col = index.vertical[:, :, None, :]
    col_offset = q_blocks[None, None, :, None] - col.div(bs, rounding_mode="floor")
    covered = index.offset_mask(nb * bs).gather(-1, col_offset.clamp(0, nb - 1).flatten(2)).view(col_offset.shape)
    mask = ((col >= 0) & (col_offset >= 0) & ~covered)[:, :, :, None, :]
    return mask if starts is None else mask & (col[:, :, :, None, :] >= starts[:, None, :, :, None])


def _tile_starts(doc_start: torch.Tensor | None, rows: torch.Tensor, tiles: int, bs: int) -> torch.Tensor | None:
    """The document starts of the gathered rows as ``[B, T, bs]`` (None without documents)."""
    return None if doc_start is None else doc_start[:, rows].view(doc_start.shape[0], tiles, bs)


def _tile_rows(tiles: torch.Tensor, bs: int, seqlen: int) -> torch.Tensor:
    if seqlen % bs:
        raise ValueError(f"gathered-column attention needs whole tiles: {seqlen} rows is not a multiple of {bs}")
    return (tiles[:, None] * bs + torch.arange(bs, device=tiles.device)).flatten()


def gathered_columns_forward(
    q: torch.Tensor,
    k_cols: torch.Tensor,
    v_cols: torch.Tensor,
    index: VerticalSlashIndex,
    softmax_scale: float,
    *,
    tiles: torch.Tensor,
    q_blocks: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_start: torch.Tensor | None = None,
) -> None:
    """Attention of some query tiles over each head's vertical columns, merged into the running (out, lse).

    The column part of the index on its own, for a ring that gathers the few columns' K/V once instead of
    meeting each column with its shard (its slash part then runs with an empty vertical set).

    Args:
        q: ``[B, n, Hq, D]`` (``n`` a multiple of the block size).
        k_cols, v_cols: ``[B, Hq, Kv, D]``, the K/V rows of ``index.vertical`` (zeros at -1 padding).
        tiles: LongTensor ``[T]``, the local query tiles to compute.
        q_blocks: LongTensor ``[n / bs]``, global block of every local query tile.
        out, lse: running ``[B, n, Hq, D]`` / ``[B, Hq, n]`` (fp32, or fp64 for fp64 inputs), updated in place.
        doc_start: LongTensor ``[B, n]``, the local rows' document starts (global positions), or None.
    """
    if tiles.numel() == 0:
        return
    rows = _tile_rows(tiles, index.block_size, q.shape[1])
    b, _, heads, dim = q.shape
    q_t = q[:, rows].to(out.dtype).transpose(1, 2).reshape(b, heads, tiles.numel(), index.block_size, dim)
    scores = torch.einsum("bhtrd,bhcd->bhtrc", q_t, k_cols.to(out.dtype)) * softmax_scale
    starts = _tile_starts(doc_start, rows, tiles.numel(), index.block_size)
    scores = scores.masked_fill(~_column_mask(index, q_blocks[tiles], starts), float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    p = torch.exp(scores - row_max)
    total = p.sum(-1, keepdim=True)
    block_out = torch.einsum("bhtrc,bhcd->bhtrd", p, v_cols.to(out.dtype)) / total.clamp(
        min=torch.finfo(out.dtype).tiny
    )
    block_lse = (row_max + total.log())[..., 0]
    out_rows, lse_rows = out[:, rows], lse[..., rows]
    merge_attention_(out_rows, lse_rows, block_out.flatten(2, 3).transpose(1, 2), block_lse.flatten(2))
    out[:, rows], lse[..., rows] = out_rows, lse_rows


def gathered_columns_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k_cols: torch.Tensor,
    v_cols: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    index: VerticalSlashIndex,
    softmax_scale: float,
    *,
    tiles: torch.Tensor,
    q_blocks: torch.Tensor,
    dq: torch.Tensor,
    dk_cols: torch.Tensor,
    dv_cols: torch.Tensor,
    doc_start: torch.Tensor | None = None,
) -> None:
    """Gradients of :func:`gathered_columns_forward` for ``tiles``, added in place into ``dq`` ``[B, n, Hq, D]``
    and ``dk_cols`` / ``dv_cols`` ``[B, Hq, Kv, D]`` (compute dtype). ``out``, ``lse``: the rows' final values;
    ``doc_start`` as in the forward."""
    if tiles.numel() == 0:
        return
    rows = _tile_rows(tiles, index.block_size, q.shape[1])
    b, _, heads, _ = q.shape
    compute = dq.dtype

    def tiled(x: torch.Tensor) -> torch.Tensor:
        return x[:, rows].to(compute).transpose(1, 2).reshape(b, heads, tiles.numel(), index.block_size, -1)

    q_t, do_t = tiled(q), tiled(do)
    delta = (do_t * tiled(out)).sum(-1, keepdim=True)
    lse_t = lse[..., rows].to(compute).reshape(b, heads, tiles.numel(), index.block_size, 1)
    kc, vc = k_cols.to(compute), v_cols.to(compute)
    scores = torch.einsum("bhtrd,bhcd->bhtrc", q_t, kc) * softmax_scale
    starts = _tile_starts(doc_start, rows, tiles.numel(), index.block_size)
    scores = scores.masked_fill(~_column_mask(index, q_blocks[tiles], starts), float("-inf"))
    p = torch.exp(scores - torch.where(torch.isneginf(lse_t), 0.0, lse_t))
    ds = p * (torch.einsum("bhtrd,bhcd->bhtrc", do_t, vc) - delta) * softmax_scale
    dq[:, rows] += torch.einsum("bhtrc,bhcd->bhtrd", ds, kc).flatten(2, 3).transpose(1, 2)
    dk_cols += torch.einsum("bhtrc,bhtrd->bhcd", ds, q_t)
    dv_cols += torch.einsum("bhtrc,bhtrd->bhcd", p, do_t)


def planned_work(
    index: VerticalSlashIndex,
    q_len: int,
    kv_len: int,
    *,
    q_blocks: torch.Tensor | None = None,
    kv_blocks: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a :func:`vertical_slash_forward` call with these arguments attends, counted from its own gather plan
    (``_Layout.masks``), per local query tile and summed over batch and heads: slash tiles (the diagonal one as one)
    and column work in tile units (columns a tile attends / ``bs``); float64 ``[ceil(q_len / bs)]`` each.

    ``q_len`` / ``kv_len`` are the local q and k/v lengths; the other arguments as in the forward (``doc_start``
    ``[B, q_len]``). The ring's instrumentation (``parallel.ring.RingTrace``) counts its steps with it; the backward
    walks the same plan.
    """
    layout = _Layout(index, index.heads, q_len, kv_len, q_blocks, kv_blocks, doc_start)
    tiles = torch.zeros(layout.nq, dtype=torch.float64)
    columns = torch.zeros(layout.nq, dtype=torch.float64)
    for t0, t1 in layout.chunks(1):
        plan = layout.masks(t0, t1)
        tiles[t0:t1] = plan.tile_ok.sum((0, 1, 3)).double().cpu()
        columns[t0:t1] = plan.col_mask.any(3).sum((0, 1, 3)).double().cpu() / layout.bs
    return tiles, columns


def planned_column_work(
    index: VerticalSlashIndex, tiles: torch.Tensor, q_blocks: torch.Tensor, doc_start: torch.Tensor | None = None
) -> torch.Tensor:
    """What :func:`gathered_columns_forward` attends for local query ``tiles`` ``[T]`` (``q_blocks``, ``doc_start``
    as there), counted from its column mask: column work in tile units per tile, summed over batch and heads,
    float64 ``[T]``."""
    if tiles.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    bs = index.block_size
    starts = None
    if doc_start is not None:
        starts = _tile_starts(doc_start, _tile_rows(tiles, bs, doc_start.shape[1]), tiles.numel(), bs)
    mask = _column_mask(index, q_blocks[tiles], starts)  # [B, Hq, T, 1 or bs, Kv]
    return mask.any(3).sum((0, 1, 3)).double().cpu() / bs
