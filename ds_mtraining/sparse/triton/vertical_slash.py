"""Triton kernels for vertical-slash sparse flash attention: forward, backward, index conversion.

Semantics (``VerticalSlashIndex``): query q attends key k iff ``k <= q`` and (``k`` is a vertical column of
its head, or ``q // bs - k // bs`` is a slash offset of its head). Query tiles are the ``bs``-row blocks of
the index, so for query tile ``i`` a column ``c`` is "inside a chosen tile" iff offset ``i - c // bs`` is
chosen; since offset 0 is always chosen, the columns a tile reads un-tiled are exactly those with
``c < i * bs`` whose offset is not chosen, and the causal test ``c <= q`` is then automatic.

Algorithm (FlashAttention-2 style, fp32 accumulation, exp2 with the scale folded in):

* Index conversion (``prepare_index``, torch ops on the index's device, batched, no host sync): per
  (b, hq, query tile i) the number of slash offsets ``<= i`` (``searchsorted``), per (b, hq, i) the number of
  columns ``< i * bs`` (the prefix of the sorted column list a tile reads), the offset bitmap as int8.
* Forward, one program per (b·hq, BLOCK_M rows of a query tile), heaviest tiles first: the diagonal tile (offset 0, causal mask,
  key-range mask for a partial last tile), then the other slash tiles ``i - o`` for the offsets ``o <= i``
  (no masking: they are full and strictly below the diagonal), then the vertical columns in chunks of
  ``BLOCK_N``, loaded by gather, masked where their tile offset is chosen (bitmap lookup). Optionally merges
  the result into a running fp32 ``(out, lse)`` in place (ring accumulation; max-shifted logaddexp form).
* Backward: ``delta = rowsum(dO * O)``; a dq pass that mirrors the forward; a column pass, one program per
  (b·hq, chunk of ``BLOCK_C`` columns), that walks the query tiles after the columns' block and accumulates
  the columns' dk/dv over the rows that read them un-tiled (into an fp32 buffer ``[B, Hq, Kv, D]``); and a
  dk/dv pass, one program per (b·hkv, key tile j), that loops over the query heads of its GQA group and their
  slash offsets (query tiles ``j + o``), then adds the group's column gradients that fall in tile j with a
  one-hot matrix product (exact in fp32). Every output element is owned by one program and reduced in a fixed
  order: the backward is deterministic (bitwise-repeatable) by construction, with no float atomics.
* ``deterministic=False`` drops the dq pass: the dk/dv and column passes also form dS^T K and add it to an
  fp32 dq buffer with atomics (5 matrix products per tile instead of 7). Measured on an H200 at 128K / 95 %
  it is slower (49.7 vs 40.5 ms fwd+bwd: the atomics cost more than the two products they save), so the
  deterministic mode is the default and the faster one.

Performance (H200, bf16, B=1, Hq=16, Hkv=2, D=128, bs=128, 128K tokens, 95 % sparsity): forward 9.9 ms,
forward + backward 40.5 ms (11.5x dense cuDNN SDPA); see benchmarks/results/.

Limits: head dim 64 or 128; block size 64 or 128; fp16 / bf16 / fp32 inputs (fp32 dots run as tf32 on GPU,
relative error ~2e-3; fp32 uses small untuned tiles);
q, k, v need unit stride in the head dim; positions and per-head offsets must fit int32. Provenance: the
loop structure follows the Triton fused-attention tutorial and FlashAttention-2; the vertical/slash split
follows MInference / MTraining.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..index import VerticalSlashIndex

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------------------
# Index conversion
# ----------------------------------------------------------------------------------------------------------


class KernelIndex(NamedTuple):
    """The index in the form the kernels read; all int32 / int8, contiguous, on the index's device.

    slash ``[B, Hq, Ks]`` offsets; scount ``[B, Hq, nb]`` number of offsets ``<= i``; columns ``[B, Hq, Kv']``
    (``Kv' = max(Kv, 1)``, padding -1); ccount ``[B, Hq, nb + 1]`` number of columns ``< i * bs``; offsets
    ``[B, Hq, nb]`` int8 bitmap of chosen offsets.
    """

    slash: torch.Tensor
    scount: torch.Tensor
    columns: torch.Tensor
    ccount: torch.Tensor
    offsets: torch.Tensor
    block_size: int
    num_blocks: int


def prepare_index(index: VerticalSlashIndex, seqlen: int) -> KernelIndex:
    """Convert a canonical ``VerticalSlashIndex`` for ``seqlen`` tokens; device ops only, no host sync."""
    bs, nb = index.block_size, index.num_blocks(seqlen)
    b, h = index.batch, index.heads
    dev = index.device
    big = torch.iinfo(torch.int64).max
    slash = index.slash.contiguous()
    tiles = torch.arange(nb, device=dev).expand(b, h, nb).contiguous()
    scount = torch.searchsorted(torch.where(slash < 0, big, slash), tiles, right=True)
    vertical = index.vertical
    if vertical.shape[-1] == 0:
        vertical = torch.full((b, h, 1), -1, dtype=torch.long, device=dev)
    vertical = vertical.contiguous()
    starts = (torch.arange(nb + 1, device=dev) * bs).expand(b, h, nb + 1).contiguous()
    ccount = torch.searchsorted(torch.where(vertical < 0, big, vertical), starts)
    return KernelIndex(
        slash.to(torch.int32),
        scount.to(torch.int32),
        vertical.to(torch.int32),
        ccount.to(torch.int32),
        index.offset_mask(seqlen).to(torch.int8).contiguous(),
        bs,
        nb,
    )


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _online_update(acc, m_i, l_i, qk, v):
    """One online-softmax step on scaled (log2-domain) scores ``qk [M, N]`` and values ``v [N, D]``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


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
    qk_scale,
    N,
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
):
    bh = tl.program_id(0)
    rb = NB * (BS // BLOCK_M) - 1 - tl.program_id(1)  # block of BLOCK_M query rows; most work first
    i = rb // (BS // BLOCK_M)  # its query tile
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    # Diagonal tile (offset 0, always chosen): causal mask; keys past N only here. Key blocks entirely
    # after this row block are skipped.
    for n0 in tl.static_range(0, BS, BLOCK_N):
        if i * BS + n0 < (rb + 1) * BLOCK_M:
            offs_n = i * BS + n0 + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
            qk = tl.dot(q, kt) * qk_scale
            qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
            acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v)

    # Other slash tiles: key tile i - o for the chosen offsets 0 < o <= i; full and unmasked.
    cnt = tl.load(SCNT + bh * NB + i)
    for s in range(1, cnt):
        o = tl.load(SLASH + bh * KS + s)
        for n0 in tl.static_range(0, BS, BLOCK_N):
            offs_n = (i - o) * BS + n0 + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None])
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
            qk = tl.dot(q, kt) * qk_scale
            acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v)

    # Vertical columns before this tile, gathered BLOCK_N at a time; skip those inside a chosen tile.
    ncol = tl.load(CCNT + bh * (NB + 1) + i)
    for c0 in range(0, ncol, BLOCK_N):
        idx = c0 + tl.arange(0, BLOCK_N)
        inb = idx < ncol
        col = tl.load(COLS + bh * KV + idx, mask=inb, other=0)
        chosen = tl.load(OFFM + bh * NB + i - col // BS, mask=inb, other=1)
        ok = inb & (chosen == 0)
        kt = tl.load(k_base + col[None, :] * stride_kn + offs_d[:, None], mask=ok[None, :], other=0.0)
        v = tl.load(v_base + col[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None], other=0.0)
        qk = tl.dot(q, kt) * qk_scale
        qk = tl.where(ok[None, :], qk, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v)

    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    out = acc / l_i[:, None]
    rows = offs_m < N
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    l_ptrs = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m
    if MERGE:
        old_lse = tl.load(l_ptrs, mask=rows, other=0.0)
        old_out = tl.load(o_ptrs, mask=rows[:, None], other=0.0)
        mx = tl.maximum(old_lse, lse)
        new_lse = mx + tl.log(tl.exp(old_lse - mx) + tl.exp(lse - mx))
        out = old_out * tl.exp(old_lse - new_lse)[:, None] + out * tl.exp(lse - new_lse)[:, None]
        lse = new_lse
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rows[:, None])
    tl.store(l_ptrs, lse, mask=rows)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    N,
    stride_ob,
    stride_on,
    stride_oh,
    stride_db,
    stride_dn,
    stride_dh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    rows = offs_n < N
    o = tl.load(
        O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_n[:, None] * stride_on + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + b.to(tl.int64) * stride_db + h * stride_dh + offs_n[:, None] * stride_dn + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    ).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_n, tl.sum(o * do, 1), mask=rows)


@triton.jit
def _dq_step(dq, q, do, kt, v, lse2, delta, qk_scale):
    """dq += dS K for one unmasked key block, ``kt [D, N]``, ``v [N, D]``; returns the new dq."""
    p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(kt.dtype), tl.trans(kt))


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
    qk_scale,
    sm_scale,
    N,
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
):
    bh = tl.program_id(0)
    rb = NB * (BS // BLOCK_M) - 1 - tl.program_id(1)  # block of BLOCK_M query rows; most work first
    i = rb // (BS // BLOCK_M)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m < N
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + offs_m[:, None] * stride_dn + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    lse2 = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=rows, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=rows, other=0.0)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    for n0 in tl.static_range(0, BS, BLOCK_N):
        if i * BS + n0 < (rb + 1) * BLOCK_M:
            offs_n = i * BS + n0 + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
            p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))

    cnt = tl.load(SCNT + bh * NB + i)
    for s in range(1, cnt):
        o = tl.load(SLASH + bh * KS + s)
        for n0 in tl.static_range(0, BS, BLOCK_N):
            offs_n = (i - o) * BS + n0 + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None])
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
            dq = _dq_step(dq, q, do, kt, v, lse2, delta, qk_scale)

    ncol = tl.load(CCNT + bh * (NB + 1) + i)
    for c0 in range(0, ncol, BLOCK_N):
        idx = c0 + tl.arange(0, BLOCK_N)
        inb = idx < ncol
        col = tl.load(COLS + bh * KV + idx, mask=inb, other=0)
        chosen = tl.load(OFFM + bh * NB + i - col // BS, mask=inb, other=1)
        ok = inb & (chosen == 0)
        kt = tl.load(k_base + col[None, :] * stride_kn + offs_d[:, None], mask=ok[None, :], other=0.0)
        v = tl.load(v_base + col[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None], other=0.0)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
        p = tl.where(ok[None, :], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))

    dq_ptrs = (
        DQ + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _dkdv_step(
    dk,
    dv,
    k,
    v,
    q,
    do,
    lse2,
    delta,
    qk_scale,
    sm_scale,
    dqa_ptrs,
    rows,
    offs_n,
    offs_m,
    CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """dk, dv of one key block ``k, v [N, D]`` from one query block ``q, do [M, D]`` (transposed scores).

    With ATOMIC_DQ the block's dq contribution is also added (fp32 atomics) at ``dqa_ptrs [M, D]``.
    """
    pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
    if CAUSAL:
        pt = tl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do)
    dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
    dk += tl.dot(dst, q)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(dst), k) * sm_scale
        tl.atomic_add(dqa_ptrs, dq, mask=rows[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_col_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DKC,
    DVC,
    DQA,
    COLS,
    OFFM,
    qk_scale,
    sm_scale,
    N,
    NB,
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
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """dk, dv (unscaled, fp32) of a chunk of one head's columns over the query rows that read them un-tiled.

    With ATOMIC_DQ also adds those rows' dq contributions to the fp32 buffer DQA ``[B, N, HQ, D]``."""
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    idx = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col = tl.load(COLS + bh * KV + idx, mask=idx < KV, other=-1)
    valid = col >= 0
    col = tl.where(valid, col, 0)
    cb = col // BS
    offs_d = tl.arange(0, D)
    k = tl.load(
        K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + col[:, None] * stride_kn + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    v = tl.load(
        V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + col[:, None] * stride_vn + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
    dqa_base = DQA + (b.to(tl.int64) * N * HQ + h) * D
    dk = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    first = tl.min(tl.where(valid, cb, NB)) + 1
    for i in range(first, NB):
        later = valid & (cb < i)
        chosen = tl.load(OFFM + bh * NB + i - cb, mask=later, other=1)
        ok = later & (chosen == 0)
        for m0 in tl.static_range(0, BS, BLOCK_M):
            offs_m = i * BS + m0 + tl.arange(0, BLOCK_M)
            rows = offs_m < N
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=rows[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dn + offs_d[None, :], mask=rows[:, None], other=0.0)
            lse2 = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=rows, other=0.0)
            pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
            pt = tl.where(ok[:, None], pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
            dk += tl.dot(dst, q)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(dst), k) * sm_scale
                tl.atomic_add(
                    dqa_base + offs_m[:, None] * (HQ * D) + offs_d[None, :], dq, mask=rows[:, None], sem="relaxed"
                )
    out = (bh.to(tl.int64) * KV + idx)[:, None] * D + offs_d[None, :]
    tl.store(DKC + out, dk, mask=(idx < KV)[:, None])
    tl.store(DVC + out, dv, mask=(idx < KV)[:, None])


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DKC,
    DVC,
    DQA,
    SLASH,
    SCNT,
    COLS,
    CCNT,
    qk_scale,
    sm_scale,
    N,
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
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """dk, dv of BLOCK_N keys of key tile j of one kv head: the slash tiles of every query head of the
    group, then that head's columns."""
    bhk = tl.program_id(0)
    kb = tl.program_id(1)  # block of BLOCK_N keys; low key tiles see the most query tiles: they go first
    j = kb // (BS // BLOCK_N)
    b = bhk // HKV
    hk = bhk % HKV
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    keys = offs_n < N
    k = tl.load(
        K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
        mask=keys[:, None],
        other=0.0,
    )
    v = tl.load(
        V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
        mask=keys[:, None],
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * HQ + h
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        l_base = LSE + bh.to(tl.int64) * N
        d_base = DELTA + bh.to(tl.int64) * N
        dqa_base = DQA + (b.to(tl.int64) * N * HQ + h) * D + offs_d[None, :]
        # Diagonal tile: causal; query rows past N only here or in the last tile (masked through lse = inf).
        for m0 in tl.static_range(0, BS, BLOCK_M):
            if j * BS + m0 + BLOCK_M > kb * BLOCK_N:  # query blocks entirely before these keys see none
                offs_m = j * BS + m0 + tl.arange(0, BLOCK_M)
                rows = offs_m < N
                q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=rows[:, None], other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dn + offs_d[None, :], mask=rows[:, None], other=0.0)
                lse2 = tl.load(l_base + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634
                delta = tl.load(d_base + offs_m, mask=rows, other=0.0)
                dk, dv = _dkdv_step(
                    dk,
                    dv,
                    k,
                    v,
                    q,
                    do,
                    lse2,
                    delta,
                    qk_scale,
                    sm_scale,
                    dqa_base + offs_m[:, None] * (HQ * D),
                    rows,
                    offs_n,
                    offs_m,
                    True,
                    ATOMIC_DQ,
                )
        cnt = tl.load(SCNT + bh * NB + NB - 1 - j)  # offsets o with j + o <= NB - 1
        for s in range(1, cnt):
            i = j + tl.load(SLASH + bh * KS + s)
            for m0 in tl.static_range(0, BS, BLOCK_M):
                offs_m = i * BS + m0 + tl.arange(0, BLOCK_M)
                rows = offs_m < N
                q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=rows[:, None], other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dn + offs_d[None, :], mask=rows[:, None], other=0.0)
                lse2 = tl.load(l_base + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634
                delta = tl.load(d_base + offs_m, mask=rows, other=0.0)
                dk, dv = _dkdv_step(
                    dk,
                    dv,
                    k,
                    v,
                    q,
                    do,
                    lse2,
                    delta,
                    qk_scale,
                    sm_scale,
                    dqa_base + offs_m[:, None] * (HQ * D),
                    rows,
                    offs_n,
                    offs_m,
                    False,
                    ATOMIC_DQ,
                )
        # This head's columns inside tile j: add their un-tiled gradients (one-hot product, exact in fp32).
        c_lo = tl.load(CCNT + bh * (NB + 1) + j)
        c_hi = tl.load(CCNT + bh * (NB + 1) + j + 1)
        for c0 in range(c_lo, c_hi, BLOCK_C):
            idx = c0 + tl.arange(0, BLOCK_C)
            inb = idx < c_hi
            col = tl.load(COLS + bh * KV + idx, mask=inb, other=-1)
            onehot = tl.where((col[None, :] == offs_n[:, None]) & inb[None, :], 1.0, 0.0)
            src = (bh.to(tl.int64) * KV + idx)[:, None] * D + offs_d[None, :]
            dkc = tl.load(DKC + src, mask=inb[:, None], other=0.0)
            dvc = tl.load(DVC + src, mask=inb[:, None], other=0.0)
            dk += tl.dot(onehot, dkc, input_precision="ieee")
            dv += tl.dot(onehot, dvc, input_precision="ieee")
    dk_ptrs = (
        DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    )
    dv_ptrs = (
        DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
    )
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=keys[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=keys[:, None])


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------

# Tile shapes per (block size, head dim): key sub-block of the forward / dq passes, query sub-block of the
# dk/dv and column passes, columns per program of the column pass, warps and pipeline stages.
# Each entry: (rows or keys per program, inner block, num_warps, num_stages) per pass; BLOCK_M / BLOCK_N of a
# pass must divide the block size. The atomic-dq variants of the dk/dv and column passes hold one more tile
# and need less pipelining to fit in shared memory (checked for sm_90 with Triton 3.6). (128, 128) was tuned
# on an H200 (benchmarks/kernel_tune.py, through ``override_launch_config``); the others are scaled from it.
_CONFIG = {
    (64, 64): {
        "fwd": (64, 64, 4, 3),
        "dq": (64, 64, 4, 2),
        "dkdv": (64, 64, 4, 2),
        "col": (64, 64, 4, 2),
        "dkdv_atomic": (64, 64, 4, 2),
        "col_atomic": (64, 64, 4, 2),
    },
    (64, 128): {
        "fwd": (64, 64, 4, 3),
        "dq": (64, 64, 4, 2),
        "dkdv": (64, 64, 4, 2),
        "col": (64, 32, 4, 2),
        "dkdv_atomic": (64, 32, 4, 2),
        "col_atomic": (64, 32, 4, 2),
    },
    (128, 64): {
        "fwd": (128, 128, 8, 3),
        "dq": (128, 128, 8, 2),
        "dkdv": (128, 64, 8, 3),
        "col": (64, 32, 4, 3),
        "dkdv_atomic": (128, 64, 8, 3),
        "col_atomic": (64, 32, 4, 2),
    },
    (128, 128): {
        "fwd": (128, 128, 8, 3),
        "dq": (128, 128, 8, 2),
        "dkdv": (128, 64, 8, 3),
        "col": (64, 32, 4, 3),
        "dkdv_atomic": (128, 64, 8, 3),
        "col_atomic": (64, 32, 4, 2),
    },
}
# fp32 inputs: twice the bytes per tile, so smaller tiles and no pipelining (fits every block size / head dim).
_CONFIG_FP32 = {
    "fwd": (64, 64, 4, 1),
    "dq": (64, 32, 4, 1),
    "dkdv": (64, 32, 4, 1),
    "col": (32, 32, 4, 1),
    "dkdv_atomic": (64, 32, 4, 1),
    "col_atomic": (32, 32, 4, 1),
}
_BLOCK_C_MERGE = 16  # columns per one-hot product when adding column gradients into a key tile


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex | KernelIndex) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"expected q [B, N, Hq, D], k/v [B, N, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128 for the Triton kernels; got {q.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share fp16, bf16 or fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"Hq ({q.shape[2]}) must be a multiple of Hkv ({k.shape[2]})")
    if index.block_size not in (64, 128):
        raise ValueError(f"block size must be 64 or 128 for the Triton kernels; got {index.block_size}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need unit stride in the head dim; call .contiguous()")


LaunchConfig = tuple[int, int, int, int]  # (block per program, inner block, num_warps, num_stages)
_PASSES = tuple(_CONFIG_FP32)
# Per-pass overrides set by ``override_launch_config``, as (pass, config) pairs: a ContextVar so a ``with`` block
# in one thread does not leak into launches from another, immutable so no holder of a value can change it.
_OVERRIDE: ContextVar[tuple[tuple[str, LaunchConfig], ...]] = ContextVar("vertical_slash_launch_config", default=())


@contextlib.contextmanager
def override_launch_config(**passes: LaunchConfig) -> Iterator[None]:
    """Launch the named passes with these configs instead of ``_CONFIG``'s inside the ``with`` block (tuning).

    Keys are pass names: ``fwd``, ``dq``, ``dkdv``, ``col``, ``dkdv_atomic``, ``col_atomic``. Values are
    ``(block per program, inner block, num_warps, num_stages)`` in the order of ``_CONFIG`` (``fwd`` / ``dq``:
    query rows, key sub-block; ``dkdv``: keys, query sub-block; ``col``: columns, query sub-block). They apply
    to every dtype, block size and head dim launched inside the block; a launch whose block size they do not
    divide raises ``ValueError``. Nested blocks override the outer one pass by pass. Example::

        with override_launch_config(dq=(128, 64, 8, 3)):
            vertical_slash_backward(do, q, k, v, out, lse, kidx)
    """
    unknown = sorted(set(passes) - set(_PASSES))
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; expected some of {list(_PASSES)}")
    for name, cfg in passes.items():
        ok = isinstance(cfg, tuple) and len(cfg) == 4 and all(isinstance(x, int) and x > 0 for x in cfg)
        # tl.arange needs powers of two and tl.dot needs at least 16 rows / columns per operand.
        if not ok or any(x < 16 or x & (x - 1) for x in cfg[:2]) or cfg[2] & (cfg[2] - 1):
            raise ValueError(
                f"{name}: expected (block, inner block, num_warps, num_stages) with blocks powers of two >= 16 and "
                f"num_warps a power of two; got {cfg!r}"
            )
    token = _OVERRIDE.set(tuple({**dict(_OVERRIDE.get()), **passes}.items()))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def launch_config(dtype: torch.dtype, block_size: int, head_dim: int) -> dict[str, LaunchConfig]:
    """The launch config of every pass for inputs of this dtype, block size and head dim: ``_CONFIG`` (fp32:
    ``_CONFIG_FP32``) with the passes set by an enclosing ``override_launch_config`` replaced."""
    base = _CONFIG_FP32 if dtype == torch.float32 else _CONFIG[(block_size, head_dim)]
    override = dict(_OVERRIDE.get())
    for name, (outer, inner, _, _) in override.items():
        # Every pass walks a tile in inner sub-blocks; all but the column pass also split a tile into programs.
        column_pass = name.startswith("col")
        if block_size % inner or (not column_pass and block_size % outer):
            what = "the inner block" if column_pass else "both blocks"
            raise ValueError(
                f"override_launch_config {name}={override[name]}: {what} must divide the block size {block_size}"
            )
    return {**base, **override}


def _as_kernel_index(index: VerticalSlashIndex | KernelIndex, seqlen: int) -> KernelIndex:
    return index if isinstance(index, KernelIndex) else prepare_index(index, seqlen)


def vertical_slash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex | KernelIndex,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward. q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]``; returns out ``[B, N, Hq, D]``
    (q's dtype) and lse ``[B, Hq, N]`` (fp32, natural log).

    With ``out`` (fp32 ``[B, N, Hq, D]``) and ``lse`` (fp32 ``[B, Hq, N]``, -inf where nothing was seen yet)
    given, the result is merged into them in place (``lse <- logaddexp(lse, lse_new)``, out rescaled) and they
    are returned. ``index`` may be a ``VerticalSlashIndex`` or the ``KernelIndex`` of ``prepare_index``.
    """
    _check(q, k, v, index)
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kidx = _as_kernel_index(index, n)
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
    block_m, block_n, warps, stages = launch_config(q.dtype, kidx.block_size, d)["fwd"]
    grid = (bsz * hq, kidx.num_blocks * (kidx.block_size // block_m))
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
        scale * LOG2E,
        n,
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
        num_warps=warps,
        num_stages=stages,
    )
    return out, lse


def vertical_slash_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    index: VerticalSlashIndex | KernelIndex,
    softmax_scale: float | None = None,
    *,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients dq ``[B, N, Hq, D]``, dk, dv ``[B, N, Hkv, D]`` (input dtypes) of the sparse attention.

    ``out`` and ``lse`` are the forward's (lse ``[B, Hq, N]`` fp32). ``deterministic=True``: a separate dq
    pass; every output element has one owner and a fixed reduction order (bitwise-repeatable).
    ``deterministic=False``: the dk/dv and column passes also produce dq, added with fp32 atomics into a
    zeroed fp32 buffer (two fewer matrix products per tile, no dq pass); dq's summation order then varies
    from run to run (dk and dv stay deterministic). Measured slower on an H200 (module docstring).
    """
    _check(q, k, v, index)
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kidx = _as_kernel_index(index, n)
    nb, bs = kidx.num_blocks, kidx.block_size
    cfg = launch_config(q.dtype, bs, d)
    if do.stride(-1) != 1 or do.shape != q.shape:
        do = do.contiguous()
    lse = lse.contiguous()

    delta = torch.empty(bsz, hq, n, device=q.device, dtype=torch.float32)
    _bwd_preprocess_kernel[(triton.cdiv(n, 128), bsz * hq)](
        out,
        do,
        delta,
        n,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        HQ=hq,
        D=d,
        BLOCK=128,
    )
    strides_qkvdo = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
    )
    kv = kidx.columns.shape[-1]
    dkc = torch.empty(bsz, hq, kv, d, device=q.device, dtype=torch.float32)
    dvc = torch.empty_like(dkc)
    if deterministic:
        dq = dqa = torch.empty_like(q)
        block_m, block_n, warps, stages = cfg["dq"]
        _bwd_dq_kernel[(bsz * hq, nb * (bs // block_m))](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            kidx.slash,
            kidx.scount,
            kidx.columns,
            kidx.ccount,
            kidx.offsets,
            scale * LOG2E,
            scale,
            n,
            nb,
            kidx.slash.shape[-1],
            kv,
            *strides_qkvdo,
            HQ=hq,
            GROUP=hq // hkv,
            BS=bs,
            D=d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
            num_stages=stages,
        )
    else:
        dqa = torch.zeros(bsz, n, hq, d, device=q.device, dtype=torch.float32)
    block_c, block_m, warps, stages = cfg["col" if deterministic else "col_atomic"]
    _bwd_col_kernel[(bsz * hq, triton.cdiv(kv, block_c))](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dkc,
        dvc,
        dqa,
        kidx.columns,
        kidx.offsets,
        scale * LOG2E,
        scale,
        n,
        nb,
        kv,
        *strides_qkvdo,
        HQ=hq,
        GROUP=hq // hkv,
        BS=bs,
        D=d,
        BLOCK_C=block_c,
        BLOCK_M=block_m,
        ATOMIC_DQ=not deterministic,
        num_warps=warps,
        num_stages=stages,
    )
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    block_n, block_m, warps, stages = cfg["dkdv" if deterministic else "dkdv_atomic"]
    _bwd_dkdv_kernel[(bsz * hkv, nb * (bs // block_n))](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dkc,
        dvc,
        dqa,
        kidx.slash,
        kidx.scount,
        kidx.columns,
        kidx.ccount,
        scale * LOG2E,
        scale,
        n,
        nb,
        kidx.slash.shape[-1],
        kv,
        *strides_qkvdo,
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        dv.stride(0),
        dv.stride(1),
        dv.stride(2),
        HQ=hq,
        HKV=hkv,
        GROUP=hq // hkv,
        BS=bs,
        D=d,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        BLOCK_C=_BLOCK_C_MERGE,
        ATOMIC_DQ=not deterministic,
        num_warps=warps,
        num_stages=stages,
    )
    if not deterministic:
        dq = dqa.to(q.dtype)
    return dq, dk, dv
