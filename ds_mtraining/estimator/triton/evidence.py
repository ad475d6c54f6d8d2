"""Triton kernels for the ``"spread"`` estimator's evidence, without materialising the observation attention.

The PyTorch path (``estimator.observe`` + ``estimator.spread.evidence.spread_evidence``) builds the rows' attention
``A [B, Hq, m, n]`` in fp32 and reduces it with a chain of elementwise kernels: at 128K tokens and 128 rows
that is 1 GB per pass and most of the estimator's time. Here two sweeps over the keys do the same work in
registers, tile by tile. Both kernels tile the observation rows of all query heads that share a kv head together
(``t = row * GPAD + head``): the heads read the same keys and, row by row, share the causal mask, so one dot of
the kv head's key tile serves the whole group (16 heads, 2 kv heads, D 128, 128K keys on an H200: evidence 0.90 ->
0.57 ms, statistics 0.58 -> 0.41 ms against a program per query head; ``benchmarks/results/``).

1. ``row_statistics``: one program per (b·hkv, chunk of rows x heads, key chunk) keeps an online max and sum of
   exp of the causal logits, skipping key chunks past the row chunk's last row; the chunks' partials are combined in
   fp64 on the host side of the launch (torch ops, no sync). Returns the row max (natural-log units, fp32) and
   the row sum of ``exp(logit - max)`` (fp64), the exact pair ``estimator.observe.row_statistics`` returns, so
   shards can reduce them the same way.
2. ``spread_evidence``: one program per (b·hkv, key block) recomputes the logits of the rows of all the group's
   heads against its ``bs`` keys (``[keys, rows x heads]`` tiles, row chunks before the block skipped),
   normalises with the (reduced) statistics, and writes the block's mass per row, each key's sum over the rows
   at least ``exclusion`` behind it, and the sum of the two largest of those entries
   (``estimator.spread.evidence.SpreadEvidence``). A second launch of the same kernel sweeps the tail rows (the
   sequence's last positions) and writes each key's attention summed over the tail rows of each query block: all
   the tail repair needs, computed before the index exists (it used to be a sweep with the index's mask after the
   greedy). Each key block is owned by one program: no atomics, deterministic.
3. ``candidate_attention``: the rows' attention at given keys (the greedy's candidates, an index's columns),
   one program per (b·hq, chunk of keys).

With packed documents (``DOCS``, a constexpr: whole sequences compile to the kernels without it) every row also
reads its document's start (``STARTS [B, m]``) and sees only the keys ``start <= j <= row``, like the causal bound
from below: the statistics, the evidence and the candidates' attention all stay inside the row's document.

Keys are given by their global positions (``keys [n]``, whole aligned blocks in any block order, padding
``>= seqlen``), so a ring rank passes its layout shard as is. Dots run on the inputs' dtype with fp32
accumulation (fp32 inputs in full precision: ``input_precision="ieee"``), like the fp32 einsum of the
PyTorch path up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds_mtraining.sparse.log_constants import LN2, LOG2E
from ds_mtraining.sparse.scale import resolve_softmax_scale

from ..spread.geometry import tail_blocks

__all__ = ["candidate_attention", "row_statistics", "spread_evidence"]

_STATS_TILE, _STATS_KEYS, _KEY_CHUNK, _STATS_STAGES = 256, 64, 1024, 3
"""Statistics pass: (row, head) entries per tile, keys per step, keys per program, pipeline depth of the key loop.
Swept on an H200 (128K keys, 128 + 32 rows, 16 heads, 2 kv heads, D 128; 36 settings, ms with the partials'
combine): 256 / 64 / 1024 / 3 0.279, 128 / 64 / 1024 / 3 0.292, 64 / 64 / 2048 / 3 0.305, the earlier
64 / 128 / 4096 / 2 0.313; 4 stages or 32-key steps gained at most 2 us over any setting."""
_EVIDENCE_LAUNCH = {128: (32, 4), 64: (32, 4)}
"""Evidence pass per block size: ((row, head) entries per tile, warps). H200, 128K keys, 128 + 32 rows, 16 heads,
2 kv heads (block 128), ms: 32 x 4 0.57, 64 x 4 0.59, 128 x 4 0.61, 256 x 8 0.78, 64 x 8 0.87; a program per query
head before: 0.90. Block 64 takes the same setting, not swept."""
_TAIL_LAUNCH = {128: (64, 4), 64: (32, 4)}
"""The same for launches of tail rows alone (a tail past _TAIL_BLOCKS query blocks), which see every key block.
Swept on an H200 (128K keys, 32 tail rows, 16 heads, block 128), ms: 16 x 4 0.200, 32 x 4 0.183, **64 x 4 0.166**,
128 x 4 0.168, 256 x 8 0.227, 64 x 8 0.263. Block 64 keeps the evidence setting, not swept."""
_TAIL_BLOCKS = 4  # query blocks of tail rows per launch of the tail pass
_CANDIDATES, _CANDIDATE_ROWS = 64, 64  # candidate keys per program, rows per step of the candidate pass


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; fp32 inputs in full precision (IEEE), not tf32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _group_tile(
    Q, ROWS, STARTS, b, hk, r0, m, m_all, stride_qb, stride_qm, stride_qh, HQ, GROUP, GPAD, BLOCK_T,
    DOCS: tl.constexpr,
):  # fmt: skip
    """The tile's entries ``t = row * GPAD + head``: ``BLOCK_T / GPAD`` observation rows of all ``GROUP`` query
    heads of kv head ``hk``, which share its keys and, row by row, the causal mask. Returns the row positions,
    their first visible key (the document start with ``DOCS``, else 0; ``STARTS`` is ``[B, m_all]``), the global
    head index ``b * HQ + h``, the local row index and the valid flag per entry, and the q row offsets (without
    the head dim)."""
    t = tl.arange(0, BLOCK_T)
    local = r0 + t // GPAD
    gi = t % GPAD
    ok = (local < m) & (gi < GROUP)
    rows = tl.load(ROWS + local, mask=ok, other=-1)
    if DOCS:
        starts = tl.load(STARTS + b.to(tl.int64) * m_all + local, mask=ok, other=0)
    else:
        starts = tl.zeros_like(rows)
    h = hk * GROUP + gi
    q_off = b.to(tl.int64) * stride_qb + local.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    return rows, starts, b * HQ + h, local, ok, q_off


@triton.jit
def _stats_kernel(
    Q,
    K,
    ROWS,
    STARTS,
    KEYS,
    MAXO,
    SUMO,
    qk_scale,
    m,
    n,
    n_chunks,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    GPAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    DOCS: tl.constexpr,
):
    bk = tl.program_id(0)
    b, hk = bk // (HQ // GROUP), bk % (HQ // GROUP)
    c = tl.program_id(2)
    rows, starts, bh, local, ok, q_off = _group_tile(
        Q, ROWS, STARTS, b, hk, tl.program_id(1) * (BLOCK_T // GPAD), m, m, stride_qb, stride_qm, stride_qh, HQ,
        GROUP, GPAD, BLOCK_T, DOCS,
    )  # fmt: skip
    offs_d = tl.arange(0, D)
    q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    # A chunk whose keys all lie past the tile's last row is skipped whole (causal). Inside a live chunk every
    # tile is computed under the mask: a tile wholly past the rows adds exactly nothing, and without a branch in
    # the loop its loads pipeline (0.355 -> 0.313 ms at 128K on an H200; a shard's keys ascend, so that waste is
    # at most the one chunk that straddles the last row).
    lo = c * CHUNK
    chunk = lo + tl.arange(0, CHUNK)
    first = tl.min(tl.load(KEYS + chunk, mask=chunk < n, other=2**62))
    hi = tl.where(first <= tl.max(rows), tl.minimum(lo + CHUNK, n), lo)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_k = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_k < n
        pos = tl.load(KEYS + offs_k, mask=key_ok, other=0)
        kt = tl.load(k_base + offs_k[None, :] * stride_kn + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        # Unscaled logits: the scale is folded into exp2's argument (one FMA each), the max taken before scaling.
        seen = key_ok[None, :] & (pos[None, :] <= rows[:, None])
        if DOCS:
            seen = seen & (pos[None, :] >= starts[:, None])
        qk = tl.where(seen, _dot(q, kt, IEEE), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no nan
        l_i = l_i * tl.math.exp2(m_i - shift) + tl.sum(tl.math.exp2(qk * qk_scale - shift[:, None]), 1)
        m_i = m_new
    out = (bh * n_chunks + c) * m + local
    tl.store(MAXO + out, m_i, mask=ok)
    tl.store(SUMO + out, l_i, mask=ok)


@triton.jit
def _evidence_kernel(
    Q,
    K,
    ROWS,
    STARTS,
    KEYS,
    RMAX,
    RINV,
    BMASS,
    CSUM,
    CTOP,
    TSUM,
    qk_scale,
    m,
    m_all,
    seqlen,
    nb,
    exclusion,
    tail_lo,
    tail_hi,
    tail_block,
    tail_groups,
    batch_heads,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    GPAD: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPREAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    M_PAD: tl.constexpr,
    DOCS: tl.constexpr,
):
    """One key block's evidence: SPREAD, from the spread rows 0 .. m - 1 (block mass, column sums and spikes);
    TAIL_PAD > 0, from the tail rows tail_lo .. tail_hi - 1, those of the query blocks tail_block + g for
    g < tail_groups (sums per key and block, padded to TAIL_PAD blocks); both in one launch when the tail is short.
    Statistics are per row of all m_all."""
    # Every (batch x kv head, key block) program on grid axis 0, batch x kv head fastest (the order of a two-axis grid,
    # whose axis 1 holds at most 65535 key blocks: 4M keys in blocks of 64 are 65536).
    kv_heads = batch_heads // GROUP  # batch x kv heads
    bk = tl.program_id(0) % kv_heads
    kb = tl.program_id(0) // kv_heads
    b, hk = bk // (HQ // GROUP), bk % (HQ // GROUP)
    RB: tl.constexpr = BLOCK_T // GPAD
    offs_k = kb * BS + tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    pos = tl.load(KEYS + offs_k)
    real = pos < seqlen
    # The keys are one aligned global block; a block of padding keys writes the spare slot nb (cut off).
    block = tl.minimum(tl.load(KEYS + kb * BS) // BS, nb)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    k_tile = tl.load(k_base + offs_k[:, None] * stride_kn + offs_d[None, :])
    # Per (key, head of the group): [BS, GPAD].
    heads = hk * GROUP + tl.arange(0, GPAD)
    key_out = (b * HQ + heads)[None, :].to(tl.int64) * seqlen + pos[:, None]
    key_ok = real[:, None] & (tl.arange(0, GPAD) < GROUP)[None, :]
    # Tiles are [keys, rows x heads]: one dot serves every head of the group, and the per-key reductions over
    # the rows (three of them) run over the middle axis of a [keys, rows, heads] view.
    if SPREAD:
        col_sum = tl.zeros([BS, GPAD], dtype=tl.float32)
        top1 = tl.zeros([BS, GPAD], dtype=tl.float32)
        top2 = tl.zeros([BS, GPAD], dtype=tl.float32)
        # Rows before the block see none of its keys (causal): on rows spread over the sequence that skips
        # about half the chunks. The rows ascend, so those chunks are a prefix, skipped by starting after it
        # (no branch in the loop). Their block mass stays 0 from the caller's zeros.
        for r0 in range(_live_from(ROWS, 0, m, block * BS, RB, M_PAD), m, RB):
            rows, starts, bh, local, ok, q_off = _group_tile(
                Q, ROWS, STARTS, b, hk, r0, m, m_all, stride_qb, stride_qm, stride_qh, HQ, GROUP, GPAD, BLOCK_T, DOCS
            )
            p, causal = _attention_tile(
                Q, k_tile, RMAX, RINV, q_off, rows, starts, bh, local, ok, pos, m_all, qk_scale, offs_d, IEEE, DOCS
            )
            tl.store(BMASS + (bh * m + local) * (nb + 1) + block, tl.sum(p, 0), mask=ok)
            far = tl.where(causal & real[:, None] & (rows[None, :] - pos[:, None] >= exclusion), p, 0.0)
            far = tl.reshape(far, (BS, RB, GPAD))
            col_sum += tl.sum(far, 1)
            # The two largest distinct entries so far (an exact tie for the largest counts once, as in
            # ``estimator.spread.spikes.spikes``): merge this chunk's pair into the running pair.
            c1 = tl.max(far, 1)
            c2 = tl.max(tl.where(far < c1[:, None, :], far, 0.0), 1)
            new1 = tl.maximum(top1, c1)
            top2 = tl.maximum(
                tl.maximum(tl.where(top1 < new1, top1, 0.0), tl.where(c1 < new1, c1, 0.0)), tl.maximum(top2, c2)
            )
            top1 = new1
        tl.store(CSUM + key_out, col_sum, mask=key_ok)
        tl.store(CTOP + key_out, top1 + top2, mask=key_ok)
    if TAIL_PAD > 0:
        # Tail rows: each key's attention summed over the rows of each query block g (tail_block + g): all a tail
        # repair needs, since rows of one block share the index's mask at a key. [BS, TAIL_PAD, GPAD].
        groups = tl.arange(0, TAIL_PAD)
        tail_sum = tl.zeros([BS, TAIL_PAD, GPAD], dtype=tl.float32)
        for r0 in range(_live_from(ROWS, tail_lo, tail_hi, block * BS, RB, M_PAD), tail_hi, RB):
            rows, starts, bh, local, ok, q_off = _group_tile(
                Q, ROWS, STARTS, b, hk, r0, tail_hi, m_all, stride_qb, stride_qm, stride_qh, HQ, GROUP, GPAD, BLOCK_T,
                DOCS,
            )  # fmt: skip
            p, causal = _attention_tile(
                Q, k_tile, RMAX, RINV, q_off, rows, starts, bh, local, ok, pos, m_all, qk_scale, offs_d, IEEE, DOCS
            )
            p3 = tl.reshape(tl.where(real[:, None], p, 0.0), (BS, RB, GPAD))
            if TAIL_PAD == 1:  # the tail in one query block (the usual case): no split
                tail_sum += tl.sum(p3, 1)[:, None, :]
            else:
                group = tl.reshape(rows // BS - tail_block, (RB, GPAD))  # -1 rows (invalid) match no group
                member = (group[:, None, :] == groups[None, :, None]).to(tl.float32)  # [RB, TAIL_PAD, GPAD]
                tail_sum += tl.sum(p3[:, :, None, :] * member[None, :, :, :], 1)
        at = TSUM + groups[None, :, None].to(tl.int64) * batch_heads * seqlen + key_out[:, None, :]
        tl.store(at, tail_sum, mask=key_ok[:, None, :] & (groups < tail_groups)[None, :, None])


@triton.jit
def _live_from(ROWS, lo, hi, start, RB: tl.constexpr, M_PAD: tl.constexpr):
    """The first chunk (``lo + j * RB``) of the ascending rows ``lo .. hi - 1`` that holds a row at or after
    ``start``: the chunks before it see none of a key block that starts there."""
    r = lo + tl.arange(0, M_PAD)
    before = tl.sum((tl.load(ROWS + r, mask=r < hi, other=2**62) < start).to(tl.int32), 0)
    return lo + before // RB * RB


@triton.jit
def _attention_tile(
    Q, k_tile, RMAX, RINV, q_off, rows, starts, bh, local, ok, pos, m_all, qk_scale, offs_d, IEEE, DOCS: tl.constexpr
):  # fmt: skip
    """Normalised causal probabilities ``[BS, BLOCK_T]`` of the key tile ``k_tile [BS, D]`` (positions ``pos``)
    for a ``_group_tile`` of rows (statistics ``[B·Hq, m_all]`` in log2 units / inverse sums), inside the rows'
    documents with ``DOCS``; and that mask."""
    qt = tl.load(Q + q_off[None, :] + offs_d[:, None], mask=ok[None, :], other=0.0)
    qk = _dot(k_tile, qt, IEEE)
    r_max = tl.load(RMAX + bh * m_all + local, mask=ok, other=0.0)
    r_inv = tl.load(RINV + bh * m_all + local, mask=ok, other=0.0)
    causal = (pos[:, None] <= rows[None, :]) & ok[None, :]
    if DOCS:
        causal = causal & (pos[:, None] >= starts[None, :])
    return tl.where(causal, tl.math.exp2(qk * qk_scale - r_max[None, :]) * r_inv[None, :], 0.0), causal


@triton.jit
def _candidate_kernel(
    Q,
    K,
    ROWS,
    STARTS,
    CAND,
    WHERE,
    RMAX,
    RINV,
    OUT,
    qk_scale,
    m,
    kc,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IEEE: tl.constexpr,
    DOCS: tl.constexpr,
):
    bh = tl.program_id(0)
    b, h = bh // HQ, bh % HQ
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, D)
    c_ok = offs_c < kc
    cand = tl.load(CAND + bh.to(tl.int64) * kc + offs_c, mask=c_ok, other=0)
    where = tl.load(WHERE + bh.to(tl.int64) * kc + offs_c, mask=c_ok, other=-1)
    held = where >= 0
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    kt = tl.load(k_base + where[None, :].to(tl.int64) * stride_kn + offs_d[:, None], mask=held[None, :], other=0.0)
    for m0 in range(0, m, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < m
        q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        qk = _dot(q, kt, IEEE)
        rows = tl.load(ROWS + offs_m, mask=m_ok, other=-1)
        r_max = tl.load(RMAX + bh * m + offs_m, mask=m_ok, other=0.0)
        r_inv = tl.load(RINV + bh * m + offs_m, mask=m_ok, other=0.0)
        p = tl.math.exp2(qk * qk_scale - r_max[:, None]) * r_inv[:, None]
        seen = held[None, :] & (cand[None, :] <= rows[:, None])
        if DOCS:
            starts = tl.load(STARTS + b.to(tl.int64) * m + offs_m, mask=m_ok, other=0)
            seen = seen & (cand[None, :] >= starts[:, None])
        p = tl.where(seen, p, 0.0)
        out = OUT + (bh.to(tl.int64) * m + offs_m[:, None]) * kc + offs_c[None, :]
        tl.store(out, p, mask=m_ok[:, None] & c_ok[None, :])


def _check(q_obs: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor | None) -> None:
    if q_obs.dim() != 4 or k.dim() != 4 or q_obs.shape[0] != k.shape[0] or q_obs.shape[3] != k.shape[3]:
        raise ValueError(
            f"expected q_obs [B, m, Hq, D] and k [B, n, Hkv, D]; got {tuple(q_obs.shape)}, {tuple(k.shape)}"
        )
    if q_obs.shape[2] % k.shape[2]:
        raise ValueError(f"Hq ({q_obs.shape[2]}) must be a multiple of Hkv ({k.shape[2]})")
    if q_obs.shape[-1] not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128 for the Triton evidence kernels; got {q_obs.shape[-1]}")
    if q_obs.dtype != k.dtype or q_obs.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q_obs and k must share fp16, bf16 or fp32; got {q_obs.dtype}, {k.dtype}")
    if q_obs.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q_obs and k need unit stride in the head dim; call .contiguous()")
    if rows.shape != (q_obs.shape[1],):
        raise ValueError(f"rows [m] must match q_obs {tuple(q_obs.shape)}; got {tuple(rows.shape)}")
    if keys is not None and keys.shape != (k.shape[1],):
        raise ValueError(f"keys [n] must match k {tuple(k.shape)}; got {tuple(keys.shape)}")


def _log2_statistics(row_max: torch.Tensor, row_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' statistics as the kernels read them: the max in log2 units and the sum's inverse, fp32."""
    return (row_max.float() * LOG2E).contiguous(), (1.0 / row_sum).float().contiguous()


def _strides(q_obs: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    return (q_obs.stride(0), q_obs.stride(1), q_obs.stride(2), k.stride(0), k.stride(1), k.stride(2))


def _row_starts(row_starts: torch.Tensor | None, q_obs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows' document starts as the kernels read them (contiguous ``[B, m]``); without documents ``rows``
    stands in for the pointer, which ``DOCS=False`` never reads."""
    if row_starts is None:
        return rows
    if row_starts.shape != (q_obs.shape[0], q_obs.shape[1]):
        raise ValueError(f"row_starts must be [B, m] like q_obs {tuple(q_obs.shape)}; got {tuple(row_starts.shape)}")
    return row_starts.long().contiguous()


def row_statistics(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    softmax_scale: float,
    row_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and sum of exp of the observation rows' causal logits over these keys.

    Args:
        q_obs: ``[B, m, Hq, D]`` queries of the rows; k: ``[B, n, Hkv, D]`` (same dtype; fp16, bf16 or fp32).
        rows: LongTensor ``[m]``, global row positions; keys: LongTensor ``[n]``, global key positions.
        row_starts: LongTensor ``[B, m]``, the rows' document starts (keys before them are not seen), or ``None``.

    Returns:
        ``row_max`` float32 ``[B, Hq, m]`` (natural-log units, ``-inf`` for a row that sees none of these keys)
        and ``row_sum`` float64 ``[B, Hq, m]`` = Σ exp(logit − row_max).
    """
    _check(q_obs, k, rows, keys)
    batch, m, hq, d = q_obs.shape
    softmax_scale = resolve_softmax_scale(softmax_scale, d, "row_statistics")  # positive: maxima are unscaled
    n = k.shape[1]
    chunks = max(1, triton.cdiv(n, _KEY_CHUNK))
    part_max = torch.empty(batch * hq, chunks, m, device=q_obs.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    group = hq // k.shape[2]
    gpad = triton.next_power_of_2(group)
    tile = max(_STATS_TILE, gpad)
    grid = (batch * k.shape[2], triton.cdiv(m, tile // gpad), chunks)
    _stats_kernel[grid](
        q_obs,
        k,
        rows,
        _row_starts(row_starts, q_obs, rows),
        keys,
        part_max,
        part_sum,
        softmax_scale * LOG2E,
        m,
        n,
        chunks,
        *_strides(q_obs, k),
        HQ=hq,
        GROUP=group,
        GPAD=gpad,
        D=d,
        BLOCK_T=tile,
        BLOCK_N=_STATS_KEYS,
        CHUNK=_KEY_CHUNK,
        IEEE=q_obs.dtype == torch.float32,
        STAGES=_STATS_STAGES,
        DOCS=row_starts is not None,
        num_warps=4,
    )
    row_max = part_max.amax(dim=1)  # log2 units
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = (part_sum.double() * torch.exp2((part_max - shift[:, None]).double())).sum(dim=1)
    return (row_max * LN2).view(batch, hq, m), row_sum.view(batch, hq, m)


def spread_evidence(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    softmax_scale: float,
    seqlen: int,
    block_size: int,
    exclusion: int,
    tail: int = 0,
    row_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This key shard's spread evidence from the rows' (reduced) statistics, as ``estimator.spread.evidence.spread_evidence``.

    Args:
        q_obs, k, rows, keys: as for :func:`row_statistics`; ``keys`` in whole aligned blocks of ``block_size``;
            ``rows`` ascending within the spread rows and within the tail rows (``estimator.spread.rows.spread_rows`` and
            ``tail_rows`` are), which lets a key block skip the rows before it without a branch.
        row_max, row_sum: the statistics over *all* keys of the sequence (reduced over shards), of every row.
        exclusion: entries nearer than this to their row are not column evidence.
        tail: the last ``tail`` rows are tail rows, the sequence's last ``tail`` positions (``estimator.spread.rows.tail_rows``):
            they get only ``tail_sum``; the others (``m``) get the rest.
        row_starts: LongTensor ``[B, m + tail]``, every row's document start, or ``None`` (:func:`row_statistics`).

    Returns:
        ``block_mass`` float32 ``[B, Hq, m, nb]``, ``column_sum`` and ``column_top`` float32 ``[B, Hq, seqlen]``,
        ``tail_sum`` float32 ``[G, B, Hq, seqlen]``: each key's attention summed over the tail rows of query block
        ``first + g`` (``first, G = tail_blocks(seqlen, tail, block_size)``). Zero where this shard holds nothing.
    """
    _check(q_obs, k, rows, keys)
    batch, m_all, hq, d = q_obs.shape
    m, n = m_all - tail, k.shape[1]
    if n % block_size or block_size not in (64, 128):
        raise ValueError(f"keys must be whole blocks of 64 or 128; got {n} keys, block_size={block_size}")
    if not 0 <= tail <= m_all:
        raise ValueError(f"tail must count some of the {m_all} rows; got {tail}")
    nb = triton.cdiv(seqlen, block_size)
    group = hq // k.shape[2]
    gpad = triton.next_power_of_2(group)
    first, groups = tail_blocks(seqlen, tail, block_size)
    dev = q_obs.device
    block_mass = torch.zeros(batch, hq, m, nb + 1, device=dev, dtype=torch.float32)
    column_sum = torch.zeros(batch, hq, seqlen, device=dev, dtype=torch.float32)
    column_top = torch.zeros_like(column_sum)
    tail_sum = torch.zeros(groups, batch, hq, seqlen, device=dev, dtype=torch.float32)
    r_max, r_inv = _log2_statistics(row_max, row_sum)
    starts = _row_starts(row_starts, q_obs, rows)

    def launch(spread: bool, tile: int, warps: int, lo: int, hi: int, g0: int, g1: int) -> None:
        _evidence_kernel[(batch * k.shape[2] * (n // block_size),)](
            q_obs, k, rows, starts, keys, r_max, r_inv, block_mass, column_sum, column_top, tail_sum[g0:],
            softmax_scale * LOG2E, m, m_all, seqlen, nb, exclusion, lo, hi, first + g0, g1 - g0, batch * hq,
            *_strides(q_obs, k),
            HQ=hq, GROUP=group, GPAD=gpad, D=d, BS=block_size, BLOCK_T=max(tile, gpad), SPREAD=spread,
            TAIL_PAD=triton.next_power_of_2(g1 - g0) if g1 > g0 else 0, IEEE=q_obs.dtype == torch.float32,
            M_PAD=triton.next_power_of_2(max(m, hi - lo, 1)), DOCS=row_starts is not None, num_warps=warps,
        )  # fmt: skip

    start = seqlen - tail  # position of the first tail row, local row m

    def tail_rows(g0: int, g1: int) -> tuple[int, int]:
        """Local rows [lo, hi) of the tail rows in query blocks first + g0 .. first + g1 - 1."""
        return m + max(0, (first + g0) * block_size - start), m + min(tail, (first + g1) * block_size - start)

    # The spread rows with the first _TAIL_BLOCKS query blocks of tail rows (all of them, usually) in one launch:
    # each key tile is loaded once (H200, 128K, 128 + 32 rows: 0.422 -> 0.410 ms against a launch each). A launch
    # covers at most _TAIL_BLOCKS query blocks of tail rows (its accumulator holds a slot per block and key): a
    # longer tail adds launches of tail rows alone, with larger tiles, which pay for rows that see every key block.
    joint = min(groups, _TAIL_BLOCKS)
    launch(True, *_EVIDENCE_LAUNCH[block_size], *(tail_rows(0, joint) if joint else (m, m)), 0, joint)
    for g0 in range(joint, groups, _TAIL_BLOCKS):
        g1 = min(groups, g0 + _TAIL_BLOCKS)
        launch(False, *_TAIL_LAUNCH[block_size], *tail_rows(g0, g1), g0, g1)
    return block_mass[..., :nb], column_sum, column_top, tail_sum


def candidate_attention(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    candidates: torch.Tensor,
    local: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    softmax_scale: float,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows' attention at chosen key positions, as ``estimator.spread.candidates.candidate_attention``: float32 ``[B, Hq, m, Kc]``.

    Args:
        q_obs: ``[B, m, Hq, D]`` queries of the rows; k: ``[B, n, Hkv, D]`` (same dtype); rows: LongTensor ``[m]``.
        candidates: LongTensor ``[B, Hq, Kc]``, global key positions; local: LongTensor ``[B, Hq, Kc]``, their rows
            in ``k`` (-1 where this shard does not hold them: the entry is 0).
        row_max, row_sum: the rows' statistics over all keys (``estimator.observe.row_statistics``, reduced).
        row_starts: LongTensor ``[B, m]``, the rows' document starts (a candidate before one reads 0), or ``None``.

    One program per (b·hq, chunk of candidates) gathers the chunk's keys once and walks the rows: one pass, where
    the PyTorch ops (gather, fp32 einsum, softmax, masks, widening) are ~30 kernels (0.28 ms at 128K, 16 heads).
    """
    _check(q_obs, k, rows, None)
    batch, m, hq, d = q_obs.shape
    kc = candidates.shape[-1]
    if candidates.shape != (batch, hq, kc) or local.shape != candidates.shape:
        raise ValueError(
            f"candidates and local must both be [B, Hq, Kc] = [{batch}, {hq}, Kc]; got {tuple(candidates.shape)} "
            f"and {tuple(local.shape)}"
        )
    out = torch.empty(batch, hq, m, kc, device=q_obs.device, dtype=torch.float32)
    r_max, r_inv = _log2_statistics(row_max, row_sum)
    _candidate_kernel[(batch * hq, triton.cdiv(kc, _CANDIDATES))](
        q_obs,
        k,
        rows,
        _row_starts(row_starts, q_obs, rows),
        candidates.contiguous(),
        local.contiguous(),
        r_max,
        r_inv,
        out,
        softmax_scale * LOG2E,
        m,
        kc,
        *_strides(q_obs, k),
        HQ=hq,
        GROUP=hq // k.shape[2],
        D=d,
        BLOCK_M=_CANDIDATE_ROWS,
        BLOCK_C=_CANDIDATES,
        IEEE=q_obs.dtype == torch.float32,
        DOCS=row_starts is not None,
        num_warps=4,
    )
    return out
