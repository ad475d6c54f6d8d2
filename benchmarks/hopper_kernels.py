"""A slash-only forward written for Hopper, with each Hopper feature a switch (issue 56, build point 1: "pick the
route by a probe"). ``benchmarks/hopper_probe.py`` times it against today's kernel and cuDNN.

Semantics: those of ``ds_mtraining.sparse.triton`` restricted to the slash part. Query ``q`` attends key ``k`` iff
``k <= q`` and ``q // bs - k // bs`` is a chosen offset of its head (offset 0, the diagonal, always chosen); no
vertical columns, no documents, no ring maps. Outputs as ``vertical_slash_forward``: out ``[B, N, Hq, D]`` in q's
dtype and lse ``[B, Hq, N]`` fp32, natural log.

What differs from today's ``_fwd_kernel`` (``sparse/triton/forward.py``), and why:

- **Step lists instead of offsets.** A program owns ``BLOCK_M`` query rows and walks precomputed lists of
  ``BLOCK_N``-key blocks (:func:`build_steps`, plain PyTorch, built once per index like ``prepare_index``): the
  *full* blocks (every row attends every key: no mask at all, the hot loop) and the *partial* blocks (the diagonal,
  and at ``BLOCK_M > bs`` the key blocks that only one of the program's query tiles attends) masked by a per-block
  bitmask of the program's ``bs``-row sub-tiles plus the causal test. This is what lets a 128-row program serve two
  64-row query tiles at block 64: it walks the union of their key tiles, and with the planted bands (runs of
  consecutive offsets) nearly every block of that union is full for both. The lists are also the shape a
  CuTe / CUDA C++ kernel would consume, so every route of the issue can be fed the same work.
- **Switches** (:class:`Variant`): ``tma`` loads K/V (and q) through host-built tensor descriptors (TMA on sm_90;
  the 2-D view ``[B * N, H * D]`` with block ``[BLOCK_N, D]`` at column ``h * D``, so the ``[B, N, H, D]`` layout
  needs no copy), else pointer loads as today; ``block_m`` 64 / 128 (128 rows with 8 warps: two warpgroups of 64
  rows, FA3's "two consumer warpgroups"); ``block_n``; ``stages`` (the software pipeline's depth on the full loop);
  ``ws`` (``tl.range(..., warp_specialize=True)`` on the full loop: producer warps issue the loads, consumers do the
  math, as FA3 / flash-attn-4 split them); ``warps``.
- **The accumulator is fed to the PV dot** (``tl.dot(p, v, acc)``, the Triton tutorial's form) instead of
  ``acc * alpha + tl.dot(p, v)``: on Hopper wgmma accumulates into its registers in place.

What flash-attn-4 / FlashAttention-3 do that this cannot express in Triton 3.6 (so the probe's best Triton row is
a lower bound of what a CuTe DSL or CUDA C++ kernel would reach): ping-pong scheduling of two consumer warpgroups
(one's softmax overlaps the other's GEMMs), intra-warpgroup overlap of the softmax of block j with the QK^T of block
j + 1, explicit register reallocation between producer and consumers (``setmaxnreg``), and the exp2 emulation on
the FMA units that flash-attn-4 uses to relieve the MUFU unit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ds_mtraining.sparse.log_constants import LOG2E
from ds_mtraining.sparse.index import VerticalSlashIndex, index_to_dense_mask
from ds_mtraining.sparse.reference import reference_attention


@dataclass(frozen=True)
class Variant:
    """One launch form of :func:`slash_forward`. ``spec`` round-trips through :meth:`parse`:
    ``tma|ptr,m<BLOCK_M>,n<BLOCK_N>,w<warps>,s<stages>[,ws]``, e.g. ``tma,m128,n64,w8,s3,ws``."""

    tma: bool
    block_m: int
    block_n: int
    warps: int
    stages: int
    ws: bool = False

    @property
    def spec(self) -> str:
        load = "tma" if self.tma else "ptr"
        return f"{load},m{self.block_m},n{self.block_n},w{self.warps},s{self.stages}" + (",ws" if self.ws else "")

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """The variant a spec string names (see the class docstring); ``ValueError`` on anything else."""
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts or parts[0] not in ("tma", "ptr"):
            raise ValueError(f"variant {spec!r}: must start with tma or ptr")
        found = {"m": 64, "n": 64, "w": 4, "s": 3}
        ws = False
        for part in parts[1:]:
            hit = re.fullmatch(r"([mnws])(\d+)", part)
            if part == "ws":
                ws = True
            elif hit:
                found[hit.group(1)] = int(hit.group(2))
            else:
                raise ValueError(f"variant {spec!r}: unknown part {part!r}")
        m, n, w = found["m"], found["n"], found["w"]
        if any(x < 16 or x & (x - 1) for x in (m, n)) or w & (w - 1) or found["s"] < 1:
            raise ValueError(f"variant {spec!r}: blocks must be powers of two >= 16, warps a power of two")
        return cls(parts[0] == "tma", m, n, w, found["s"], ws)


class SlashSteps(NamedTuple):
    """Per program (``[B * Hq, R]``, ``R = N / BLOCK_M`` row blocks, the last-to-first order is the kernel's) the key
    blocks it walks, in units of ``block_n`` keys, descending (the diagonal first, as today's kernel):

    full ``[B*Hq, R, F]`` int32 (padding -1) and fcount ``[B*Hq, R]``: blocks every row of the program attends whole;
    part ``[B*Hq, R, P]`` int32, pbits ``[B*Hq, R, P]`` int32 (bit ``j``: rows ``j * sub .. (j+1) * sub - 1`` attend
    the block, causally; ``sub = min(bs, block_m)``) and pcount ``[B*Hq, R]``."""

    full: torch.Tensor
    fcount: torch.Tensor
    part: torch.Tensor
    pbits: torch.Tensor
    pcount: torch.Tensor
    block_m: int
    block_n: int
    block_size: int


def slash_index(
    batch: int,
    heads: int,
    seqlen: int,
    block_size: int,
    kind: str,
    *,
    seed: int = 0,
    device: torch.device | str,
    **planted: int,
) -> VerticalSlashIndex:
    """A slash-only index ``[batch, heads, ·]`` (no vertical columns). ``kind``: ``planted`` (the planted pattern's
    slash part, ``benchmarks.cases.planted_index``: the diagonals of the last 2048 tokens and two 512-token bands at
    random distances per head; ``planted`` overrides ``local`` / ``bands`` / ``band``, for tiny cases) or ``all``
    (every offset: dense causal attention through the sparse kernels, the "every tile chosen" case of
    ``2026-12-03-h200-kernel_bound.md``)."""
    nb = -(-seqlen // block_size)
    if kind == "all":
        slash = torch.arange(nb, device=device).expand(batch, heads, nb)
    elif kind == "planted":
        from benchmarks.cases import planted_index

        slash = planted_index(
            batch, heads, seqlen, block_size, sinks=0, columns=0, seed=seed, device=device, **planted
        ).slash
    else:
        raise ValueError(f"unknown slash index kind {kind!r}; expected 'planted' or 'all'")
    empty = torch.empty(batch, heads, 0, dtype=torch.long, device=device)
    return VerticalSlashIndex.build(empty, slash, block_size)


def attended_entries(index: VerticalSlashIndex, seqlen: int) -> int:
    """Entries (query, key) the index attends over all batches and heads: per query tile ``i`` the causal diagonal
    (``bs (bs + 1) / 2``) and ``bs²`` per chosen offset ``1 <= o <= i``. ``seqlen`` a multiple of the block size."""
    bs, nb = index.block_size, index.num_blocks(seqlen)
    bitmap = index.offset_mask(seqlen).long()
    # Offset o >= 1 is reachable from the nb - o query tiles i >= o.
    reach = (nb - torch.arange(nb, device=bitmap.device)).clamp_min(0)
    off = (bitmap[..., 1:] * reach[1:]).sum().item()
    return int(off * bs * bs + bitmap.shape[0] * bitmap.shape[1] * nb * bs * (bs + 1) // 2)


def build_steps(index: VerticalSlashIndex, seqlen: int, block_m: int, block_n: int) -> SlashSteps:
    """The step lists of :class:`SlashSteps` for ``seqlen`` tokens (a multiple of ``block_m`` and of the block size;
    ``block_n`` divides the block size). Torch ops on the index's device and one host sync (the lists' widths)."""
    bs = index.block_size
    if seqlen % bs or seqlen % block_m or bs % block_n:
        raise ValueError(f"seqlen {seqlen} must be a multiple of bs {bs} and BLOCK_M {block_m}; BLOCK_N {block_n} | bs")
    dev = index.slash.device
    bmap = index.offset_mask(seqlen).flatten(0, 1)  # [BH, nb]
    slash = index.slash.flatten(0, 1)  # [BH, Ks]
    bh, rows = bmap.shape[0], seqlen // block_m
    sub = min(bs, block_m)
    nsub = block_m // sub
    per = bs // block_n
    r = torch.arange(rows, device=dev)
    first = r[:, None] * block_m + torch.arange(nsub, device=dev) * sub  # first row of each sub-tile [R, nsub]
    qt = first // bs
    # Candidates: every key block of every chosen offset of every sub-tile; then de-duplicated.
    kt = qt[None, :, :, None] - slash[:, None, None, :]  # [BH, R, nsub, Ks]
    ok = (slash[:, None, None, :] >= 0) & (kt >= 0)
    kb = kt[..., None] * per + torch.arange(per, device=dev)  # [BH, R, nsub, Ks, per]
    ok = ok[..., None] & (kb * block_n <= (r * block_m + block_m - 1)[None, :, None, None, None])
    cand = torch.where(ok, kb, -1).flatten(2).sort(-1, descending=True).values  # [BH, R, C]
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = cand[..., 1:] == cand[..., :-1]
    cand = torch.where(dup, -1, cand)
    # Which sub-tiles attend each candidate: its offset from each sub-tile's query tile is chosen, and some key of
    # the block is <= the sub-tile's last row (the diagonal tile at block_m < bs).
    key0 = cand.clamp_min(0) * block_n  # [BH, R, C]
    off = qt[None, :, None, :] - (key0 // bs)[..., None]  # [BH, R, C, nsub]
    chosen = torch.gather(bmap, 1, off.clamp(0, bmap.shape[1] - 1).flatten(1)).view(off.shape) & (off >= 0)
    chosen &= key0[..., None] <= (first + sub - 1)[None, :, None, :]
    chosen &= (cand >= 0)[..., None]
    bits = (chosen.int() << torch.arange(nsub, device=dev, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    # Full: every sub-tile attends and every key precedes the program's first row (no causal test either).
    full = (bits == (1 << nsub) - 1) & (key0 + block_n - 1 <= (r * block_m)[None, :, None])
    part = (bits != 0) & ~full

    def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = torch.where(keep, cand, -1)
        order = key.sort(dim=-1, descending=True, stable=True).indices
        count = keep.sum(-1, dtype=torch.int32)
        width = max(int(count.max().item()), 1)
        order = order[..., :width]
        return torch.gather(key, -1, order).int().contiguous(), order, count.contiguous()

    full_list, _, fcount = compact(full)
    part_list, order, pcount = compact(part)
    pbits = torch.gather(bits, -1, order).contiguous()
    return SlashSteps(full_list, fcount, part_list, pbits, pcount, block_m, block_n, bs)


@triton.jit
def _update(acc, m_i, l_i, qk, v, qk_scale, GUARD: tl.constexpr):
    """Online softmax over unscaled scores ``qk [M, N]`` (-inf where masked), values ``v [N, D]``; ``m_i`` in the
    log2 domain. GUARD: a row that has met no key yet and meets none here stays (0, -inf) instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_ref = m_new
    if GUARD:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # accumulate in the dot (wgmma in place on Hopper)
    return acc, m_new, l_i


@triton.jit
def _kv(K, V, KD, VD, k_base, v_base, row, col, offs_n, offs_d, stride_kn, stride_vn, TMA: tl.constexpr):
    """K transposed ``[D, BLOCK_N]`` and V ``[BLOCK_N, D]`` of one key block: through the descriptors at (row, col)
    of the ``[B * N, Hkv * D]`` view, or by pointers at local rows ``offs_n``."""
    if TMA:
        kt = KD.load([row, col]).T
        v = VD.load([row, col])
    else:
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None])
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
    return kt, v


@triton.jit
def _slash_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    QD,
    KD,
    VD,
    FULL,
    FCNT,
    PART,
    PBITS,
    PCNT,
    qk_scale,
    N,
    R,
    NF,
    NP,
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
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    bh = tl.program_id(0)  # fastest: the heads of one GQA group run together and share their K/V tiles in L2
    r = R - 1 - tl.program_id(1)  # most work first
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, BLOCK_N)
    if TMA:
        q = QD.load([b * N + r * BLOCK_M, h * D])
    else:
        q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    sub_tile = tl.arange(0, BLOCK_M) // SUB
    lists = bh.to(tl.int64) * R + r
    # The partial blocks first (the diagonal among them): masked by the sub-tiles' bits and causally; a row may
    # meet no key in one of them (its sub-tile's bit unset), hence the guard.
    for s in range(0, tl.load(PCNT + lists)):
        kb = tl.load(PART + lists * NP + s)
        bits = tl.load(PBITS + lists * NP + s)
        offs_n = kb * BLOCK_N + offs_b
        kt, v = _kv(K, V, KD, VD, k_base, v_base, b * N + kb * BLOCK_N, hk * D, offs_n, offs_d, stride_kn, stride_vn,
                    TMA)  # fmt: skip
        qk = tl.dot(q, kt)
        seen = (((bits >> sub_tile) & 1) != 0)[:, None] & (offs_n[None, :] <= offs_m[:, None])
        qk = tl.where(seen, qk, float("-inf"))
        acc, m_i, l_i = _update(acc, m_i, l_i, qk, v, qk_scale, True)
    # The full blocks: no mask, no guard (every row met its diagonal above). The loop to pipeline / specialise.
    for s in tl.range(0, tl.load(FCNT + lists), warp_specialize=WS):
        kb = tl.load(FULL + lists * NF + s)
        offs_n = kb * BLOCK_N + offs_b
        kt, v = _kv(K, V, KD, VD, k_base, v_base, b * N + kb * BLOCK_N, hk * D, offs_n, offs_d, stride_kn, stride_vn,
                    TMA)  # fmt: skip
        qk = tl.dot(q, kt)
        acc, m_i, l_i = _update(acc, m_i, l_i, qk, v, qk_scale, False)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    out = acc / l_i[:, None]
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty))
    tl.store(LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m, lse)


def slash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    steps: SlashSteps,
    variant: Variant,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slash-only forward over the step lists. q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]`` (contiguous; fp16, bf16 or
    fp32; D 64 or 128); ``steps`` from :func:`build_steps` with the variant's ``block_m`` / ``block_n``. Returns out
    ``[B, N, Hq, D]`` (q's dtype) and lse ``[B, Hq, N]`` (fp32, natural log)."""
    bsz, n, hq, d = q.shape
    hkv = k.shape[2]
    if (steps.block_m, steps.block_n) != (variant.block_m, variant.block_n):
        raise ValueError(f"steps built for {(steps.block_m, steps.block_n)}, variant {variant.spec}")
    if k.shape != (bsz, n, hkv, d) or v.shape != k.shape or hq % hkv or n % variant.block_m:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} for {variant.spec}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("q, k, v must be contiguous (the descriptors view them as [B * N, H * D])")
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, n, device=q.device, dtype=torch.float32)
    rows = n // variant.block_m
    if variant.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        qd = TensorDescriptor.from_tensor(q.view(bsz * n, hq * d), [variant.block_m, d])
        kd = TensorDescriptor.from_tensor(k.view(bsz * n, hkv * d), [variant.block_n, d])
        vd = TensorDescriptor.from_tensor(v.view(bsz * n, hkv * d), [variant.block_n, d])
    else:
        qd, kd, vd = q, k, v  # placeholders: never read without TMA
    _slash_fwd_kernel[(bsz * hq, rows)](
        q,
        k,
        v,
        out,
        lse,
        qd,
        kd,
        vd,
        steps.full,
        steps.fcount,
        steps.part,
        steps.pbits,
        steps.pcount,
        scale * LOG2E,
        n,
        rows,
        steps.full.shape[-1],
        steps.part.shape[-1],
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        *lse.stride()[:2],
        HQ=hq,
        GROUP=hq // hkv,
        D=d,
        BLOCK_M=variant.block_m,
        BLOCK_N=variant.block_n,
        SUB=min(steps.block_size, variant.block_m),
        TMA=variant.tma,
        WS=variant.ws,
        num_warps=variant.warps,
        num_stages=variant.stages,
    )
    return out, lse


def slash_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, softmax_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference of the slash semantics (module docstring): ``sparse.reference.reference_attention`` on
    the index's dense mask, ``N x N``: small N only. Shapes as :func:`slash_forward`; returns out ``[B, N, Hq, D]``
    and lse ``[B, Hq, N]``, both float64."""
    mask = index_to_dense_mask(index, q.shape[1])
    return reference_attention(q.double(), k.double(), v.double(), mask, softmax_scale)
