"""Dense causal attention over whole rows on the fastest exact kernel installed: layer 0 and every dense layer.

Why a module of its own: SDPA chooses only among PyTorch's kernels, in an order that tries FlashAttention-2 before
cuDNN, and flash-attn-4 (``flash_attn.cute``: FlashAttention for Hopper and Blackwell, written in the CuTe DSL) is a
separate package with no path for other GPUs, the CPU or fp32. So each call asks which kernel serves q's device,
dtype and head dim, walking ``DENSE_ORDER``: per GPU architecture, the kernels fastest first as measured
(``benchmarks.dense_kernels``: causal forward + backward, 16 query / 2 KV heads of 128, bf16; on an H100 at 128K
flash-attn-4 is 1.15x cuDNN and FlashAttention-2 0.59x: docs/measurements.md, "Dense kernels"). An architecture not
measured runs SDPA.

The flash-attn (2.x) package adds no kernel here: SDPA's ``FLASH_ATTENTION`` backend is FlashAttention-2, and on
Hopper cuDNN is faster (450 against 759 ms at 128K on an H200, ``2026-11-30-h200-kernel_bench_final.md``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .backends import uses_triton

__all__ = ["DENSE_BACKENDS", "DENSE_ORDER", "DenseKernel", "dense_causal_attention", "dense_kernel"]

DenseKernel = Literal["flash_attn_4", "sdpa"]

DENSE_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""SDPA's backends for the dense path, fastest first. PyTorch's own order tries FlashAttention-2 before cuDNN; on an
H200 cuDNN's causal forward + backward is 1.7x faster (450 vs 759 ms at 128K, 16/2 heads of 128:
docs/measurements.md, "Dense kernels"), and a dense layer 0 is a quarter of a sparse training step's attention time
at 256K."""

DENSE_ORDER: dict[int, tuple[DenseKernel, ...]] = {
    9: ("flash_attn_4", "sdpa"),  # H100 / H200: docs/measurements.md, "Dense kernels"
}
"""Per CUDA compute capability major, the dense kernels fastest first, as measured; every other device: SDPA."""


@functools.cache
def _flash_attn_4() -> Callable | None:
    """flash-attn-4's ``flash_attn_func``, or None where it is not installed (or does not import)."""
    try:
        return importlib.import_module("flash_attn.cute").flash_attn_func
    except Exception:  # a broken install (a CuTe DSL without its CUDA libs) raises more than ImportError
        return None


def _serves(kernel: DenseKernel, dtype: torch.dtype, head_dim: int) -> bool:
    if kernel == "sdpa":
        return True
    # flash-attn-4 on Hopper: fp16 / bf16, head dims 8-256 in 16-byte rows (its _validate_head_dims).
    fits = dtype in (torch.float16, torch.bfloat16) and 8 <= head_dim <= 256 and head_dim % 8 == 0
    return fits and _flash_attn_4() is not None


def dense_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> DenseKernel:
    """The kernel ``dense_causal_attention`` runs for q of this device, dtype and head dim: the first of
    ``DENSE_ORDER`` for the GPU's architecture that is installed and takes them; SDPA off CUDA and under
    ``torch.compile``."""
    # flash-attn-4 registers no custom op, so torch.compile cannot trace its CuTe DSL launches: SDPA there.
    if not uses_triton(device) or torch.compiler.is_compiling():
        return "sdpa"
    major, _ = torch.cuda.get_device_capability(device)
    return next(kernel for kernel in (*DENSE_ORDER.get(major, ()), "sdpa") if _serves(kernel, dtype, head_dim))


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention on ``dense_kernel`` of q's device, dtype and head dim: q ``[B, n, Hq, D]``, k/v
    ``[B, nk, Hkv, D]`` with ``n <= nk`` (``Hq % Hkv == 0``, GQA without repeating K/V; q's rows are the last ``n``
    positions: ``n < nk`` is a decoding step over a KV cache, which SDPA serves), any float dtype; out
    ``[B, n, Hq, D]`` in q's dtype, differentiable in q, k and v."""
    nq, nk = q.shape[1], k.shape[1]
    if nq == nk and dense_kernel(q.device, q.dtype, q.shape[-1]) == "flash_attn_4":
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        out, _ = _flash_attn_4()(
            q, k, v, softmax_scale=scale, causal=True, deterministic=torch.are_deterministic_algorithms_enabled()
        )
        return out
    # SDPA's is_causal aligns the mask to the top left: right only for n == nk. One new row attends to every key.
    kwargs = {"is_causal": True} if nq == nk else {}
    if 1 < nq < nk:  # a chunk of new rows after a cache: causal with an offset
        rows = torch.arange(nk - nq, nk, device=q.device)
        kwargs = {"attn_mask": torch.arange(nk, device=q.device)[None, :] <= rows[:, None]}
    with sdpa_kernel(DENSE_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, enable_gqa=True, **kwargs
        )
    return out.transpose(1, 2)
