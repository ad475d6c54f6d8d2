"""The ``"spread"`` estimator's greedy rounds (``estimator.spread.greedy``) as Triton kernels.

The PyTorch rounds are ~30 kernels each over ``[B·Hq, m, Kc]`` tensors (16 x 128 x 2052 at 128K tokens), each
reading and writing tens of MB: ~7 ms on an H200 even replayed from a CUDA graph. One program per head running
every round is no better (7.4 ms measured: 16 programs on 132 SMs, each a chain of reductions). Here a round is
five kernels, most spread over many programs per head:

1. ``_columns_kernel`` (per head x chunk of candidates): each candidate's residual (rows not under a chosen
   offset), far-entry sum, count and top two over the observation rows, cost, ratio and forecast; per row, the
   prefix sums of the chosen columns' attention over the chunk (what chosen columns take out of an offset's
   mass), whose chunk totals ``_carry_kernel`` turns into carries. Chunks of candidates, not ranges of key
   blocks: candidates crowd where attention is strong (diffuse attention: the first few thousand keys), and one
   program per crowded range took 7.8 ms;
2. ``_offsets_kernel`` (per head x range of offsets): each offset's block mass minus the chosen columns inside
   it, cost, ratio and forecast;
3. ``_rank_kernel`` (per head x range of ratios): the rank of each ratio among all of the head's, as a unique
   int64 key (the fp64 bits with the low ``IDX_BITS`` replaced by the inverted position: equal ratios order by
   position, like a stable sort), counting until every ratio of the program ranks past the round's ``picks``;
   the best ``picks`` land in rank order, so nothing is sorted;
4. ``_pick_kernel`` (per head): the PyTorch greedy's prefix rules on the ranked picks, the chosen flags, and the
   prefix counts the next round's costs read (``_summary``). A head whose round picks nothing is done: its state
   is a fixed point, so every pass of the later rounds returns at once for it.

After the rounds ``_emit_kernel`` writes the chosen columns and offsets as canonical index rows from those prefix
counts.

Covered mass is summed from per-program partials in a fixed order, so results are deterministic; sums are fp64
over fp32 inputs like the PyTorch path, so both agree up to summation order (ratios closer than
``2**-(52 - IDX_BITS)`` relative order by position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..spread.greedy_problem import GreedyProblem
    from ..spread.settings import SpreadSettings

__all__ = ["greedy_rounds"]

# Launch knobs from sweeps of the whole greedy on an H200 at 128K (random q/k, every round to the caps; numbers in
# docs/measurements.md, "The greedy's rounds"): tiles of 2048 over 4096 and 8192, 16 ratios per
# rank program over 32-256, 512 compared per step over 128-1024; more or fewer warps were slower.
_TILE = 2048  # elements of a [rows, candidates] or [rows, offsets] tile
_RANKED = 16  # ratios ranked per program
_AGAINST = 512  # ratios each ranked one is compared with per step
_CARRIED = 64  # chunk totals per step of the carry pass
_NEG = tl.constexpr(float("-inf"))


@triton.jit
def _summary(
    g, CO, CC, CF, CCUM, COUNTS, ORDER, SHORT_BY, FIRST, CSPAN, SSPAN, LO, HI, ATL, SHORT, nb, kc, short_last, sinks,
    forced_off, BLOCK: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """Head ``g``'s prefix counts of free offsets (``CF``, a column's cost) and of chosen columns (``CCUM``, the
    emitted slots), the chosen counts beyond the forced ones (``COUNTS``: offsets, columns), and what the chosen
    columns take out of each offset's cost: ``ATL[s]``, the chosen columns with ``span >= s``, and ``SHORT[s]``, the
    rows their tiles at offset ``s`` lack (sum of ``bs - last_rows`` over the chosen columns with ``span == s``).

    DOCS: those two come from prefix sums in span order (``ORDER``: the candidates sorted by span; ``SHORT_BY``:
    their ``bs - last_rows`` in that order; ``FIRST[s]``: the sorted position of the first span ``>= s``; ``CSPAN`` /
    ``SSPAN``: scratch), not atomic counts: many chosen columns share a span, and this is one program per head.
    One document a row: a column's span is its block's distance to the last block, so they are ``CCUM`` at the key
    block ``nb - 1 - s``'s candidate range [``LO``, ``HI``), and the last block lacks ``short_last`` rows."""
    CO += g * nb
    CC += g * kc
    CF += g * (nb + 1)
    CCUM += g * (kc + 1)
    COUNTS += g * 2
    ATL += g * nb
    SHORT += g * nb
    carry = 0
    for s0 in range(0, nb, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        co = tl.load(CO + s, mask=s < nb, other=0).to(tl.int32)
        free = ((co == 0) & (s >= 1) & (s < nb)).to(tl.int32)
        tl.store(CF + s + 1, tl.cumsum(free, 0) + carry, mask=s < nb)
        carry += tl.sum(free, 0)
    tl.store(COUNTS, nb - carry - forced_off)  # every offset is free or chosen (offset 0 always chosen)
    carry = 0
    carry_short = 0
    for c0 in range(0, kc, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cc = tl.load(CC + c, mask=c < kc, other=0).to(tl.int32)
        tl.store(CCUM + c + 1, tl.cumsum(cc, 0) + carry, mask=c < kc)
        if DOCS:
            order = tl.load(ORDER + g * kc + c, mask=c < kc, other=0)
            by_span = tl.load(CC + order, mask=c < kc, other=0).to(tl.int32)
            short = by_span * tl.load(SHORT_BY + g * kc + c, mask=c < kc, other=0)
            tl.store(CSPAN + g * (kc + 1) + c + 1, tl.cumsum(by_span, 0) + carry, mask=c < kc)
            tl.store(SSPAN + g * (kc + 1) + c + 1, tl.cumsum(short, 0) + carry_short, mask=c < kc)
            carry_short += tl.sum(short, 0)
        carry += tl.sum(cc, 0)  # the same total in either order
    tl.store(COUNTS + 1, carry - sinks)
    tl.debug_barrier()  # the prefix sums are stored before they are read at other positions
    for s0 in range(0, nb, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        s_ok = s < nb
        if DOCS:
            lo = tl.load(FIRST + g * (nb + 1) + s, mask=s_ok, other=0)
            hi = tl.load(FIRST + g * (nb + 1) + s + 1, mask=s_ok, other=0)
            at_least = carry - tl.load(CSPAN + g * (kc + 1) + lo, mask=s_ok, other=0)
            short = tl.load(SSPAN + g * (kc + 1) + hi, mask=s_ok, other=0)
            short -= tl.load(SSPAN + g * (kc + 1) + lo, mask=s_ok, other=0)
        else:
            t = tl.where(s_ok, nb - 1 - s, 0)
            at_least = tl.load(CCUM + tl.load(HI + g * nb + t, mask=s_ok, other=0), mask=s_ok, other=0)
            in_last = at_least - tl.load(CCUM + tl.load(LO + g * nb + t, mask=s_ok, other=0), mask=s_ok, other=0)
            short = short_last * in_last
        tl.store(ATL + s, at_least, mask=s_ok)
        tl.store(SHORT + s, short, mask=s_ok)


@triton.jit
def _key(ratio, i, IDX_BITS: tl.constexpr):
    """Unique int64 sort key of ``ratio`` at position ``i``; -1 where not eligible."""
    bits = ratio.to(tl.int64, bitcast=True)
    return tl.where(ratio > _NEG, ((bits >> IDX_BITS) << IDX_BITS) | ((1 << IDX_BITS) - 1 - i), -1)


@triton.jit
def _init_kernel(
    CO, CC, CF, CCUM, COUNTS, ORDER, SHORT_BY, FIRST, CSPAN, SSPAN, LO, HI, ATL, SHORT, nb, kc, short_last, sinks,
    forced_off, BLOCK: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0).to(tl.int64)
    tl.store(CF + g * (nb + 1), 0)
    tl.store(CCUM + g * (kc + 1), 0)
    if DOCS:
        tl.store(CSPAN + g * (kc + 1), 0)
        tl.store(SSPAN + g * (kc + 1), 0)
    _summary(g, CO, CC, CF, CCUM, COUNTS, ORDER, SHORT_BY, FIRST, CSPAN, SSPAN, LO, HI, ATL, SHORT, nb, kc, short_last,
             sinks, forced_off, BLOCK, DOCS)  # fmt: skip


@triton.jit
def _columns_kernel(
    A,
    CAND,
    ROWS,
    RSTART,
    SPAN,
    LAST,
    CO,
    CC,
    CF,
    COUNTS,
    CUM,
    TOTAL,
    R,
    F,
    COVP,
    DONE,
    m,
    nb,
    kc,
    seqlen,
    bs,
    exclusion,
    max_columns,
    min_ratio,
    n_progs,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOCS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    if tl.load(DONE + g) != 0:
        return
    j = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    big_l = nb + kc
    CO += g * nb
    CF += g * (nb + 1)
    n_cols = tl.load(COUNTS + g * 2 + 1)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < m
    rows = tl.load(ROWS + offs_m, mask=row_ok, other=0)
    row_block = rows // bs

    c = j * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = c < kc
    cand = tl.load(CAND + g * kc + c, mask=col_ok, other=seqlen)
    real = cand < seqlen
    cand_block = tl.where(real, cand // bs, nb)
    # A column's cost reaches its document's rows below its block: offsets 1 .. span, the last one partial. One
    # document a row: to the row's end, in closed form (loading them made this kernel 0.30 -> 0.43 ms at 128K).
    if DOCS:
        row_start = tl.load(RSTART + g * m + offs_m, mask=row_ok, other=0)
        span = tl.load(SPAN + g * kc + c, mask=col_ok, other=0)
        short = bs - tl.load(LAST + g * kc + c, mask=col_ok, other=bs)
    else:
        span = tl.maximum(nb - 1 - cand_block, 0)
        short = nb * bs - seqlen  # the rows the row's last block lacks
    cc = tl.load(CC + g * kc + c, mask=col_ok, other=0).to(tl.int32)
    off = row_block[:, None] - cand_block[None, :]
    reach = (off >= 0) & row_ok[:, None] & col_ok[None, :]
    under = tl.load(CO + tl.minimum(tl.maximum(off, 0), nb - 1), mask=reach, other=1)
    uncovered = reach & (under == 0)
    tile = (g * m + offs_m[:, None]) * kc + c[None, :]
    x = tl.load(A + tile, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    resid_sum = tl.sum(tl.where(uncovered, x, 0.0).to(tl.float64), 0)
    far = uncovered & (rows[:, None] - cand[None, :] >= exclusion) & real[None, :]
    if DOCS:
        far &= cand[None, :] >= row_start[:, None]  # the column's document
    far_x = tl.where(far, x, 0.0)
    far_rows = tl.sum(far.to(tl.int32), 0)
    first = tl.max(far_x, 0)
    second = tl.max(tl.where(far_x < first[None, :], far_x, 0.0), 0)
    spikes = first.to(tl.float64) + second.to(tl.float64)
    col_ratio = (tl.sum(far_x.to(tl.float64), 0) - spikes) / tl.maximum(far_rows - 2, 1).to(tl.float64)
    # Cost: those rows in the tiles of unchosen offsets.
    free_span = (tl.load(CO + span, mask=col_ok, other=1) == 0) & (span >= 1)
    cost = bs * tl.load(CF + span + 1, mask=col_ok, other=0) - short * free_span.to(tl.int32)
    ok = (cc == 0) & real & (cost > 0) & (far_rows > 2) & (n_cols < max_columns)
    ratio = tl.where(ok, col_ratio, _NEG)
    ratio = tl.where((ratio > 0) & (ratio >= min_ratio), ratio, _NEG)
    tl.store(R + g * big_l + nb + c, ratio, mask=col_ok)
    tl.store(F + g * big_l + nb + c, resid_sum / m, mask=col_ok)
    tl.store(COVP + g * n_progs + j, tl.sum(tl.where(cc == 1, resid_sum, 0.0), 0))
    # Per row, the chosen columns' attention summed up to each candidate of this chunk, and the chunk's total
    # (``_carry_kernel`` turns the totals into each chunk's offset).
    chosen_x = tl.where(cc[None, :] == 1, x, 0.0).to(tl.float64)
    tl.store(CUM + tile, tl.cumsum(chosen_x, 1), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(TOTAL + (g * m + offs_m) * n_chunks + j, tl.sum(chosen_x, 1), mask=row_ok)


@triton.jit
def _carry_kernel(TOTAL, DONE, m, n_chunks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per row, the chunk totals -> the sum over the chunks before each (exclusive prefix), in place."""
    g = tl.program_id(0).to(tl.int64)
    if tl.load(DONE + g) != 0:
        return
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < m
    carry = tl.zeros([BLOCK_M], tl.float64)
    for n0 in range(0, n_chunks, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        at = TOTAL + (g * m + offs_m[:, None]) * n_chunks + n[None, :]
        ok = row_ok[:, None] & (n[None, :] < n_chunks)
        total = tl.load(at, mask=ok, other=0.0)
        running = tl.cumsum(total, 1) + carry[:, None]
        tl.store(at, running - total, mask=ok)
        # The next carry is the running sum's last column (masked chunks add 0), not `carry += tl.sum(total)`:
        # Triton 3.6 aborts compiling that accumulate pattern when n_chunks is a multiple of 16 (its
        # thread-locality pass asserts on the unused loop result; SmolLM2 at 2K tokens has 128 chunks).
        carry = tl.sum(tl.where(n[None, :] == n0 + BLOCK_N - 1, running, 0.0), 1)


@triton.jit
def _offsets_kernel(
    MASS,
    LO,
    HI,
    ROWS,
    OFF_ROWS,
    OFF_SCALE,
    CO,
    ATL,
    SHORT,
    COUNTS,
    CUM,
    CARRY,
    R,
    F,
    COVP,
    DONE,
    m,
    nb,
    kc,
    bs,
    forced_off,
    max_offsets,
    min_ratio,
    n_progs,
    n_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    if tl.load(DONE + g) != 0:
        return
    j = tl.program_id(1)
    big_l = nb + kc
    MASS += g * m * nb
    LO += g * nb
    HI += g * nb
    CO += g * nb
    CUM += g * m * kc
    n_offs = tl.load(COUNTS + g * 2)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < m
    row_block = tl.load(ROWS + offs_m, mask=row_ok, other=0) // bs
    s = j * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < nb
    co = tl.load(CO + s, mask=s_ok, other=1)
    # The chosen columns' attention inside key block kb = b_i - s: candidates [lo, hi), from the column pass's
    # per-chunk prefix sums plus the chunks' carries.
    kb = row_block[:, None] - s[None, :]
    seen = (kb >= 0) & row_ok[:, None] & s_ok[None, :]
    lo = tl.load(LO + kb, mask=seen, other=0)
    hi = tl.load(HI + kb, mask=seen, other=0)
    row_cum = CUM + offs_m[:, None] * kc
    row_carry = CARRY + (g * m + offs_m[:, None]) * n_chunks
    some = seen & (hi > lo)
    upto_hi = tl.load(row_cum + hi - 1, mask=some, other=0.0) + tl.load(
        row_carry + (hi - 1) // BLOCK_C, mask=some, other=0.0
    )
    before = some & (lo > 0)
    upto_lo = tl.load(row_cum + lo - 1, mask=before, other=0.0) + tl.load(
        row_carry + (lo - 1) // BLOCK_C, mask=before, other=0.0
    )
    mass = tl.load(MASS + offs_m[:, None] * nb + s[None, :], mask=row_ok[:, None] & s_ok[None, :], other=0.0)
    mass = mass.to(tl.float64)
    resid = tl.sum(tl.where(seen, tl.maximum(mass - (upto_hi - upto_lo), 0.0), 0.0), 0)
    tl.store(COVP + g * n_progs + n_chunks + j, tl.sum(tl.sum(tl.where(co[None, :] == 1, mass, 0.0), 1), 0))
    # Cost: the offset's rows inside their documents, a tile row each, minus the chosen columns inside them.
    inside = bs * tl.load(ATL + g * nb + s, mask=s_ok, other=0) - tl.load(SHORT + g * nb + s, mask=s_ok, other=0)
    cost = bs * tl.load(OFF_ROWS + g * nb + s, mask=s_ok, other=0).to(tl.int64) - inside.to(tl.int64)
    ok = (co == 0) & (s >= forced_off) & (cost > 0) & (n_offs < max_offsets) & s_ok
    ratio = resid * tl.load(OFF_SCALE + g * nb + s, mask=s_ok, other=0.0) / tl.maximum(cost, 1).to(tl.float64)
    ratio = tl.where(ok, ratio, _NEG)
    ratio = tl.where((ratio > 0) & (ratio >= min_ratio), ratio, _NEG)
    tl.store(R + g * big_l + s, ratio, mask=s_ok)
    tl.store(F + g * big_l + s, resid / m, mask=s_ok)


@triton.jit
def _rank_kernel(
    R,
    SEL,
    DONE,
    big_l,
    picks,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IDX_BITS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    if tl.load(DONE + g) != 0:
        return
    R += g * big_l
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    key = _key(tl.load(R + i, mask=i < big_l, other=_NEG), i, IDX_BITS)
    # Counting stops once every key of the program ranks past the round's picks (ineligible ones start there):
    # only the best few ratios of a head compare against all the others.
    rank = tl.where(key >= 0, 0, picks)
    l0 = 0
    while (l0 < big_l) & (tl.min(rank, 0) < picks):
        other = l0 + tl.arange(0, BLOCK_K)
        other_key = _key(tl.load(R + other, mask=other < big_l, other=_NEG), other, IDX_BITS)
        rank += tl.sum((other_key[None, :] > key[:, None]).to(tl.int32), 1)
        l0 += BLOCK_K
    tl.store(SEL + g * BLOCK_P + rank, key, mask=(key >= 0) & (rank < picks))


@triton.jit
def _pick_kernel(
    F,
    SEL,
    COVP,
    CO,
    CC,
    CF,
    CCUM,
    COUNTS,
    ORDER,
    SHORT_BY,
    FIRST,
    CSPAN,
    SSPAN,
    LO,
    HI,
    ATL,
    SHORT,
    DONE,
    m,
    nb,
    kc,
    short_last,
    sinks,
    forced_off,
    max_columns,
    max_offsets,
    recall,
    n_progs,
    BLOCK_P: tl.constexpr,
    BLOCK_COV: tl.constexpr,
    BLOCK: tl.constexpr,
    IDX_BITS: tl.constexpr,
    DOCS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    if tl.load(DONE + g) != 0:
        return
    p = tl.arange(0, BLOCK_P)
    key = tl.load(SEL + g * BLOCK_P + p)  # the round's picks in rank order, then -1
    tl.debug_barrier()  # every thread has read its entries before any is reset
    tl.store(SEL + g * BLOCK_P + p, tl.full([BLOCK_P], -1, tl.int64))
    v = tl.arange(0, BLOCK_COV)
    covered = tl.sum(tl.load(COVP + g * n_progs + v, mask=v < n_progs, other=0.0), 0) / m
    n_offs = tl.load(COUNTS + g * 2)
    n_cols = tl.load(COUNTS + g * 2 + 1)

    idx = (1 << IDX_BITS) - 1 - (key & ((1 << IDX_BITS) - 1))
    keep = key >= 0
    is_col = idx >= nb
    # Offsets only ahead of the round's first column (its ratio was computed without the column's mass).
    keep &= is_col | (tl.cumsum((keep & is_col).to(tl.int32), 0) == 0)
    gains = tl.where(keep, tl.load(F + g * (nb + kc) + idx, mask=keep, other=0.0), 0.0)
    keep &= covered + tl.cumsum(gains, 0) - gains < recall
    col_rank = n_cols + tl.cumsum((keep & is_col).to(tl.int32), 0)
    off_rank = n_offs + tl.cumsum((keep & ~is_col).to(tl.int32), 0)
    keep &= tl.where(is_col, col_rank <= max_columns, off_rank <= max_offsets)
    # A round that picks nothing leaves the state, and so every later round's scores and picks, unchanged:
    # the head is done and later rounds skip it (on real attention most heads reach the recall target early).
    tl.store(DONE + g, (tl.sum(keep.to(tl.int32), 0) == 0).to(tl.int32))
    one = tl.full([BLOCK_P], 1, tl.int8)
    tl.store(CO + g * nb + idx, one, mask=keep & ~is_col)
    tl.store(CC + g * kc + idx - nb, one, mask=keep & is_col)
    tl.debug_barrier()  # the flags are stored before the summary reads them
    _summary(g, CO, CC, CF, CCUM, COUNTS, ORDER, SHORT_BY, FIRST, CSPAN, SSPAN, LO, HI, ATL, SHORT, nb, kc, short_last,
             sinks, forced_off, BLOCK, DOCS)  # fmt: skip


@triton.jit
def _emit_kernel(CAND, CO, CC, CF, CCUM, VERT, SLASH, nb, kc, BLOCK: tl.constexpr):
    """The chosen columns and offsets as canonical index rows (ascending, -1 after them), from the prefix counts
    ``_summary`` keeps: chosen column ``c`` lands in slot ``CCUM[c]``, chosen offset ``s`` in slot ``s - CF[s]``
    (offset 0 is never free, so the offsets before ``s`` that are not free are the chosen ones)."""
    g = tl.program_id(0).to(tl.int64)
    CAND += g * kc
    CC += g * kc
    CCUM += g * (kc + 1)
    VERT += g * kc
    n_cols = tl.load(CCUM + kc)
    for c0 in range(0, kc, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < kc
        chosen = ok & (tl.load(CC + c, mask=ok, other=0) != 0)
        tl.store(VERT + tl.load(CCUM + c, mask=chosen, other=0), tl.load(CAND + c, mask=chosen, other=0), mask=chosen)
        tl.store(VERT + c, tl.full([BLOCK], -1, tl.int64), mask=ok & (c >= n_cols))
    CO += g * nb
    CF += g * (nb + 1)
    SLASH += g * nb
    n_offs = nb - tl.load(CF + nb)
    for s0 in range(0, nb, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ok = s < nb
        chosen = ok & (tl.load(CO + s, mask=ok, other=0) != 0)
        tl.store(SLASH + s - tl.load(CF + s, mask=chosen, other=0), s.to(tl.int64), mask=chosen)
        tl.store(SLASH + s, tl.full([BLOCK], -1, tl.int64), mask=ok & (s >= n_offs))


def greedy_rounds(
    p: GreedyProblem, rows: torch.Tensor, seqlen: int, settings: SpreadSettings, schedule: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the greedy's rounds on the problem ``estimator.spread.greedy`` set up (``p`` is not modified).

    ``p.attn`` and ``p.mass`` hold fp32-exact values and are read as fp32; ``rows``: LongTensor ``[m]``;
    ``settings``: block size, caps, recall target, ratio floor, exclusion.

    Returns:
        The chosen candidate columns (key positions) and block offsets as canonical index rows, ascending with
        -1 after them: LongTensors ``[G, Kc]`` and ``[G, nb]`` (what ``VerticalSlashIndex.build`` makes of the
        PyTorch rounds' flags, in one launch instead of a dozen small ops). Then the last round's scores, what its
        picks were made from: ratios and forecasts, float64 ``[G, nb + Kc]`` (offsets, then candidate columns;
        ratio ``-inf`` = not eligible), as ``estimator.spread.greedy._scores``.
    """
    attn, mass = p.attn, p.mass
    sinks, forced_off = p.sinks, p.forced_off
    g_count, m, kc = attn.shape
    nb = mass.shape[-1]
    dev, f64, i32 = attn.device, torch.float64, torch.int32
    big_l = nb + kc
    block_m = triton.next_power_of_2(m)
    block_c = max(16, _TILE // block_m)
    block_p = triton.next_power_of_2(min(max(schedule), big_l))  # a round cannot pick more than all
    n_chunks = triton.cdiv(kc, block_c)
    off_progs = triton.cdiv(nb, block_c)
    n_progs = n_chunks + off_progs
    idx_bits = max(1, (big_l - 1).bit_length())
    bs = settings.block_size

    a, mass = attn.float().contiguous(), mass.float().contiguous()
    cand, rows32 = p.cand.to(i32).contiguous(), rows.to(i32).contiguous()
    lo, hi = (b.to(i32).contiguous() for b in p.bounds)
    off_scale = p.off_scale.to(f64).contiguous()
    span, last_rows, off_rows, row_start = (
        x.to(i32).contiguous() for x in (p.span, p.last_rows, p.off_rows, p.row_start)
    )
    docs = p.documents
    if docs:  # the candidates in span order, for the summary's prefix sums by span (``_summary``)
        sorted_span, order = torch.sort(span, dim=-1, stable=True)
        positions = torch.arange(nb + 1, device=dev, dtype=i32).expand(g_count, -1).contiguous()
        first = torch.searchsorted(sorted_span, positions).to(i32)
        by_span = (order.to(i32), (bs - last_rows).gather(-1, order), first)
        scratch = tuple(torch.empty(g_count, kc + 1, dtype=i32, device=dev) for _ in range(2))
    else:  # placeholders: the closed forms read none of them
        by_span, scratch = (span, span, span), (span, span)
    atl, short = (torch.empty(g_count, nb, dtype=i32, device=dev) for _ in range(2))
    co, cc = p.chosen_off.to(torch.int8), p.chosen_col.to(torch.int8)
    cf = torch.empty(g_count, nb + 1, dtype=i32, device=dev)
    ccum = torch.empty(g_count, kc + 1, dtype=i32, device=dev)
    counts = torch.empty(g_count, 2, dtype=i32, device=dev)
    cum = torch.empty(g_count, m, kc, dtype=f64, device=dev)
    carry = torch.empty(g_count, m, n_chunks, dtype=f64, device=dev)
    ratio, forecast = (torch.empty(g_count, big_l, dtype=f64, device=dev) for _ in range(2))
    covp = torch.empty(g_count, n_progs, dtype=f64, device=dev)
    sel = torch.full((g_count, block_p), -1, dtype=torch.int64, device=dev)
    done = torch.zeros(g_count, dtype=i32, device=dev)

    summary = (*by_span, *scratch, lo, hi, atl, short)
    short_last = nb * bs - seqlen  # rows the row's last block lacks (one document a row)
    _init_kernel[(g_count,)](
        co, cc, cf, ccum, counts, *summary, nb, kc, short_last, sinks, forced_off, BLOCK=1024, DOCS=docs
    )
    for picks in schedule:
        _columns_kernel[(g_count, n_chunks)](
            a, cand, rows32, row_start, span, last_rows, co, cc, cf, counts, cum, carry, ratio, forecast, covp, done,
            m, nb, kc, seqlen, bs, settings.exclusion, settings.max_columns, settings.min_ratio,
            n_progs, BLOCK_M=block_m, BLOCK_C=block_c, DOCS=docs, num_warps=4,
        )  # fmt: skip
        _carry_kernel[(g_count, triton.cdiv(m, 16))](
            carry, done, m, n_chunks, BLOCK_M=16, BLOCK_N=_CARRIED, num_warps=4
        )
        _offsets_kernel[(g_count, off_progs)](
            mass, lo, hi, rows32, off_rows, off_scale, co, atl, short, counts, cum, carry, ratio, forecast, covp, done,
            m, nb, kc, bs, forced_off, settings.max_offsets, settings.min_ratio, n_progs, n_chunks,
            BLOCK_M=block_m, BLOCK_S=block_c, BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
        _rank_kernel[(g_count, triton.cdiv(big_l, _RANKED))](
            ratio,
            sel,
            done,
            big_l,
            picks,
            BLOCK_P=block_p,
            BLOCK_R=_RANKED,
            BLOCK_K=_AGAINST,
            IDX_BITS=idx_bits,
            num_warps=4,
        )
        _pick_kernel[(g_count,)](
            forecast,
            sel,
            covp,
            co,
            cc,
            cf,
            ccum,
            counts,
            *summary,
            done,
            m,
            nb,
            kc,
            short_last,
            sinks,
            forced_off,
            settings.max_columns,
            settings.max_offsets,
            settings.recall,
            n_progs,
            BLOCK_P=block_p,
            BLOCK_COV=triton.next_power_of_2(n_progs),
            BLOCK=1024,
            IDX_BITS=idx_bits,
            DOCS=docs,
            num_warps=4,
        )
    vertical = torch.empty(g_count, kc, dtype=torch.long, device=dev)
    slash = torch.empty(g_count, nb, dtype=torch.long, device=dev)
    _emit_kernel[(g_count,)](p.cand.contiguous(), co, cc, cf, ccum, vertical, slash, nb, kc, BLOCK=1024)
    return vertical, slash, ratio, forecast
