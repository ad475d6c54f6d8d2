"""What the forward and the backward passes share: a program's place in its launch (``tile_program``), a query-tile
program's walk of the index (``query_tile``,
``slash_tile``, ``column_chunk``: the forward and the dq pass visit the same tiles and columns and differ only in what
they do with each), the placement of a program's diagonal tile under maps (``diagonal_tile``, which the dk/dv pass
uses from the key side), the ``@triton.jit`` load of a slash tile's keys, and the launchers' input check.

Limits (``check_inputs``): head dim 64 or 128; block size 64 or 128; fp16 / bf16 / fp32 inputs (fp32 dots run as
tf32 on GPU, relative error ~2e-3; fp32 uses small untuned tiles); q, k, v need unit stride in the head dim and the
same length (with maps: whole tiles); positions and per-head offsets must fit int32; the softmax scale must be
positive and finite (the kernels take row maxima of the unscaled scores, whose order a positive scale keeps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scale import resolve_softmax_scale


@triton.jit
def tile_program(PER_ROW):
    """This program's row (a batch x head) and its slot among the row's ``PER_ROW`` tile programs, in a launch of
    ``rows x PER_ROW`` programs on grid axis 0, rows fastest: the order a ``(rows, PER_ROW)`` grid runs in, without its
    axis-1 limit of 65535 (4M tokens in tiles of 64 are 65536; CUDA refuses such a launch as an invalid argument)."""
    pid = tl.program_id(0)
    rows = tl.num_programs(0) // PER_ROW
    return pid % rows, pid // rows


@triton.jit
def query_tile(
    QBLK,
    KVTILE,
    SCNT,
    CCNT,
    DSTART,
    N,
    NT,
    NB,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MAPPED: tl.constexpr,
    DOCS: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
):
    """What a query-tile program (``tile_program``: batch x query head ``bh``, then its ``BLOCK_M`` rows, most work
    first) walks: its batch ``b``, head ``h`` and kv head ``hk``, its rows, its global tile ``i`` (what the index is
    about), the diagonal key tile (with maps: where the k/v shard holds it, ``kd`` local and ``shift`` its rows' offset;
    ``diagonal_here``), the offsets ``SLASH[bh, 1:cnt]`` and the columns ``COLS[bh, col_lo:ncol]``; ``run`` False
    where ``EARLY_EXIT`` and the program has none of the three in the shard (it may stop before loading anything).

    Documents: the first row's start (the smallest: starts never decrease in a tile) bounds the loops, so the key
    tiles and the columns before its block are not visited (``document_tiles``)."""
    per_head = NT * (BS // BLOCK_M)
    bh, slot = tile_program(per_head)
    rb = per_head - 1 - slot
    t = rb // (BS // BLOCK_M)  # its local query tile
    i = t
    if MAPPED:
        i = tl.load(QBLK + t)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_end = (rb + 1) * BLOCK_M
    slash_end = i
    col_lo = 0
    if DOCS:
        first_block = tl.load(DSTART + b * N + tl.minimum(rb * BLOCK_M, N - 1)) // BS
        slash_end = i - first_block
        col_lo = tl.load(CCNT + bh * (NB + 1) + first_block)
    # scount[x] counts the offsets <= x; offset 0, the diagonal, is the first.
    kd, shift, diagonal_here = diagonal_tile(KVTILE, i, t, BS, MAPPED)
    cnt = tl.load(SCNT + bh * NB + slash_end)
    ncol = tl.load(CCNT + bh * (NB + 1) + i)
    run = True
    if EARLY_EXIT:
        run = diagonal_here | (cnt > 1) | (ncol > col_lo)
    return bh, b, h, hk, offs_m, row_end, i, col_lo, kd, shift, diagonal_here, cnt, ncol, run


@triton.jit
def diagonal_tile(INVERSE, g, t, BS: tl.constexpr, MAPPED: tl.constexpr):
    """Where the other side of the call holds global tile ``g``, the diagonal of a program whose own local tile is
    ``t`` (query side: the key tile; the dk/dv pass: the query tile): its local tile, its rows' offset from ``t``'s
    (``(tile - t) * BS``) and whether it is held (``INVERSE``, that side's map from global tiles to local ones, -1 where
    not held). Without maps: ``t`` itself, 0, constexpr True."""
    tile = t
    shift = 0
    here = True
    if MAPPED:
        tile = tl.load(INVERSE + g)
        shift = (tile - t) * BS
        here = tile >= 0
    return tile, shift, here


@triton.jit
def slash_tile(SLASH, KVTILE, bh, KS, i, s, MAPPED: tl.constexpr):
    """The key tile of query tile ``i``'s ``s``-th offset: its global block, its local tile, and whether the k/v shard
    holds it (``here``: constexpr True without maps). A tile not held is masked out, not skipped, by the caller: a
    branch in the loop would keep Triton from pipelining its loads, and a ring step's own offsets
    (``parallel.ring.shard_index``) reach its shard."""
    key_block = i - tl.load(SLASH + bh * KS + s)
    key_tile = key_block
    here = True
    if MAPPED:
        key_tile = tl.load(KVTILE + key_block)
        here = key_tile >= 0
        key_tile = tl.maximum(key_tile, 0)
    return key_block, key_tile, here


@triton.jit
def column_chunk(
    COLS,
    COLROWS,
    OFFM,
    k_base,
    v_base,
    offs_d,
    stride_kn,
    stride_vn,
    bh,
    KV,
    NB,
    i,
    c0,
    ncol,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAPPED: tl.constexpr,
):
    """The ``BLOCK_N`` columns ``COLS[bh, c0:]`` (up to ``ncol``) of query tile ``i``: their positions, K transposed
    ``[D, BLOCK_N]`` and V ``[BLOCK_N, D]`` gathered at their rows, and ``ok``: attended, i.e. not inside a chosen tile
    of any offset (the bitmap is the whole index's) and, with maps, held by the k/v shard.

    With maps each column's local row is read (``COLROWS``, -1: not held; gathering its tile from ``KVTILE`` instead
    took the forward from 187 registers to 229 on sm_90), and the bitmap only where it is >= 0: a column past the list
    or not held reads as chosen, so ``chosen`` alone masks (an ``& inb`` / ``& (rows >= 0)`` beside it cost the dq
    kernel 30-50 registers)."""
    idx = c0 + tl.arange(0, BLOCK_N)
    inb = idx < ncol
    col = tl.load(COLS + bh * KV + idx, mask=inb, other=0)
    rows = col
    listed = inb
    if MAPPED:
        rows = tl.load(COLROWS + bh * KV + idx, mask=inb, other=-1)
        listed = rows >= 0
    chosen = tl.load(OFFM + bh * NB + i - col // BS, mask=listed, other=1)
    ok = chosen == 0
    kt = tl.load(k_base + rows[None, :] * stride_kn + offs_d[:, None], mask=ok[None, :], other=0.0)
    v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None], other=0.0)
    return col, kt, v, ok


@triton.jit
def slash_kv(k_base, v_base, offs_n, offs_d, stride_kn, stride_vn, N, DIAGONAL: tl.constexpr):
    """K transposed ``[D, BLOCK_N]`` and V ``[BLOCK_N, D]`` at local key rows ``offs_n`` of a slash tile: masked
    past N only on the diagonal tile (the last tile of a row), whole below it."""
    if DIAGONAL:
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
    else:
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None])
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
    return kt, v


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, softmax_scale: float | None, caller: str
) -> float:
    """Raise ``ValueError`` unless q ``[B, N, Hq, D]`` and k, v ``[B, N_kv, Hkv, D]`` are within the limits of the
    module docstring; returns the softmax scale (``resolve_softmax_scale``: ``None`` is ``1 / sqrt(D)``), the
    errors naming ``caller``."""
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
    if q.shape[0] != k.shape[0]:  # the lengths are checked against the index and the tile maps (``place``)
        raise ValueError(f"q and k/v must agree on B; got {tuple(q.shape)} and {tuple(k.shape)}")
    if block_size not in (64, 128):
        raise ValueError(f"block size must be 64 or 128 for the Triton kernels; got {block_size}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need unit stride in the head dim; call .contiguous()")
    return resolve_softmax_scale(softmax_scale, q.shape[-1], caller)
