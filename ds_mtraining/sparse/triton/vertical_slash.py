"""Triton kernels for vertical-slash sparse flash attention: forward, backward, index conversion.

Semantics (``VerticalSlashIndex``): query q attends key k iff ``k <= q`` and (``k`` is a vertical column of
its head, or ``q // bs - k // bs`` is a slash offset of its head). Query tiles are the ``bs``-row blocks of
the index, so for query tile ``i`` a column ``c`` is "inside a chosen tile" iff offset ``i - c // bs`` is
chosen; since offset 0 is always chosen, the columns a tile reads un-tiled are exactly those with
``c < i * bs`` whose offset is not chosen, and the causal test ``c <= q`` is then automatic.

Shards (a ring step): q may be one shard of the global sequence and k/v another, each a list of whole tiles,
local tile ``t`` being global block ``blocks[t]`` (``q_blocks`` / ``kv_blocks``). The index stays global
(prepared for the global length) and the call computes exactly the entries whose key lies in the k/v shard,
so merging the calls over every k/v shard gives the global result. The kernels take each shard's map both
ways (``TileMap``: local -> global block, global block -> local tile or -1) under a constexpr flag, so the
one-device call (no maps) compiles to the kernels without them. With maps: a query tile looks the index up
by its global tile; a slash tile ``i - o``, or a column, whose block the k/v shard does not hold is skipped
(one scalar lookup per offset; columns masked in the gather); the dk/dv pass maps the query tiles
``j + o`` through the q shard's inverse map and the column pass walks the q shard's tiles. A row that meets
no key in the shard gets (out 0, lse -inf), which a merge leaves unchanged.

Algorithm (FlashAttention-2 style, fp32 accumulation, exp2 with the scale folded in):

* Index conversion (``prepare_index``, torch ops on the index's device, batched, no host sync): per
  (b, hq, query tile i) the number of slash offsets ``<= i`` (``searchsorted``), per (b, hq, i) the number of
  columns ``< i * bs`` (the prefix of the sorted column list a tile reads), the offset bitmap as int8.
  ``prepare_tile_map`` likewise for a shard's tile map.
* Forward, one program per (b·hq, BLOCK_M rows of a query tile), heaviest tiles first: the diagonal tile (offset 0, causal mask,
  key-range mask for a partial last tile), then the other slash tiles ``i - o`` for the offsets ``o <= i``
  (no masking: they are full and strictly below the diagonal), then the vertical columns in chunks of
  ``BLOCK_N``, loaded by gather, masked where their tile offset is chosen (bitmap lookup). Optionally merges
  the result into a running fp32 ``(out, lse)`` in place (ring accumulation; max-shifted logaddexp form).
* Backward: ``delta = rowsum(dO * O)``; a dq pass that mirrors the forward; a column pass, ``_COL_SPLIT``
  programs per (b·hq, chunk of ``BLOCK_C`` columns), each walking every ``_COL_SPLIT``-th query tile after the
  columns' block, that accumulates the columns' dk/dv over the rows that read them un-tiled (into its plane of
  an fp32 buffer ``[split, B, Hq, Kv, D]``); and a dk/dv pass, one program per (b·hkv, key tile j), that loops
  over the query heads of its GQA group and their slash offsets (query tiles ``j + o``), then adds the group's
  column gradients that fall in tile j (the splits summed first, in a fixed order) with a one-hot matrix
  product (exact in fp32). Every output element is owned by one program and reduced in a fixed order: the
  backward is deterministic (bitwise-repeatable) by construction, with no float atomics.
* ``deterministic=False`` drops the dq pass: the dk/dv and column passes also form dS^T K and add it to an fp32
  dq buffer with atomics (5 matrix products per tile instead of 7). Measured on an H200 at 128K / 95 % it is
  slower (49.7 vs 38.5 ms fwd+bwd: the atomics cost more than the two products they save), so the
  deterministic mode is the default and the faster one. Adding each dq tile as one TMA bulk reduction instead of
  per-element atomics did not help either (backward 38.7 ms against 29.5 deterministic; results of 2026-11-30).

Performance (H200, bf16, B=1, Hq=16, Hkv=2, D=128, bs=128, 128K tokens, 95 % sparsity): forward 9.7 ms,
forward + backward 37.9 ms (11.9x dense cuDNN SDPA; 13.0x at 256K); see benchmarks/results/. With maps, a step costs its
attended tiles plus one scalar lookup per offset of each query tile (and, per column chunk, the chunk's
columns of every shard: masked, not skipped).

Limits: head dim 64 or 128; block size 64 or 128; fp16 / bf16 / fp32 inputs (fp32 dots run as tf32 on GPU,
relative error ~2e-3; fp32 uses small untuned tiles);
q, k, v need unit stride in the head dim and the same length (with maps: whole tiles); positions and per-head
offsets must fit int32. Provenance: the
loop structure follows the Triton fused-attention tutorial and FlashAttention-2; the vertical/slash split
follows MInference / MTraining.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from ..log_constants import LOG2E
from ..scale import resolve_softmax_scale

if TYPE_CHECKING:  # annotations only: importing the index here would close index -> backends -> triton -> here
    from ..index import VerticalSlashIndex

# ----------------------------------------------------------------------------------------------------------
# Index and tile-map conversion
# ----------------------------------------------------------------------------------------------------------


class KernelIndex(NamedTuple):
    """The index in the form the kernels read; all int32 / int8, contiguous, on the index's device.

    slash ``[B, Hq, Ks]`` offsets; scount ``[B, Hq, nb]`` number of offsets ``<= i``; columns ``[B, Hq, Kv']``
    (``Kv' = max(Kv, 1)``, padding -1); ccount ``[B, Hq, nb + 1]`` number of columns ``< i * bs``; offsets
    ``[B, Hq, nb]`` int8 bitmap of chosen offsets. ``nb = num_blocks`` tiles of the (global) sequence.
    """

    slash: torch.Tensor
    scount: torch.Tensor
    columns: torch.Tensor
    ccount: torch.Tensor
    offsets: torch.Tensor
    block_size: int
    num_blocks: int


def prepare_index(index: VerticalSlashIndex, seqlen: int) -> KernelIndex:
    """Convert a canonical ``VerticalSlashIndex`` for ``seqlen`` tokens (the global length when the calls run
    on shards); device ops only, no host sync."""
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


class TileMap(NamedTuple):
    """Where a shard's tiles lie in the global sequence, both ways; int32, contiguous, on the shard's device.

    blocks ``[T]``: global block of local tile ``t``; tiles ``[num_blocks]``: local tile of global block ``g``,
    -1 where the shard does not hold it.
    """

    blocks: torch.Tensor
    tiles: torch.Tensor


def prepare_tile_map(blocks: torch.Tensor, num_blocks: int) -> TileMap:
    """The ``TileMap`` of a shard whose local tile ``t`` is global block ``blocks[t]`` (integer ``[T]``,
    distinct, each ``< num_blocks``, e.g. ``Layout.block_ids``); device ops only, no host sync."""
    tiles = torch.full((num_blocks,), -1, dtype=torch.int32, device=blocks.device)
    tiles[blocks.long()] = torch.arange(blocks.numel(), dtype=torch.int32, device=blocks.device)
    return TileMap(blocks.to(torch.int32).contiguous(), tiles)


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


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
def _key_rows(col, ok, KVTILE, BS: tl.constexpr, MAPPED: tl.constexpr):
    """Local k/v rows of global key positions ``col``, and ``ok`` restricted to the keys of this shard."""
    rows = col
    if MAPPED:
        tile = tl.load(KVTILE + col // BS, mask=ok, other=-1)
        rows = tile * BS + col % BS
        ok = ok & (tile >= 0)
    return rows, ok


@triton.jit
def _slash_kv(k_base, v_base, offs_n, offs_d, stride_kn, stride_vn, N, DIAGONAL: tl.constexpr):
    """K transposed ``[D, BLOCK_N]`` and V ``[BLOCK_N, D]`` at local key rows ``offs_n`` of a slash tile: masked
    past N only on the diagonal tile (the last tile of a row), whole below it."""
    if DIAGONAL:
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
    else:
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None])
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
    return kt, v


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
    N,
    stride_kn,
    stride_vn,
    qk_scale,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """The online-softmax update over one slash tile, its keys from local row ``key0``. Below the diagonal the
    tile is full: no masking. DIAGONAL (offset 0): key row r is causal for query row ``offs_m`` iff
    ``r <= offs_m + shift`` (``shift``: key tile row minus query tile row, 0 on one device), keys past N are
    masked and key sub-blocks from ``row_end + shift`` (the rows' end) on are skipped."""
    offs_d = tl.arange(0, D)
    for n0 in tl.static_range(0, BS, BLOCK_N):
        needed = True
        if DIAGONAL:
            needed = key0 + n0 < row_end + shift
        if needed:
            offs_n = key0 + n0 + tl.arange(0, BLOCK_N)
            kt, v = _slash_kv(k_base, v_base, offs_n, offs_d, stride_kn, stride_vn, N, DIAGONAL)
            qk = tl.dot(q, kt)
            if DIAGONAL:
                qk = tl.where(offs_n[None, :] <= (offs_m + shift)[:, None], qk, float("-inf"))
            acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v, qk_scale, False)
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
    qk_scale,
    N,
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
):
    bh = tl.program_id(0)
    rb = NT * (BS // BLOCK_M) - 1 - tl.program_id(1)  # block of BLOCK_M query rows; most work first
    t = rb // (BS // BLOCK_M)  # its local query tile
    i = t  # its global query tile: what the index is about
    if MAPPED:
        i = tl.load(QBLK + t)
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
    row_end = (rb + 1) * BLOCK_M

    # Diagonal tile (offset 0, always chosen), then the other slash tiles: key tile i - o for the chosen
    # offsets 0 < o <= i. With maps, a key tile the k/v shard does not hold is skipped (the flags are
    # constexpr True without maps: no test is compiled).
    kd = t
    shift = 0
    diagonal_here = True
    if MAPPED:
        kd = tl.load(KVTILE + i)
        shift = (kd - t) * BS
        diagonal_here = kd >= 0
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
            N,
            stride_kn,
            stride_vn,
            qk_scale,
            D,
            BS,
            BLOCK_N,
            True,
        )
    cnt = tl.load(SCNT + bh * NB + i)
    for s in range(1, cnt):
        key_tile = i - tl.load(SLASH + bh * KS + s)
        tile_here = True
        if MAPPED:
            key_tile = tl.load(KVTILE + key_tile)
            tile_here = key_tile >= 0
        if tile_here:
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
                N,
                stride_kn,
                stride_vn,
                qk_scale,
                D,
                BS,
                BLOCK_N,
                False,
            )

    # Vertical columns before this tile, gathered BLOCK_N at a time; skip those inside a chosen tile (and,
    # with maps, those the k/v shard does not hold: then a row may have met no key at all).
    ncol = tl.load(CCNT + bh * (NB + 1) + i)
    for c0 in range(0, ncol, BLOCK_N):
        idx = c0 + tl.arange(0, BLOCK_N)
        inb = idx < ncol
        col = tl.load(COLS + bh * KV + idx, mask=inb, other=0)
        chosen = tl.load(OFFM + bh * NB + i - col // BS, mask=inb, other=1)
        rows, ok = _key_rows(col, inb & (chosen == 0), KVTILE, BS, MAPPED)
        kt = tl.load(k_base + rows[None, :] * stride_kn + offs_d[:, None], mask=ok[None, :], other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None], other=0.0)
        qk = tl.where(ok[None, :], tl.dot(q, kt), float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, qk, v, qk_scale, MAPPED)

    if MAPPED:  # rows that met no key of this shard: out 0, lse -inf (as the PyTorch path)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    out = acc / l_i[:, None]
    rows = offs_m < N
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
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
    N,
    stride_kn,
    stride_vn,
    qk_scale,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """dq += dS K over one slash tile, its keys from local row ``key0`` (masking as ``_fwd_tile``)."""
    offs_d = tl.arange(0, D)
    for n0 in tl.static_range(0, BS, BLOCK_N):
        needed = True
        if DIAGONAL:
            needed = key0 + n0 < row_end + shift
        if needed:
            offs_n = key0 + n0 + tl.arange(0, BLOCK_N)
            kt, v = _slash_kv(k_base, v_base, offs_n, offs_d, stride_kn, stride_vn, N, DIAGONAL)
            p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
            if DIAGONAL:
                p = tl.where(offs_n[None, :] <= (offs_m + shift)[:, None], p, 0.0)
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
    qk_scale,
    sm_scale,
    N,
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
):
    bh = tl.program_id(0)
    rb = NT * (BS // BLOCK_M) - 1 - tl.program_id(1)  # block of BLOCK_M query rows; most work first
    t = rb // (BS // BLOCK_M)
    i = t
    if MAPPED:
        i = tl.load(QBLK + t)
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
    row_end = (rb + 1) * BLOCK_M

    kd = t
    shift = 0
    diagonal_here = True
    if MAPPED:
        kd = tl.load(KVTILE + i)
        shift = (kd - t) * BS
        diagonal_here = kd >= 0
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
            N,
            stride_kn,
            stride_vn,
            qk_scale,
            D,
            BS,
            BLOCK_N,
            True,
        )
    cnt = tl.load(SCNT + bh * NB + i)
    for s in range(1, cnt):
        key_tile = i - tl.load(SLASH + bh * KS + s)
        tile_here = True
        if MAPPED:
            key_tile = tl.load(KVTILE + key_tile)
            tile_here = key_tile >= 0
        if tile_here:
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
                N,
                stride_kn,
                stride_vn,
                qk_scale,
                D,
                BS,
                BLOCK_N,
                False,
            )

    ncol = tl.load(CCNT + bh * (NB + 1) + i)
    for c0 in range(0, ncol, BLOCK_N):
        idx = c0 + tl.arange(0, BLOCK_N)
        inb = idx < ncol
        col = tl.load(COLS + bh * KV + idx, mask=inb, other=0)
        chosen = tl.load(OFFM + bh * NB + i - col // BS, mask=inb, other=1)
        key_rows, ok = _key_rows(col, inb & (chosen == 0), KVTILE, BS, MAPPED)
        kt = tl.load(k_base + key_rows[None, :] * stride_kn + offs_d[:, None], mask=ok[None, :], other=0.0)
        v = tl.load(v_base + key_rows[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None], other=0.0)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
        p = tl.where(ok[None, :], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))

    dq_ptrs = (
        DQ + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    offs_n,
    tile_row0,
    key_lo,
    shift,
    q_base,
    do_base,
    l_base,
    d_base,
    dqa_base,
    qk_scale,
    sm_scale,
    stride_qn,
    stride_dn,
    N,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DIAGONAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """dk, dv of one key block ``k, v [BLOCK_N, D]`` (local rows ``offs_n``, the first ``key_lo``) from the
    query tile at local row ``tile_row0`` (transposed scores). DIAGONAL: query row r is causal for key row
    ``offs_n`` iff ``offs_n + shift <= r`` (``shift``: query tile row minus key tile row, 0 on one device), and
    the query sub-blocks that end before the block's first key are skipped.

    With ATOMIC_DQ the dq contributions are also added (fp32 atomics) into ``dqa_base``'s rows.
    """
    offs_d = tl.arange(0, D)
    for m0 in tl.static_range(0, BS, BLOCK_M):
        needed = True
        if DIAGONAL:
            needed = tile_row0 + m0 + BLOCK_M > key_lo + shift
        if needed:
            offs_m = tile_row0 + m0 + tl.arange(0, BLOCK_M)
            rows = offs_m < N
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=rows[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dn + offs_d[None, :], mask=rows[:, None], other=0.0)
            # Query rows past N (only in the last tile) drop out through lse = inf.
            lse2 = tl.load(l_base + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634
            delta = tl.load(d_base + offs_m, mask=rows, other=0.0)
            pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
            if DIAGONAL:
                pt = tl.where((offs_n + shift)[:, None] <= offs_m[None, :], pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
            dk += tl.dot(dst, q)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(dst), k) * sm_scale
                tl.atomic_add(dqa_base + offs_m[:, None] * (HQ * D), dq, mask=rows[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _col_tile(
    dk,
    dv,
    k,
    v,
    valid,
    cb,
    i,
    tile_row0,
    q_base,
    do_base,
    dqa_base,
    LSE,
    DELTA,
    OFFM,
    bh,
    qk_scale,
    sm_scale,
    N,
    NB,
    stride_qn,
    stride_dn,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """dk, dv of a chunk of columns (blocks ``cb``) from global query tile ``i`` at local row ``tile_row0``:
    the columns before the tile whose offset is not chosen."""
    later = valid & (cb < i)
    chosen = tl.load(OFFM + bh * NB + i - cb, mask=later, other=1)
    ok = later & (chosen == 0)
    offs_d = tl.arange(0, D)
    for m0 in tl.static_range(0, BS, BLOCK_M):
        offs_m = tile_row0 + m0 + tl.arange(0, BLOCK_M)
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
    QBLK,
    KVTILE,
    qk_scale,
    sm_scale,
    N,
    NT,
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
    SPLIT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    MAPPED: tl.constexpr,
):
    """dk, dv (unscaled, fp32) of a chunk of one head's columns over the query rows that read them un-tiled,
    from every SPLIT-th of those query tiles (split ``program_id(2)``), into that split's plane of DKC / DVC
    ``[SPLIT, B * HQ, KV, D]``. With maps, only the columns the k/v shard holds, over the query tiles the q
    shard holds (others: zero).

    With ATOMIC_DQ also adds those rows' dq contributions to the fp32 buffer DQA ``[B, N, HQ, D]``."""
    bh = tl.program_id(0)
    split = tl.program_id(2)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    idx = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col = tl.load(COLS + bh * KV + idx, mask=idx < KV, other=-1)
    valid = col >= 0
    col = tl.where(valid, col, 0)
    cb = col // BS
    key_rows, valid = _key_rows(col, valid, KVTILE, BS, MAPPED)
    offs_d = tl.arange(0, D)
    k = tl.load(
        K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + key_rows[:, None] * stride_kn + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    v = tl.load(
        V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + key_rows[:, None] * stride_vn + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
    dqa_base = DQA + (b.to(tl.int64) * N * HQ + h) * D
    dk = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    first = tl.min(tl.where(valid, cb, NB)) + 1  # the first global query tile after a column's block
    # Without maps: query tiles first..NB - 1. With maps: every local query tile, skipping those not after
    # any of the columns.
    lo = first
    hi = NB
    if MAPPED:
        lo = 0
        hi = NT
    for t in range(lo + split, hi, SPLIT):
        i = t
        tile_here = True
        if MAPPED:
            i = tl.load(QBLK + t)
            tile_here = i >= first
        if tile_here:
            dk, dv = _col_tile(
                dk,
                dv,
                k,
                v,
                valid,
                cb,
                i,
                t * BS,
                q_base,
                do_base,
                dqa_base,
                LSE,
                DELTA,
                OFFM,
                bh,
                qk_scale,
                sm_scale,
                N,
                NB,
                stride_qn,
                stride_dn,
                HQ,
                D,
                BS,
                BLOCK_M,
                ATOMIC_DQ,
            )
    out = ((split * tl.num_programs(0) + bh).to(tl.int64) * KV + idx)[:, None] * D + offs_d[None, :]
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
    KVBLK,
    QTILE,
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
    MAPPED: tl.constexpr,
):
    """dk, dv of BLOCK_N keys of local key tile j (global tile gj) of one kv head: the slash tiles of every
    query head of the group (query tiles gj + o; with maps, those the q shard holds), then that head's
    columns in the tile."""
    bhk = tl.program_id(0)
    kb = tl.program_id(1)  # block of BLOCK_N keys; low key tiles see the most query tiles: they go first
    j = kb // (BS // BLOCK_N)
    gj = j
    if MAPPED:
        gj = tl.load(KVBLK + j)
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
    key_ids = offs_n  # global positions of the keys, matched against the columns
    if MAPPED:
        key_ids = offs_n + (gj - j) * BS
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
        # The diagonal query tile gj, then the tiles gj + o; with maps, those the q shard does not hold are
        # skipped (the flags are constexpr True without maps).
        td = j
        shift = 0
        diagonal_here = True
        if MAPPED:
            td = tl.load(QTILE + gj)
            shift = (td - j) * BS
            diagonal_here = td >= 0
        if diagonal_here:
            dk, dv = _dkdv_tile(
                dk,
                dv,
                k,
                v,
                offs_n,
                td * BS,
                kb * BLOCK_N,
                shift,
                q_base,
                do_base,
                l_base,
                d_base,
                dqa_base,
                qk_scale,
                sm_scale,
                stride_qn,
                stride_dn,
                N,
                HQ,
                D,
                BS,
                BLOCK_M,
                True,
                ATOMIC_DQ,
            )
        cnt = tl.load(SCNT + bh * NB + NB - 1 - gj)  # offsets o with gj + o <= NB - 1
        for s in range(1, cnt):
            query_tile = gj + tl.load(SLASH + bh * KS + s)
            tile_here = True
            if MAPPED:
                query_tile = tl.load(QTILE + query_tile)
                tile_here = query_tile >= 0
            if tile_here:
                dk, dv = _dkdv_tile(
                    dk,
                    dv,
                    k,
                    v,
                    offs_n,
                    query_tile * BS,
                    kb * BLOCK_N,
                    0,
                    q_base,
                    do_base,
                    l_base,
                    d_base,
                    dqa_base,
                    qk_scale,
                    sm_scale,
                    stride_qn,
                    stride_dn,
                    N,
                    HQ,
                    D,
                    BS,
                    BLOCK_M,
                    False,
                    ATOMIC_DQ,
                )
        # This head's columns inside tile gj: add their un-tiled gradients (one-hot product, exact in fp32).
        c_lo = tl.load(CCNT + bh * (NB + 1) + gj)
        c_hi = tl.load(CCNT + bh * (NB + 1) + gj + 1)
        for c0 in range(c_lo, c_hi, BLOCK_C):
            idx = c0 + tl.arange(0, BLOCK_C)
            inb = idx < c_hi
            col = tl.load(COLS + bh * KV + idx, mask=inb, other=-1)
            onehot = tl.where((col[None, :] == key_ids[:, None]) & inb[None, :], 1.0, 0.0)
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
# on an H200 (benchmarks/kernel_tune.py, through ``override_launch_config``; its column pass together with
# ``_COL_SPLIT``: benchmarks/results/2026-11-30-h200-kernel_bench_col_split.md); the others are scaled from it.
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
        "col": (128, 64, 8, 2),
        "dkdv_atomic": (128, 64, 8, 3),
        "col_atomic": (64, 32, 4, 2),
    },
    (128, 128): {
        "fwd": (128, 128, 8, 3),
        "dq": (128, 128, 8, 2),
        "dkdv": (128, 64, 8, 3),
        "col": (128, 64, 8, 2),
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
# The column pass splits each chunk's query tiles over this many programs (every _COL_SPLIT-th tile each): a
# chunk's work falls with its columns' position (the sink chunk walks every query tile), and one program per
# chunk left the pass waiting on the first chunks. The splits' partial gradients are summed in a fixed order
# before the dk/dv pass, so the backward stays deterministic.
_COL_SPLIT = 4


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
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q and k/v must agree on B and N (shards of equal length); got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if index.block_size not in (64, 128):
        raise ValueError(f"block size must be 64 or 128 for the Triton kernels; got {index.block_size}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need unit stride in the head dim; call .contiguous()")


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` if its elements fill its memory without gaps or overlaps in some order (contiguous, or a permutation of
    contiguous such as ``[B, H, N, D]`` seen as ``[B, N, H, D]``), else a contiguous copy. ``torch.empty_like`` keeps
    such a tensor's strides, so a gradient allocated like its input can be written with the input's strides; a
    slice of a larger buffer (a fused qkv projection) would give it other strides."""
    return x if torch.empty_like(x).stride() == x.stride() else x.contiguous()


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


BlockMap = torch.Tensor | TileMap | None  # a shard's global block per local tile (``q_blocks`` / ``kv_blocks``)


def _placed(
    index: VerticalSlashIndex | KernelIndex, n: int, q_blocks: BlockMap, kv_blocks: BlockMap
) -> tuple[KernelIndex, TileMap | None, TileMap | None]:
    """The kernel index of a call on ``n``-token q and k/v, and its tile maps (both None: one device).

    With maps the index covers the global blocks: a ``KernelIndex``'s ``num_blocks``, else a given
    ``TileMap``'s length, else the highest block in the maps + 1 (a host sync: pass a ``KernelIndex`` or
    ``TileMap`` to avoid it). A missing map is the identity.
    """
    bs, tiles = index.block_size, -(-n // index.block_size)
    if q_blocks is None and kv_blocks is None:
        kidx = index if isinstance(index, KernelIndex) else prepare_index(index, n)
        if kidx.num_blocks != tiles:
            raise ValueError(
                f"the KernelIndex has {kidx.num_blocks} tiles but q and k/v have {tiles}; prepare it for the same "
                "length, or pass q_blocks / kv_blocks to place shards in a longer sequence"
            )
        return kidx, None, None
    if n % bs:
        raise ValueError(f"q_blocks / kv_blocks need shards of whole tiles: {n} tokens is not a multiple of {bs}")
    device = index.slash.device
    if isinstance(index, KernelIndex):
        nb = index.num_blocks
    elif isinstance(q_blocks, TileMap) or isinstance(kv_blocks, TileMap):
        nb = (q_blocks if isinstance(q_blocks, TileMap) else kv_blocks).tiles.shape[0]
    else:
        nb = int(max(tiles - 1 if m is None else m.max() for m in (q_blocks, kv_blocks))) + 1
    maps = []
    for name, m in (("q_blocks", q_blocks), ("kv_blocks", kv_blocks)):
        if m is None:
            m = torch.arange(tiles, device=device)
        if not isinstance(m, TileMap):
            m = prepare_tile_map(m.to(device), nb)
        if m.blocks.shape != (tiles,) or m.tiles.shape != (nb,) or m.blocks.device != device:
            raise ValueError(
                f"{name}: expected a map of {tiles} local tiles into {nb} global blocks on {device}; got blocks "
                f"{tuple(m.blocks.shape)}, tiles {tuple(m.tiles.shape)} on {m.blocks.device}"
            )
        maps.append(m)
    kidx = index if isinstance(index, KernelIndex) else prepare_index(index, nb * bs)
    return kidx, maps[0], maps[1]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward. q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]``; returns out ``[B, N, Hq, D]``
    (q's dtype) and lse ``[B, Hq, N]`` (fp32, natural log; -inf for rows that attend no key here).

    With ``out`` (fp32 ``[B, N, Hq, D]``) and ``lse`` (fp32 ``[B, Hq, N]``, -inf where nothing was seen yet)
    given, the result is merged into them in place (``lse <- logaddexp(lse, lse_new)``, out rescaled) and they
    are returned. ``index`` may be a ``VerticalSlashIndex`` or the ``KernelIndex`` of ``prepare_index``.

    ``q_blocks`` / ``kv_blocks`` place q and k/v, shards of whole tiles, in a global sequence: the global block
    of each local tile (integer ``[N / bs]``), or its ``TileMap`` (``prepare_tile_map``, to build once and
    reuse). The index is then the global one (a ``KernelIndex`` prepared for the global length) and the call
    computes the entries whose key is in this k/v shard. Both None (default): q and k/v are the sequence.
    """
    _check(q, k, v, index)
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    scale = resolve_softmax_scale(softmax_scale, d, "vertical_slash_forward")
    kidx, q_map, kv_map = _placed(index, n, q_blocks, kv_blocks)
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
    grid = (bsz * hq, tiles * (kidx.block_size // block_m))
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
        scale * LOG2E,
        n,
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
    q_blocks: BlockMap = None,
    kv_blocks: BlockMap = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients dq ``[B, N, Hq, D]``, dk, dv ``[B, N, Hkv, D]`` (input dtypes) of the sparse attention.

    ``out`` and ``lse`` are the forward's (lse ``[B, Hq, N]`` fp32); on shards, the rows' *final* values
    (merged over every k/v shard), so the call gives this pair's share: dq of q's rows over this k/v shard,
    dk/dv of this k/v shard from q's rows. ``q_blocks`` / ``kv_blocks`` as in the forward.
    ``deterministic=True``: a separate dq pass; every output element has one owner and a fixed reduction
    order (bitwise-repeatable). ``deterministic=False``: the dk/dv and column passes also produce dq, added
    with fp32 atomics into a zeroed fp32 buffer (two fewer matrix products per tile, no dq pass); dq's
    summation order then varies from run to run (dk and dv stay deterministic). Measured slower on an H200
    (module docstring).
    """
    _check(q, k, v, index)
    q, k, v = _dense(q), _dense(k), _dense(v)  # dq / dk / dv are written with their input's strides
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kidx, q_map, kv_map = _placed(index, n, q_blocks, kv_blocks)
    mapped = q_map is not None
    nb, bs = kidx.num_blocks, kidx.block_size
    tiles = -(-n // bs)
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
    # The query side's map into the global blocks and the k/v side's inverse, as the dq and column passes
    # read them (placeholders when not MAPPED: never read).
    forward_maps = (q_map.blocks, kv_map.tiles) if mapped else (kidx.slash, kidx.slash)
    dkc = torch.empty(_COL_SPLIT, bsz, hq, kv, d, device=q.device, dtype=torch.float32)
    dvc = torch.empty_like(dkc)
    if deterministic:
        dq = dqa = torch.empty_like(q)
        block_m, block_n, warps, stages = cfg["dq"]
        _bwd_dq_kernel[(bsz * hq, tiles * (bs // block_m))](
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
            *forward_maps,
            scale * LOG2E,
            scale,
            n,
            tiles,
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
            MAPPED=mapped,
            num_warps=warps,
            num_stages=stages,
        )
    else:
        dqa = torch.zeros(bsz, n, hq, d, device=q.device, dtype=torch.float32)
    block_c, block_m, warps, stages = cfg["col" if deterministic else "col_atomic"]
    _bwd_col_kernel[(bsz * hq, triton.cdiv(kv, block_c), _COL_SPLIT)](
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
        *forward_maps,
        scale * LOG2E,
        scale,
        n,
        tiles,
        nb,
        kv,
        *strides_qkvdo,
        HQ=hq,
        GROUP=hq // hkv,
        BS=bs,
        D=d,
        BLOCK_C=block_c,
        BLOCK_M=block_m,
        SPLIT=_COL_SPLIT,
        ATOMIC_DQ=not deterministic,
        MAPPED=mapped,
        num_warps=warps,
        num_stages=stages,
    )
    # The splits' partial sums, added in a fixed order (torch's reduction uses no atomics).
    dkc, dvc = dkc.sum(0), dvc.sum(0)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    block_n, block_m, warps, stages = cfg["dkdv" if deterministic else "dkdv_atomic"]
    _bwd_dkdv_kernel[(bsz * hkv, tiles * (bs // block_n))](
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
        kv_map.blocks if mapped else kidx.slash,  # placeholders when not MAPPED: never read
        q_map.tiles if mapped else kidx.slash,
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
        MAPPED=mapped,
        num_warps=warps,
        num_stages=stages,
    )
    if not deterministic:
        dq = dqa.to(q.dtype)
    return dq, dk, dv
