"""The forward pass: its Triton kernel and ``vertical_slash_forward``.

FlashAttention-2 style, fp32 accumulation, exp2 with the scale folded in. One program per (b·hq, BLOCK_M rows of a
query tile), heaviest tiles first: the diagonal tile (offset 0, causal mask, key-range mask for a partial last
tile), then the other slash tiles ``i - o`` for the offsets ``o <= i`` (no masking: they are full and strictly below
the diagonal), then the vertical columns in chunks of ``BLOCK_N``, loaded by gather, masked where their tile offset
is chosen (bitmap lookup). Optionally merges the result into a running fp32 ``(out, lse)`` in place (ring
accumulation; max-shifted logaddexp form).

What a program walks, for its global query tile ``i`` (``KernelIndex``): the offsets ``SLASH[bh, 1:SCNT[bh, x]]``
(``x = i``; with documents, the offsets up to the first row's document) and the columns ``COLS[bh, lo:CCNT[bh, i]]``
(``lo = 0``, or the first row's document's), ``OFFM`` (the whole index's offset bitmap) masking the columns inside a
chosen tile. With tile maps (a ring step, ``kernel_index``) the index is global, the query tile looks it up by its
global tile, and a slash tile ``i - o`` or a column whose block the k/v shard does not hold is skipped (one scalar
lookup per offset; a column's local row is read, -1 where not held: ``COLROWS``, ``KernelIndex.column_rows``). A ring
step passes the index of the shard in hand (``parallel.ring.shard_index``: ``replace_columns`` / ``replace_slash``):
``SLASH``/``SCNT`` hold only the offsets that can reach that shard (striped: one residue class mod W) and
``COLS``/``CCNT`` only its columns (``COLROWS`` their rows), ``OFFM`` whole; any superset of those gives the same
result, since every key tile and column is still looked up. A step then costs its
attended tiles, one scalar lookup per offset of its list before each query tile and, per column chunk, the chunk's
columns (masked where not attended). A ring step's program (maps, merging into a running ``(out, lse)``) with no
diagonal tile, offset or column in the shard stops before loading anything: its rows stay as they are.

With packed documents (``doc_start``, a constexpr flag: without it the kernel is compiled without them) a program
starts its offsets and its columns at the block of its first row's document, so no key tile or column chunk before
it is loaded, and masks ``k >= doc_start[q]`` in the tiles and columns it visits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..log_constants import LOG2E
from .common import check_inputs, column_chunk, query_tile, slash_kv, slash_tile
from .document_tiles import document_rows
from .kernel_index import BlockMap, KernelIndex, place
from .launch_config import launch_config

if TYPE_CHECKING:  # annotations only: importing the index here would close index -> backends -> triton -> here
    from ..index import VerticalSlashIndex


@triton.jit
def _online_update(acc, m_i, l_i, qk, v, qk_scale, GUARD: tl.constexpr):
    """One online-softmax step on unscaled scores ``qk [M, N]`` (masked with -inf) and values ``v [N, D]``;
    ``qk_scale > 0`` takes them to the log2 domain, where ``m_i`` lives.

    The scale is folded into the exponent's argument (one FMA per score, not a multiply and a subtraction); the
    row max is taken on the unscaled scores, which a positive scale keeps in order.

    GUARD: a row may have met no key yet and meet none here (all -inf); shift it by 0 instead of its -inf
    maximum so it stays (0, -inf) rather than NaN.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_ref = m_new
    if GUARD:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _fwd_tile(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    key0,
    offs_m,
    row_end,
    shift,
    key_pos,
    starts,
    here,
    N,
    stride_kn,
    stride_vn,
    qk_scale,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,
    DOCS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The online-softmax update over one slash tile, its keys from local row ``key0``. Below the diagonal the
    tile is full: no masking. DIAGONAL (offset 0): key row r is causal for query row ``offs_m`` iff
    ``r <= offs_m + shift`` (``shift``: key tile row minus query tile row, 0 on one device), keys past N are
    masked (N: the k/v length) and key sub-blocks from ``row_end + shift`` (the rows' end) on are skipped. DOCS: keys
    at global positions below a row's document start (``starts [BLOCK_M]``; ``key_pos``: the tile's first global key)
    are masked, so a row may meet none here (guarded). MASKED: the whole tile counts only where ``here`` (a shard's
    tile that another shard holds: computed on a stand-in tile and masked, so the loop has no branch)."""
    offs_d = tl.arange(0, D)
    for n0 in tl.static_range(0, BS, BLOCK_N):
        needed = True
        if DIAGONAL:
            needed = key0 + n0 < row_end + shift
        if needed:
            offs_n = key0 + n0 + tl.arange(0, BLOCK_N)
            kt, v = slash_kv(k_base, v_base, offs_n, offs_d, stride_kn, stride_vn, N, DIAGONAL)
            qk = tl.dot(q, kt)
            if DIAGONAL:
                qk = tl.where(offs_n[None, :] <= (offs_m + shift)[:, None], qk, float("-inf"))
            if DOCS:
                keys = key_pos + n0 + tl.arange(0, BLOCK_N)
                qk = tl.where(keys[None, :] >= starts[:, None], qk, float("-inf"))
            if MASKED:
                qk = tl.where(here, qk, float("-inf"))
            acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v, qk_scale, DOCS or MASKED)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SLASH,
    SCNT,
    COLS,
    CCNT,
    OFFM,
    QBLK,
    KVTILE,
    COLROWS,
    DSTART,
    qk_scale,
    N,
    NKV,
    NT,
    NB,
    KS,
    KV,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE: tl.constexpr,
    MAPPED: tl.constexpr,
    DOCS: tl.constexpr,
):
    # A ring step merging into a running result: a program with no diagonal tile, offset or column in the shard
    # leaves its rows as they are, so it stops before loading anything of q or of the result.
    bh, b, h, hk, offs_m, row_end, i, col_lo, kd, shift, diagonal_here, cnt, ncol, run = query_tile(
        QBLK, KVTILE, SCNT, CCNT, DSTART, N, NT, NB, HQ, GROUP, BS, BLOCK_M, MAPPED, DOCS, MAPPED and MERGE
    )
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    offs_d = tl.arange(0, D)
    starts = offs_m  # documents: the rows' starts; a placeholder without them, never read
    if run:
        if DOCS:
            starts = tl.load(DSTART + b * N + offs_m, mask=offs_m < N, other=0)
        q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        if diagonal_here:
            acc, m_i, l_i = _fwd_tile(
                acc,
                m_i,
                l_i,
                q,
                k_base,
                v_base,
                kd * BS,
                offs_m,
                row_end,
                shift,
                i * BS,
                starts,
                True,
                NKV,
                stride_kn,
                stride_vn,
                qk_scale,
                D,
                BS,
                BLOCK_N,
                True,
                DOCS,
                False,
            )
        # The other slash tiles, key tile i - o (with maps, one the k/v shard does not hold masked out).
        for s in range(1, cnt):
            key_block, key_tile, here = slash_tile(SLASH, KVTILE, bh, KS, i, s, MAPPED)
            acc, m_i, l_i = _fwd_tile(
                acc,
                m_i,
                l_i,
                q,
                k_base,
                v_base,
                key_tile * BS,
                offs_m,
                row_end,
                0,
                key_block * BS,
                starts,
                here,
                NKV,
                stride_kn,
                stride_vn,
                qk_scale,
                D,
                BS,
                BLOCK_N,
                False,
                DOCS,
                MAPPED,
            )

        # The columns, BLOCK_N at a time. With maps, or with documents (a column before a row's start masked too),
        # a row may then have met no key at all.
        for c0 in range(col_lo, ncol, BLOCK_N):
            col, kt, v, ok = column_chunk(
                COLS, COLROWS, OFFM, k_base, v_base, offs_d, stride_kn, stride_vn, bh, KV, NB, i, c0, ncol, BS,
                BLOCK_N, MAPPED,
            )  # fmt: skip
            seen = ok[None, :]
            if DOCS:
                seen = seen & (col[None, :] >= starts[:, None])
            qk = tl.where(seen, tl.dot(q, kt), float("-inf"))
            acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v, qk_scale, MAPPED or DOCS)

        if MAPPED:  # rows that met no key of this shard: out 0, lse -inf (as the PyTorch path)
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        out = acc / l_i[:, None]
        rows = offs_m < N
        o_ptrs = (
            O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
        )
        l_ptrs = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m
        if MERGE:
            old_lse = tl.load(l_ptrs, mask=rows, other=0.0)
            old_out = tl.load(o_ptrs, mask=rows[:, None], other=0.0)
            mx = tl.maximum(old_lse, lse)
            if MAPPED:  # both sides may be empty (-inf): shift by 0 so such rows stay (0, -inf), not NaN
                mx = tl.where(mx == float("-inf"), 0.0, mx)
            new_lse = mx + tl.log(tl.exp(old_lse - mx) + tl.exp(lse - mx))
            norm = new_lse
            if MAPPED:
                norm = tl.where(new_lse == float("-inf"), 0.0, new_lse)
            out = old_out * tl.exp(old_lse - norm)[:, None] + out * tl.exp(lse - norm)[:, None]
            lse = new_lse
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rows[:, None])
        tl.store(l_ptrs, lse, mask=rows)


def vertical_slash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex | KernelIndex,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    q_blocks: BlockMap = None,
    kv_blocks: BlockMap = None,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward. q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]`` (``N_kv`` tokens where ``kv_blocks`` places
    them); returns out ``[B, N, Hq, D]`` (q's dtype) and lse ``[B, Hq, N]`` (fp32, natural log; -inf for rows that
    attend no key here).

    With ``out`` (fp32 ``[B, N, Hq, D]``) and ``lse`` (fp32 ``[B, Hq, N]``, -inf where nothing was seen yet)
    given, the result is merged into them in place (``lse <- logaddexp(lse, lse_new)``, out rescaled) and they
    are returned. ``index`` is a ``VerticalSlashIndex`` (its kernel form is built on the first call and cached on
    it, ``VerticalSlashIndex.kernel_index``) or a ``KernelIndex`` (``prepare_index``). ``softmax_scale``: positive
    and finite, ``None`` for ``1 / sqrt(D)``.

    ``q_blocks`` / ``kv_blocks`` place q and k/v, shards of whole tiles, in a global sequence: the global block
    of each local tile (integer ``[N / bs]``), or its ``TileMap`` (``prepare_tile_map``, to build once and
    reuse). The index is then the global one (a ``KernelIndex`` for the global length, or a ``VerticalSlashIndex``
    with ``TileMap``s, which give the global length) and the call computes the entries whose key is in this k/v
    shard. Both None (default): q and k/v are the sequence.

    ``doc_start`` (integer ``[B, N]``, global positions; ``Documents.starts`` on one device, the shard's rows' starts
    on shards) keeps each query row inside its document: key ``k`` is attended only if ``k >= doc_start[b, q]``, and
    the key tiles and columns before a program's first row's document are not visited. None (default) compiles the
    kernel without any of it.
    """
    scale = check_inputs(q, k, v, index.block_size, softmax_scale, "vertical_slash_forward")
    starts = None if doc_start is None else document_rows(doc_start, q, "vertical_slash_forward")
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    n_kv = k.shape[1]
    kidx, q_map, kv_map = place(index, n, q_blocks, kv_blocks, n_kv)
    mapped = q_map is not None
    merge = out is not None
    if merge != (lse is not None):
        raise ValueError("pass both out and lse to merge into a running result, or neither")
    if merge:
        if (
            out.dtype != torch.float32
            or lse.dtype != torch.float32
            or out.shape != q.shape
            or lse.shape != (bsz, hq, n)
            or out.stride(-1) != 1
            or lse.stride(-1) != 1
        ):
            raise ValueError(
                f"merge needs out fp32 {tuple(q.shape)} and lse fp32 {(bsz, hq, n)}, unit last stride; "
                f"got out {out.dtype} {tuple(out.shape)}, lse {lse.dtype} {tuple(lse.shape)}"
            )
    else:
        out = torch.empty_like(q)
        lse = torch.empty(bsz, hq, n, device=q.device, dtype=torch.float32)
    tiles = -(-n // kidx.block_size)
    block_m, block_n, warps, stages = launch_config(q.dtype, kidx.block_size, d)["fwd"]
    grid = (bsz * hq * tiles * (kidx.block_size // block_m),)  # common.tile_program
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        kidx.slash,
        kidx.scount,
        kidx.columns,
        kidx.ccount,
        kidx.offsets,
        q_map.blocks if mapped else kidx.slash,  # placeholders when not MAPPED: never read
        kv_map.tiles if mapped else kidx.slash,
        kidx.column_rows if mapped else kidx.slash,
        kidx.slash if starts is None else starts,
        scale * LOG2E,
        n,
        n_kv,
        tiles,
        kidx.num_blocks,
        kidx.slash.shape[-1],
        kidx.columns.shape[-1],
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        HQ=hq,
        GROUP=hq // hkv,
        BS=kidx.block_size,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        MERGE=merge,
        MAPPED=mapped,
        DOCS=starts is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return out, lse
