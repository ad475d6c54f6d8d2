"""The backward pass: ``vertical_slash_backward``, which launches the preprocess kernel here (``backward_delta``,
which a ring runs once for all its steps), the dq pass (``backward_dq``), then the column and dk/dv passes
(``backward_dkdv``).

``delta = rowsum(dO * O)`` first; then the dq pass over the forward's tile lists; the column pass, whose per-split
column gradients go to the planes of an fp32 buffer, summed in a fixed order (``torch.sum``); and the dk/dv pass,
which adds the sums into the key tiles. Every output element is owned by one program and reduced in a fixed order: the
backward is deterministic (bitwise-repeatable) by construction, with no float atomics. It is also the faster design:
forming dq in the dk/dv and column passes instead, added with fp32 atomics (5 matrix products per tile instead of 7,
no dq pass), measured slower on an H200 at 128K / 95 % (49.5 vs 37.9 ms fwd+bwd: the atomics cost more than the two
products they save; docs/measurements.md), and one TMA bulk reduction per dq tile did not help either (backward 38.7
vs 29.5 ms, measured the same day), so that variant was removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..log_constants import LOG2E
from ..merge import check_gradient_buffers
from .backward_dkdv import _bwd_col_kernel, _bwd_dkdv_kernel
from .backward_dq import _bwd_dq_kernel
from .common import check_inputs
from .document_tiles import document_rows, last_query_tiles
from .kernel_index import BlockMap, KernelIndex, key_counts, place
from .launch_config import BLOCK_C_MERGE, column_splits, launch_config

if TYPE_CHECKING:  # annotations only: importing the index here would close index -> backends -> triton -> here
    from ..index import VerticalSlashIndex


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


def dense_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` if its elements fill its memory without gaps or overlaps in some order (contiguous, or a permutation of
    contiguous such as ``[B, H, N, D]`` seen as ``[B, N, H, D]``), else a contiguous copy. ``torch.empty_like`` keeps
    such a tensor's strides, so a gradient allocated like its input can be written with the input's strides; a
    slice of a larger buffer (a fused qkv projection) would give it other strides.

    Read from the strides: sorted, they must be those of a contiguous tensor of the sizes in that order (a dim of size
    1, whose stride is never used, aside). Comparing with ``torch.empty_like(x).stride()`` allocated three tensors a
    backward call, a third of the host time of a ring step's call."""
    if x.is_contiguous():  # a ring step's q, k, v: one check in C, not a sort in Python
        return x
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != expected:
            return x.contiguous()
        expected *= size
    return x


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
    q_blocks: BlockMap = None,
    kv_blocks: BlockMap = None,
    doc_start: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dkv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients dq ``[B, N, Hq, D]``, dk, dv ``[B, N, Hkv, D]`` (input dtypes) of the sparse attention (k/v of another
    length than q where ``kv_blocks`` places them).

    ``do`` ``[B, N, Hq, D]``; ``out`` and ``lse`` are the forward's (lse ``[B, Hq, N]`` fp32); on shards, the rows'
    *final* values (merged over every k/v shard), so the call gives this pair's share: dq of q's rows over this k/v
    shard, dk/dv of this k/v shard from q's rows. ``index``, ``softmax_scale``, ``q_blocks`` / ``kv_blocks`` and
    ``doc_start`` (q's rows' document starts, global positions) as in the forward (the same scale: it is checked the
    same way). Bitwise-repeatable (module docstring). Each gradient has its input's strides where the input is dense
    (e.g. ``[B, H, N, D]`` seen as ``[B, N, H, D]``), else it is contiguous.

    A ring's steps (``merge.check_gradient_buffers`` has the shapes): ``delta``, ``rowsum(dO * out)`` fp32
    ``[B, Hq, N]`` (:func:`backward_delta`), the same for every step, so computed once (None: here); ``dq``, a
    running fp32 dq like q that this call adds into and returns (None: a new one in q's dtype); ``dkv``, fp32
    ``[2, B, N_kv, Hkv, D]`` that this call writes dk and dv into and returns as ``dkv[0], dkv[1]`` (None: new ones in
    k's dtype). Each saves a step a kernel and a pass over its tensor (the add, the stack and the cast the ring ran).
    """
    scale = check_inputs(q, k, v, index.block_size, softmax_scale, "vertical_slash_backward")
    starts = None if doc_start is None else document_rows(doc_start, q, "vertical_slash_backward")
    q, k, v = dense_layout(q), dense_layout(k), dense_layout(v)  # dq / dk / dv are written with their input's strides
    check_gradient_buffers(q, k, delta, dq, dkv, "vertical_slash_backward")
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    n_kv = k.shape[1]
    kidx, q_map, kv_map = place(index, n, q_blocks, kv_blocks, n_kv)
    mapped = q_map is not None
    nb, bs = kidx.num_blocks, kidx.block_size
    tiles = -(-n // bs)
    cfg = launch_config(q.dtype, bs, d)
    if do.stride(-1) != 1 or do.shape != q.shape:
        do = do.contiguous()
    lse = lse.contiguous()
    if delta is None:
        delta = backward_delta(do, out)
    strides_qkvdo = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    kv = kidx.columns.shape[-1]
    # The query side's map into the global blocks, the k/v side's inverse and the columns' local rows in the k/v, as
    # the dq pass reads them (the column pass: the first and the last; placeholders when not MAPPED: never read).
    q_blocks, kv_tiles, column_rows = (
        (q_map.blocks, kv_map.tiles, kidx.column_rows) if mapped else (kidx.slash, kidx.slash, kidx.slash)
    )
    # Documents: the rows' starts for every pass, and (column and dk/dv passes) the last query tile of each key block.
    docs = starts is not None
    doc_rows = starts if docs else kidx.slash  # placeholders without documents: never read
    doc_tiles = last_query_tiles(starts, bs, nb, q_map) if docs else kidx.slash
    accumulate = dq is not None
    if not accumulate:
        dq = torch.empty_like(q)
    block_m, block_n, warps, stages = cfg["dq"]
    _bwd_dq_kernel[(bsz * hq * tiles * (bs // block_m),)](  # common.tile_program
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
        q_blocks,
        kv_tiles,
        column_rows,
        doc_rows,
        scale * LOG2E,
        scale,
        n,
        n_kv,
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
        DOCS=docs,
        ACCUMULATE=accumulate,
        num_warps=warps,
        num_stages=stages,
    )
    block_c, block_m, warps, stages = cfg["col"]
    plane = bsz * hq * kv * d
    splits = column_splits(tiles, bsz * hq * triton.cdiv(kv, block_c), 2 * plane * 4)
    dkvc = torch.empty(2, splits, bsz, hq, kv, d, device=q.device, dtype=torch.float32)
    _bwd_col_kernel[(bsz * hq, triton.cdiv(kv, block_c), splits)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dkvc[0],
        dkvc[1],
        kidx.columns,
        kidx.offsets,
        q_blocks,
        column_rows,
        doc_rows,
        doc_tiles,
        scale * LOG2E,
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
        SPLIT=splits,
        MAPPED=mapped,
        DOCS=docs,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1:  # the planes summed in a fixed order (deterministic): the dk/dv pass then reads one
        dkvc = dkvc.sum(1, keepdim=True)
    dk, dv = (torch.empty_like(k), torch.empty_like(v)) if dkv is None else (dkv[0], dkv[1])  # unbind: 10 µs more
    # The offsets each k/v shard's key tiles walk: a grouped call's own per shard, counted per local key tile; else
    # the one list and its counts per global block, for every shard (strides 0).
    key_lists = mapped and kidx.key_slash is not None
    key_slash, key_scount = kidx.slash, kidx.scount
    key_strides = (0, 0)
    if key_lists:
        if kidx.key_slash.shape[0] * n != n_kv:
            raise ValueError(
                f"the index holds offsets for {kidx.key_slash.shape[0]} k/v shards of {n} tokens but k/v has {n_kv}"
            )
        key_slash = kidx.key_slash
        key_scount = key_counts(key_slash, kv_map.blocks, doc_tiles if docs else None, nb)
        key_strides = (key_slash[0].numel(), key_scount[0].numel())
    block_n, block_m, warps, stages = cfg["dkdv"]
    key_tiles = -(-n_kv // bs)
    _bwd_dkdv_kernel[(bsz * hkv * key_tiles * (bs // block_n),)](  # common.tile_program
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dkvc[0],
        dkvc[1],
        key_slash,
        key_scount,
        kidx.columns,
        kidx.ccount,
        kv_map.blocks if mapped else kidx.slash,  # placeholders when not MAPPED: never read
        q_map.tiles if mapped else kidx.slash,
        doc_rows,
        doc_tiles,
        scale * LOG2E,
        scale,
        n,
        n_kv,
        nb,
        key_slash.shape[-1],
        kv,
        *key_strides,
        *strides_qkvdo,
        *dk.stride()[:3],
        *dv.stride()[:3],
        HQ=hq,
        HKV=hkv,
        GROUP=hq // hkv,
        BS=bs,
        D=d,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        BLOCK_C=BLOCK_C_MERGE,
        MAPPED=mapped,
        KEY_LISTS=key_lists,
        DOCS=docs,
        num_warps=warps,
        num_stages=stages,
    )
    return dq, dk, dv


def backward_delta(do: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * out)`` fp32 ``[B, Hq, N]`` of ``do`` and ``out`` ``[B, N, Hq, D]`` (any strides with a unit last
    one, fp16 / bf16 / fp32): what every pass of the backward reads, the same for all steps of a ring."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    bsz, n, hq, d = out.shape
    delta = torch.empty(bsz, hq, n, device=out.device, dtype=torch.float32)
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
    return delta
