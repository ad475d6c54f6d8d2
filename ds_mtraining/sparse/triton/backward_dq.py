"""The backward's dq pass: its Triton kernel, launched by ``vertical_slash_backward``.

It mirrors the forward: one program per (b·hq, BLOCK_M rows of a query tile), heaviest first, over the diagonal
tile, the other slash tiles and the gathered columns, recomputing P from the saved lse and forming
``dS = P (dO V^T - delta)`` and ``dq += dS K`` (scaled once at the end). Each program owns its rows of dq: no
atomics. It walks the forward's arrays (``SLASH[bh, 1:SCNT[bh, x]]``, ``COLS[bh, lo:CCNT[bh, i]]``, ``OFFM``; a ring
step's own offsets and columns, ``forward``'s module docstring has how). With tile maps a slash tile or a
column the k/v shard does not hold is skipped, and a program with no diagonal tile, offset or column in the shard
stores its zero rows without loading anything (``ACCUMULATE``, a ring's running fp32 dq: adds its rows to it, and
such a program stores nothing); with documents (``DOCS``) the loops start at the first row's document
and the rows' starts are masked, as in the forward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import column_chunk, query_tile, slash_kv, slash_tile


@triton.jit
def _dq_tile(
    dq,
    q,
    do,
    lse2,
    delta,
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
    """dq += dS K over one slash tile, its keys from local row ``key0`` (masking as ``_fwd_tile``, documents and
    ``here`` included)."""
    offs_d = tl.arange(0, D)
    for n0 in tl.static_range(0, BS, BLOCK_N):
        needed = True
        if DIAGONAL:
            needed = key0 + n0 < row_end + shift
        if needed:
            offs_n = key0 + n0 + tl.arange(0, BLOCK_N)
            kt, v = slash_kv(k_base, v_base, offs_n, offs_d, stride_kn, stride_vn, N, DIAGONAL)
            p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
            if DIAGONAL:
                p = tl.where(offs_n[None, :] <= (offs_m + shift)[:, None], p, 0.0)
            if DOCS:
                keys = key_pos + n0 + tl.arange(0, BLOCK_N)
                p = tl.where(keys[None, :] >= starts[:, None], p, 0.0)
            if MASKED:
                p = tl.where(here, p, 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
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
    sm_scale,
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
    stride_db,
    stride_dn,
    stride_dh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAPPED: tl.constexpr,
    DOCS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    # A ring step's program with no diagonal tile, offset or column here stores its zeros without loading anything.
    bh, b, h, hk, offs_m, row_end, i, col_lo, kd, shift, diagonal_here, cnt, ncol, run = query_tile(
        QBLK, KVTILE, SCNT, CCNT, DSTART, N, NT, NB, HQ, GROUP, BS, BLOCK_M, MAPPED, DOCS, MAPPED
    )
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    offs_d = tl.arange(0, D)
    rows = offs_m < N
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    starts = offs_m  # documents: the rows' starts, for the mask (as the forward); a placeholder without them
    if run:
        if DOCS:
            starts = tl.load(DSTART + b * N + offs_m, mask=rows, other=0)
        q_rows = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qn
        do_rows = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + offs_m[:, None] * stride_dn
        q = tl.load(q_rows + offs_d[None, :], mask=rows[:, None], other=0.0)
        do = tl.load(do_rows + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse2 = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=rows, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=rows, other=0.0)
        if diagonal_here:
            dq = _dq_tile(
                dq,
                q,
                do,
                lse2,
                delta,
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
        for s in range(1, cnt):
            key_block, key_tile, here = slash_tile(SLASH, KVTILE, bh, KS, i, s, MAPPED)
            dq = _dq_tile(
                dq,
                q,
                do,
                lse2,
                delta,
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

        for c0 in range(col_lo, ncol, BLOCK_N):
            col, kt, v, ok = column_chunk(
                COLS, COLROWS, OFFM, k_base, v_base, offs_d, stride_kn, stride_vn, bh, KV, NB, i, c0, ncol, BS,
                BLOCK_N, MAPPED,
            )  # fmt: skip
            p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
            seen = ok[None, :]
            if DOCS:
                seen = seen & (col[None, :] >= starts[:, None])
            p = tl.where(seen, p, 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))

    dq_ptrs = (
        DQ + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    )
    if ACCUMULATE:  # a running fp32 dq (a ring's): added to where this step has work, untouched elsewhere
        if run:
            tl.store(dq_ptrs, tl.load(dq_ptrs, mask=rows[:, None], other=0.0) + dq * sm_scale, mask=rows[:, None])
    else:
        tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None])
