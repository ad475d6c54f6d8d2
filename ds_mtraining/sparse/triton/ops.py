"""The Triton attention of one device as ``torch.library`` custom ops: what ``vertical_slash_attention`` runs on CUDA.

``ds_mtraining::triton_vertical_slash_forward`` / ``ds_mtraining::triton_vertical_slash_backward`` run
``vertical_slash_forward`` / ``vertical_slash_backward`` on the index's kernel form, passed as its tensors
(``index_tensors``: ``KernelIndex.tensors`` of the form cached on the index) and the optional document starts, as
the PyTorch path's ops take them. Their fake kernels give the outputs' shapes, dtypes and strides without running
Triton, so ``torch.compile`` traces the attention as one graph node per op instead of breaking the graph at the
launchers' Python. A ring step calls the launchers themselves: it merges
into a running (out, lse) in place and places shards, which these functional one-device ops leave out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .backward import dense_layout, vertical_slash_backward
from .forward import vertical_slash_forward
from .kernel_index import KernelIndex

if TYPE_CHECKING:  # annotations only: importing the index here would close index -> backends -> triton -> here
    from ..index import VerticalSlashIndex


def index_tensors(index: VerticalSlashIndex, seqlen: int) -> tuple[Tensor, ...]:
    """The index tensors the ops take for ``seqlen`` tokens: ``(slash, scount, columns, ccount, offsets)`` of
    ``index.kernel_index(seqlen)`` (int32 / int8, on the index's device; converted once, cached on ``index``)."""
    return index.kernel_index(seqlen).tensors


@torch.library.custom_op("ds_mtraining::triton_vertical_slash_forward", mutates_args=())
def forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slash: Tensor,
    scount: Tensor,
    columns: Tensor,
    ccount: Tensor,
    offsets: Tensor,
    block_size: int,
    softmax_scale: float,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``vertical_slash_forward`` on one device: q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]`` and the index tensors
    (``index_tensors``), inside the documents of ``doc_start`` (integer ``[B, N]``, ``Documents.starts``) if given;
    returns out ``[B, N, Hq, D]`` (q's dtype, laid out like ``torch.empty_like(q)``) and lse ``[B, Hq, N]`` fp32."""
    kidx = KernelIndex.from_tensors(slash, scount, columns, ccount, offsets, block_size)
    return vertical_slash_forward(q, k, v, kidx, softmax_scale, doc_start=doc_start)


@forward_op.register_fake
def _forward_fake(q, k, v, slash, scount, columns, ccount, offsets, block_size, softmax_scale, doc_start=None):
    b, n, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("ds_mtraining::triton_vertical_slash_backward", mutates_args=())
def backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    slash: Tensor,
    scount: Tensor,
    columns: Tensor,
    ccount: Tensor,
    offsets: Tensor,
    block_size: int,
    softmax_scale: float,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``vertical_slash_backward`` on one device: dq ``[B, N, Hq, D]``, dk, dv ``[B, N, Hkv, D]`` in the inputs'
    dtypes, each laid out like its input where that is dense, else contiguous (``dense_layout``); ``doc_start`` as
    in the forward."""
    kidx = KernelIndex.from_tensors(slash, scount, columns, ccount, offsets, block_size)
    return vertical_slash_backward(do, q, k, v, out, lse, kidx, softmax_scale, doc_start=doc_start)


@backward_op.register_fake
def _backward_fake(
    do, q, k, v, out, lse, slash, scount, columns, ccount, offsets, block_size, softmax_scale, doc_start=None
):
    return tuple(torch.empty_like(dense_layout(x)) for x in (q, k, v))
