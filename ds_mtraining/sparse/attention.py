"""``vertical_slash_attention``: the single-device sparse attention API (autograd Function + public function).

Backends share one launcher API (``vertical_slash_forward`` / ``vertical_slash_backward``): the Triton
kernels for CUDA tensors, ``torch_path`` everywhere else. Both can merge into a running (out, lse), which is
what a ring step calls directly; this module is the autograd wrapper for the whole sequence on one device.

The wrapper runs each backend's launchers as ``torch.library`` custom ops (``forward_op`` / ``backward_op`` on the
index tensors of ``index_tensors``), so ``torch.compile(fullgraph=True)`` traces a model through the attention
without graph breaks (with ``check_index=False``: the validation is a host sync).

Packed documents (``documents``) keep every query inside its document. Dense (``index=None``), that is FlexAttention
with a document ``mask_mod`` on CUDA and SDPA under the boolean mask elsewhere; with an index, both backends' ops take
their starts (``doc_start``).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from . import torch_path
from .backends import uses_triton
from .documents import Documents
from .index import VerticalSlashIndex, index_to_dense_mask
from .scale import resolve_softmax_scale

__all__ = [
    "DENSE_BACKENDS",
    "document_mask_mod",
    "kernel_backend",
    "masked_sparse_attention",
    "resolve_softmax_scale",
    "vertical_slash_attention",
]

DENSE_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""SDPA's backends for the dense path, fastest first. PyTorch's own order tries FlashAttention-2 before cuDNN; on an
H200 cuDNN's causal forward + backward is 1.7x faster (450 vs 759 ms at 128K, 16/2 heads of 128:
docs/measurements.md, "Dense backends"), and a dense layer 0 is a quarter of a sparse
training step's attention time at 256K."""


def kernel_backend(q: torch.Tensor) -> ModuleType:
    """The launcher module for ``q``'s device: the Triton kernels for CUDA tensors, ``torch_path`` otherwise."""
    if not uses_triton(q.device):
        return torch_path
    try:
        from . import triton as triton_backend
    except ImportError as err:  # triton ships with CUDA builds of torch, so this is a broken install
        raise RuntimeError(
            f"vertical_slash_attention on CUDA needs Triton ({err}); install it with `pip install ds-mtraining[triton]`"
        ) from err
    return triton_backend


class VerticalSlashAttentionFunction(torch.autograd.Function):
    """Autograd over the custom ops of ``q``'s backend; ``index`` is that backend's ``index_tensors`` (the Triton
    kernels': the index's kernel form, converted once and cached on the index), saved for the backward.
    ``doc_start`` is ``Documents.starts`` or None; both backends' ops take it last."""

    @staticmethod
    def forward(ctx, q, k, v, block_size, softmax_scale, precomputed, doc_start, *index):
        if precomputed is None:
            out, lse = kernel_backend(q).forward_op(q, k, v, *index, block_size, softmax_scale, doc_start)
        else:
            # An earlier call's (out, lse) for these inputs (``vertical_slash_attention(precomputed=...)``): no
            # kernel. New tensor objects over the same memory, so this call's node does not attach to the caller's.
            out, lse = (x.detach() for x in precomputed)
        ctx.save_for_backward(q, k, v, out, lse, doc_start, *index)
        ctx.block_size, ctx.softmax_scale = block_size, softmax_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, doc_start, *index = ctx.saved_tensors
        dq, dk, dv = kernel_backend(q).backward_op(
            dout.contiguous(), q, k, v, out, lse, *index, ctx.block_size, ctx.softmax_scale, doc_start
        )
        return dq, dk, dv, None, None, None, None, *(None for _ in index)


def document_mask_mod(documents: Documents):
    """FlexAttention ``mask_mod`` of causal attention inside each document of ``documents``."""
    starts = documents.starts

    def causal_in_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= starts[b, q_idx])

    return causal_in_document


@functools.cache
def _compiled_flex():
    """FlexAttention's fused kernels (eager flex_attention materialises the scores) and its block-mask builder
    (eager, it materialises the [B, N, N] mask), compiled on first use."""
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def _dense_in_documents(q, k, v, documents: Documents, scale: float, return_lse: bool):
    """Dense causal attention inside each document: FlexAttention on CUDA, whose block mask skips the tiles between
    documents (with the lse); SDPA under the boolean ``[B, 1, N, N]`` mask elsewhere (the CPU baseline, O(N²)
    memory, no lse: the caller runs the PyTorch path for that)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if uses_triton(q.device):
        flex, block_mask = _compiled_flex()
        mask = block_mask(document_mask_mod(documents), documents.batch, None, q.shape[1], q.shape[1], q.device)
        if not return_lse:
            return flex(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)
        out, aux = flex(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out.transpose(1, 2), aux.lse
    with sdpa_kernel(DENSE_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=documents.mask()[:, None], scale=scale, enable_gqa=True
        )  # fmt: skip
    return out.transpose(1, 2)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex | None,
    documents: Documents | None,
    check_index: bool,
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, N, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q [B, N, Hq, D] and k/v [B, N, Hkv, D] must agree on B, N and D; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for GQA")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if documents is not None:
        if not isinstance(documents, Documents):
            raise ValueError(f"documents must be a Documents (sparse.documents); got {type(documents).__name__}")
        documents.check_rows(q.shape[0], q.shape[1], "vertical_slash_attention's q", q.device)
        if check_index:
            documents.validate()
    if index is None:
        return
    if (index.batch, index.heads) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"index is for batch={index.batch}, heads={index.heads} but q has batch={q.shape[0]}, "
            f"query heads={q.shape[2]}; the index is per query head"
        )
    if index.device != q.device:
        raise ValueError(f"index is on {index.device} but q is on {q.device}; move it with the inputs")
    if check_index:
        index.validate(q.shape[1])


def _check_precomputed(
    q: torch.Tensor, index: VerticalSlashIndex | None, precomputed: tuple[torch.Tensor, torch.Tensor]
) -> None:
    if index is None:
        raise ValueError(
            "precomputed (out, lse) needs an index: dense attention (index=None) runs SDPA, which keeps its own"
        )
    out, lse = precomputed
    b, n, h, _ = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or lse.shape != (b, h, n) or out.device != q.device:
        raise ValueError(
            f"precomputed (out, lse) must be out {tuple(q.shape)} {q.dtype} and lse {(b, h, n)} on {q.device} "
            f"(what return_lse=True returned for these q, k, v); got out {tuple(out.shape)} {out.dtype}, "
            f"lse {tuple(lse.shape)} on {out.device}"
        )


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex | None,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    check_index: bool = True,
    precomputed: tuple[torch.Tensor, torch.Tensor] | None = None,
    documents: Documents | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to a vertical-slash index, forward and backward.

    Query ``q`` at position i attends key j iff ``j <= i`` and (``j`` is a vertical column of its head, or the
    block offset ``i // bs - j // bs`` is a slash offset of its head); see ``VerticalSlashIndex``. With
    ``documents``, also ``j >= documents.starts[b, i]`` (docs/design.md, "Packed documents").

    Args:
        q: ``[B, N, Hq, D]``, fp32 / fp16 / bf16 (fp64 on the PyTorch path).
        k, v: ``[B, N, Hkv, D]``, same dtype and device; ``Hq % Hkv == 0`` and query head ``h`` reads kv head
            ``h // (Hq // Hkv)`` (GQA without repeating K/V).
        index: per query head, ``[B, Hq, ...]``; ``None`` means dense causal attention (SDPA).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp ``[B, Hq, N]``, fp32 (fp64 for fp64 inputs), natural log
            (not differentiable).
        check_index: validate ``index`` against the sequence first (``VerticalSlashIndex.validate``: canonical
            rows, entries in range; and ``Documents.validate`` for ``documents``). It synchronises with the host, which stalls a model's layer-by-layer
            launches (4 layers of estimate + attention at 128K on an H200: 1-3 % slower,
            docs/measurements.md, "Index validation"). The estimators' indices are valid
            by construction, so the model integration passes ``False``; an index built any other way is worth
            checking (an invalid one gives wrong results without an error). Under ``torch.compile`` the sync is a
            graph break: pass ``False`` there.
        precomputed: ``(out, lse)`` that ``return_lse=True`` returned before for the same q, k, v, index and
            scale: returned as they are, without running the forward kernel, and the backward computes dq/dk/dv
            from them as usual. For an activation checkpoint's recomputation
            (``ds_mtraining.integration.recompute.keep_attention``); other values give wrong gradients without
            an error. Needs an ``index``.
        documents: the packed documents of each row (``Documents``, ``[B, N]``), or None for one document a row.
            Dense, FlexAttention on CUDA and SDPA elsewhere; with an index, the sparse kernels skip the tiles and
            columns outside each query tile's documents.

    Returns:
        out ``[B, N, Hq, D]`` in q's dtype, and lse if ``return_lse``. With an index the backward is
        bitwise-repeatable on every device (``None`` runs SDPA's).
    """
    _check_inputs(q, k, v, index, documents, check_index)
    if precomputed is not None:
        _check_precomputed(q, index, precomputed)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], "vertical_slash_attention")
    if index is None:
        if documents is not None and (uses_triton(q.device) or not return_lse):
            return _dense_in_documents(q, k, v, documents, scale, return_lse)
        if documents is None and not return_lse:
            with sdpa_kernel(DENSE_BACKENDS, set_priority=True):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
                    enable_gqa=True,
                )  # fmt: skip
            return out.transpose(1, 2)
        # SDPA does not expose the lse publicly; the all-offsets index is dense causal attention exactly.
        index = VerticalSlashIndex.dense(q.shape[0], q.shape[2], q.shape[1], 64, device=q.device)
    index_tensors = kernel_backend(q).index_tensors(index, q.shape[1])
    doc_start = None if documents is None else documents.starts
    out, lse = VerticalSlashAttentionFunction.apply(
        q, k, v, index.block_size, scale, precomputed, doc_start, *index_tensors
    )
    return (out, lse) if return_lse else out


def masked_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VerticalSlashIndex,
    scale: float,
    documents: Documents | None = None,
) -> torch.Tensor:
    """The index's attention computed as dense SDPA under its boolean mask (the same semantics in O(N²) memory):
    q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]``, any dtype SDPA takes, inside ``documents`` (``[B, N]``) if given;
    the output ``[B, N, Hq, D]`` in q's dtype.

    For accelerators where the sparse kernels are not available; the numbers it gives (perplexity, recall,
    NIAH) are those of the index, whatever computes it.
    """
    mask = index_to_dense_mask(index, q.shape[1], documents)  # [B, Hq, N, N]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)
