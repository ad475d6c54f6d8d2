"""What the forward and the backward passes share: the ``@triton.jit`` load of a slash tile's keys, and the
launchers' input check.

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
