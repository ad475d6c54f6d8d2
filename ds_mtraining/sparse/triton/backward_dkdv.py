"""The backward's column and dk/dv passes: their Triton kernels, launched by ``vertical_slash_backward``.

* Column pass: ``SPLIT`` programs (``launch_config.column_splits``) per (b·hq, chunk of ``BLOCK_C`` columns of
  ``COLS``), each walking every ``SPLIT``-th query tile after the columns' block, that accumulates the columns' dk/dv
  over the rows that read them un-tiled (``OFFM``: the whole index's bitmap) into its plane of an fp32 buffer
  ``[split, B, Hq, Kv, D]``, whose planes the launcher sums in a fixed order. With tile maps: only the columns the k/v
  shard holds, over the q shard's tiles; a chunk with none walks no tile and writes nothing (no pass reads it). A
  ring step's index keeps its shard's columns first and is cut to their number for the backward
  (``kernel_index.narrow_columns``), so its buffer is as wide as the columns it holds, not the whole index's list.
* dk/dv pass: one program per (b·hkv, key tile j, global ``gj``) that loops over the query heads of its GQA group,
  each walking its offsets ``SLASH[bh, 1:SCNT[bh, span]]`` (query tiles ``gj + o``, ``span`` the last that exists or,
  with documents, that may reach the tile; with maps, through the q shard's inverse map), then adds the head's column
  gradients that fall in tile j (``COLS[bh, CCNT[bh, gj]:CCNT[bh, gj + 1]]``, from the summed planes)
  to their keys' rows, loaded by row: exact in fp32. A one-hot matrix product did it before (fp32 FMAs,
  ``[BLOCK_N, BLOCK_C] x [BLOCK_C, D]`` for the one or two columns of a tile), and every ring rank, which merges every
  column for its own queries, paid the one-device merge again: 40 of the 62 ms that the pass took over one device at
  256K / W 32, summed over the ranks (one H200). A ring step's index
  (``parallel.ring.shard_index``) holds only the offsets that join the q shard's tiles to the k/v shard's, the same
  from the key side, and the k/v shard's columns (``forward``'s module docstring). With maps, a program whose group
  has no diagonal tile, offset or column there stores its zero rows without loading k, v or anything of q.

With packed documents (``DOCS``) both passes stop their loops over query tiles at the last one whose first row's
document starts at or before the key tile (or the column chunk's last column), read from ``QLAST``
(``document_tiles.last_query_tiles``), and mask each key for the query rows whose document starts after it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import diagonal_tile, tile_program


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
    key_ids,
    s_base,
    q_base,
    do_base,
    l_base,
    d_base,
    here,
    qk_scale,
    stride_qn,
    stride_dn,
    N,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DIAGONAL: tl.constexpr,
    DOCS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """dk, dv of one key block ``k, v [BLOCK_N, D]`` (local rows ``offs_n``, the first ``key_lo``) from the
    query tile at local row ``tile_row0`` (transposed scores). DIAGONAL: query row r is causal for key row
    ``offs_n`` iff ``offs_n + shift <= r`` (``shift``: query tile row minus key tile row, 0 on one device), and
    the query sub-blocks that end before the block's first key are skipped. DOCS: a key is masked for the query
    rows whose document starts after it (``key_ids``: the keys' global positions; ``s_base``: the rows' starts).
    MASKED: the tile counts only where ``here`` (a stand-in for a query tile the q shard does not hold, as in the
    forward's ``_fwd_tile``).
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
            if DOCS:
                starts = tl.load(s_base + offs_m, mask=rows, other=0)
                pt = tl.where(key_ids[:, None] >= starts[None, :], pt, 0.0)
            if MASKED:
                pt = tl.where(here, pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
            dk += tl.dot(dst, q)
    return dk, dv


@triton.jit
def _col_tile(
    dk,
    dv,
    k,
    v,
    valid,
    col,
    cb,
    i,
    tile_row0,
    s_base,
    q_base,
    do_base,
    LSE,
    DELTA,
    OFFM,
    bh,
    qk_scale,
    N,
    NB,
    stride_qn,
    stride_dn,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOCS: tl.constexpr,
):
    """dk, dv of a chunk of columns (global positions ``col``, blocks ``cb``) from global query tile ``i`` at local
    row ``tile_row0``: the columns before the tile whose offset is not chosen (DOCS: and, per row, not before the
    row's document start, read from ``s_base``)."""
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
        seen = ok[:, None]
        if DOCS:
            starts = tl.load(s_base + offs_m, mask=rows, other=0)
            seen = seen & (col[:, None] >= starts[None, :])
        pt = tl.where(seen, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do)
        dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk += tl.dot(dst, q)
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
    COLS,
    OFFM,
    QBLK,
    COLROWS,
    DSTART,
    QLAST,
    qk_scale,
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
    MAPPED: tl.constexpr,
    DOCS: tl.constexpr,
):
    """dk, dv (unscaled, fp32) of a chunk of one head's columns over the query rows that read them un-tiled,
    from every SPLIT-th of those query tiles (split ``program_id(2)``), into that split's plane of DKC / DVC
    ``[SPLIT, B * HQ, KV, D]``. With maps, only the columns the k/v shard holds, over the query tiles the q
    shard holds (others: zero). With documents (DOCS), only up to the last query tile whose documents may reach the
    chunk's last column (QLAST, ``document_tiles.last_query_tiles``)."""
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
    key_rows = col
    if MAPPED:  # the columns' local rows, -1 where padding or not held (``KernelIndex.column_rows``)
        key_rows = tl.load(COLROWS + bh * KV + idx, mask=idx < KV, other=-1)
        valid = valid & (key_rows >= 0)
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
    dk = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    first = tl.min(tl.where(valid, cb, NB)) + 1  # the first global query tile after a column's block
    # Without maps: query tiles first..NB - 1. With maps: every local query tile, skipping those not after
    # any of the columns; none when the chunk holds no column of the k/v shard (a ring step's index keeps the
    # shard's columns first, the rest of its rows padding).
    lo = first
    hi = NB
    if MAPPED:
        lo = 0
        hi = tl.where(first <= NB, NT, 0)
    # Documents: the query tiles after the last one whose first row's document starts at or before the chunk's
    # last column attend none of its columns.
    last = NB  # a placeholder without documents: never read
    if DOCS:
        last = tl.load(QLAST + b * NB + tl.max(tl.where(valid, col, 0)) // BS)
        if not MAPPED:
            hi = last + 1
    for t in range(lo + split, hi, SPLIT):
        i = t
        tile_here = True
        if MAPPED:
            i = tl.load(QBLK + t)
            tile_here = i >= first
            if DOCS:
                tile_here = tile_here & (i <= last)
        if tile_here:
            dk, dv = _col_tile(
                dk,
                dv,
                k,
                v,
                valid,
                col,
                cb,
                i,
                t * BS,
                DSTART + b * N,
                q_base,
                do_base,
                LSE,
                DELTA,
                OFFM,
                bh,
                qk_scale,
                N,
                NB,
                stride_qn,
                stride_dn,
                D,
                BS,
                BLOCK_M,
                DOCS,
            )
    if tl.max(valid.to(tl.int32), 0) > 0:  # the dk/dv pass reads only the chunks' columns that the k/v shard holds
        out = ((split * tl.num_programs(0) + bh).to(tl.int64) * KV + idx)[:, None] * D + offs_d[None, :]
        tl.store(DKC + out, dk, mask=(idx < KV)[:, None])
        tl.store(DVC + out, dv, mask=(idx < KV)[:, None])


@triton.jit
def _dkdv_bounds(SCNT, CCNT, bh, gj, span, NB, tile, TILES, KEY_LISTS: tl.constexpr):
    """What head ``bh`` walks for key tile ``gj``: the offsets ``s in [1, cnt)`` (those ``<= span``; scount[x]
    counts the offsets ``<= x``, offset 0 first; none when ``span < 0``; KEY_LISTS: the count of its shard's local key
    tile ``tile`` of ``TILES``, ``kernel_index.key_counts``) and its columns inside the tile, positions ``[c_lo,
    c_hi)`` of its column list."""
    if KEY_LISTS:
        cnt = tl.load(SCNT + bh * TILES + tile)
    else:
        cnt = tl.where(span >= 0, tl.load(SCNT + bh * NB + tl.maximum(span, 0)), 0)
    c_lo = tl.load(CCNT + bh * (NB + 1) + gj)
    c_hi = tl.load(CCNT + bh * (NB + 1) + gj + 1)
    return cnt, c_lo, c_hi


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
    SLASH,
    SCNT,
    COLS,
    CCNT,
    KVBLK,
    QTILE,
    DSTART,
    QLAST,
    qk_scale,
    sm_scale,
    N,
    NKV,
    NB,
    KS,
    KV,
    KEY_STRIDE_S,
    KEY_STRIDE_C,
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
    MAPPED: tl.constexpr,
    KEY_LISTS: tl.constexpr,
    DOCS: tl.constexpr,
):
    """dk, dv of BLOCK_N keys of local key tile j (global tile gj) of one kv head: the slash tiles of every
    query head of the group (query tiles gj + o; with maps, those the q shard holds), then that head's
    columns in the tile. With documents (DOCS), only the query tiles up to the last one whose documents may reach the
    tile (QLAST), the keys masked per query row. K/V of several shards (an all-gathered ring group, each shard as long
    as q): the offsets of tile j's shard, ``SLASH`` / ``SCNT`` moved by ``KEY_STRIDE_S`` / ``KEY_STRIDE_C`` per shard
    (0: one list for every shard); KEY_LISTS: ``SCNT`` counts them per local key tile of the shard."""
    # kb: the block of BLOCK_N keys; low key tiles see the most query tiles: they go first
    bhk, kb = tile_program(tl.cdiv(NKV, BS) * (BS // BLOCK_N))
    j = kb // (BS // BLOCK_N)
    gj = j
    tiles = tl.cdiv(N, BS)  # a shard's tiles (KEY_LISTS)
    tile = j
    if MAPPED:
        gj = tl.load(KVBLK + j)
        shard = j // tiles
        tile = j - shard * tiles
        SLASH += shard * KEY_STRIDE_S
        SCNT += shard * KEY_STRIDE_C
    b = bhk // HKV
    hk = bhk % HKV
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    keys = offs_n < NKV
    key_ids = offs_n  # global positions of the keys, matched against the columns
    if MAPPED:
        key_ids = offs_n + (gj - j) * BS
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    span = NB - 1 - gj  # the offsets o with gj + o <= NB - 1
    if DOCS:  # up to the last query tile whose first row's document starts by this tile's end
        span = tl.load(QLAST + b * NB + gj) - gj  # negative if none (shards only): no work at all
    # The diagonal query tile gj, then the tiles gj + o; with maps, those the q shard does not hold are skipped (the
    # flags are constexpr True without maps).
    td, shift, diagonal_here = diagonal_tile(QTILE, gj, j, BS, MAPPED)
    # A ring step's program whose group has no diagonal tile, offset or column here stores its zeros without loading
    # k, v or anything of q.
    run = True
    if MAPPED:
        run = diagonal_here
        for member in tl.static_range(GROUP):  # not `g`: the loop below makes that a runtime int
            cnt, c_lo, c_hi = _dkdv_bounds(
                SCNT, CCNT, b * HQ + hk * GROUP + member, gj, span, NB, tile, tiles, KEY_LISTS
            )
            run = run | (cnt > 1) | (c_hi > c_lo)
    if run:
        k_rows = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
        v_rows = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn
        k = tl.load(k_rows + offs_d[None, :], mask=keys[:, None], other=0.0)
        v = tl.load(v_rows + offs_d[None, :], mask=keys[:, None], other=0.0)
        for g in range(GROUP):
            h = hk * GROUP + g
            bh = b * HQ + h
            q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            do_base = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
            l_base = LSE + bh.to(tl.int64) * N
            d_base = DELTA + bh.to(tl.int64) * N
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
                    key_ids,
                    DSTART + b * N,
                    q_base,
                    do_base,
                    l_base,
                    d_base,
                    True,
                    qk_scale,
                    stride_qn,
                    stride_dn,
                    N,
                    D,
                    BS,
                    BLOCK_M,
                    True,
                    DOCS,
                    False,
                )
            cnt, c_lo, c_hi = _dkdv_bounds(SCNT, CCNT, bh, gj, span, NB, tile, tiles, KEY_LISTS)
            # With maps, a query tile the q shard does not hold is masked out, not skipped (as the forward: no
            # branch in the loop).
            for s in range(1, cnt):
                query_tile = gj + tl.load(SLASH + bh * KS + s)
                here = True
                if MAPPED:
                    query_tile = tl.load(QTILE + query_tile)
                    here = query_tile >= 0
                    query_tile = tl.maximum(query_tile, 0)
                dk, dv = _dkdv_tile(
                    dk,
                    dv,
                    k,
                    v,
                    offs_n,
                    query_tile * BS,
                    kb * BLOCK_N,
                    0,
                    key_ids,
                    DSTART + b * N,
                    q_base,
                    do_base,
                    l_base,
                    d_base,
                    here,
                    qk_scale,
                    stride_qn,
                    stride_dn,
                    N,
                    D,
                    BS,
                    BLOCK_M,
                    False,
                    DOCS,
                    MAPPED,
                )
            # This head's columns inside tile gj: their un-tiled gradients added to their keys' rows, loaded by row
            # (module docstring).
            for c0 in range(c_lo, c_hi, BLOCK_C):
                idx = c0 + tl.arange(0, BLOCK_C)
                inb = idx < c_hi
                col = tl.load(COLS + bh * KV + idx, mask=inb, other=-1)
                match = (col[None, :] == key_ids[:, None]) & inb[None, :]  # [BLOCK_N, BLOCK_C]: key n is column c
                hit = tl.max(match.to(tl.int32), 1) > 0
                pos = tl.sum(tl.where(match, idx[None, :], 0), 1)
                src = (bh.to(tl.int64) * KV + pos)[:, None] * D + offs_d[None, :]
                dk += tl.load(DKC + src, mask=hit[:, None], other=0.0)
                dv += tl.load(DVC + src, mask=hit[:, None], other=0.0)
    dk_ptrs = (
        DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    )
    dv_ptrs = (
        DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
    )
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=keys[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=keys[:, None])
