"""``vertical_slash_attention``: the single-device sparse attention API (autograd Function + public function).

Backends share one launcher API (``vertical_slash_forward`` / ``vertical_slash_backward`` / ``backward_delta``): the
Triton kernels for CUDA tensors, ``torch_path`` everywhere else. Both can merge into a running (out, lse), and add
into a running dq and write dK/dV into a given buffer, which is what a ring step calls directly; this module is the autograd wrapper for the whole sequence on one device.

The wrapper runs each backend's launchers as ``torch.library`` custom ops (``forward_op`` / ``backward_op`` on the
index tensors of ``index_tensors``), so ``torch.compile(fullgraph=True)`` traces a model through the attention
without graph breaks (with ``check_index=False``: the validation is a host sync).

The pattern (``AttentionPattern``: the index, the packed documents, the length) is the one argument that says what is
attended. Packed documents keep every query inside its document: dense (no index), that is FlexAttention with a
document ``mask_mod`` on CUDA and SDPA under the boolean mask elsewhere; with an index, both backends' ops take their
starts (``doc_start``).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from . import torch_path
from .backends import uses_triton
from .dense import DENSE_BACKENDS, dense_causal_attention
from .documents import Documents
from .index import VerticalSlashIndex
from .pattern import AttentionPattern
from .scale import resolve_softmax_scale

__all__ = [
    "document_mask_mod",
    "kernel_backend",
    "masked_sparse_attention",
    "resolve_softmax_scale",
    "vertical_slash_attention",
]


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern | None, check_index: bool
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
    if pattern is None:
        return
    if not isinstance(pattern, AttentionPattern):
        raise ValueError(
            f"pattern must be an AttentionPattern (sparse.pattern) or None; got {type(pattern).__name__}: wrap an "
            "index as AttentionPattern(seqlen, index)"
        )
    if pattern.seqlen != q.shape[1]:
        raise ValueError(
            f"the pattern is for rows of {pattern.seqlen} tokens but q has {q.shape[1]}; build it for q's length"
        )
    pattern.check(q.shape[0], q.shape[2], q.device, "vertical_slash_attention's q")
    if check_index:
        pattern.validate()


def _check_precomputed(
    q: torch.Tensor, pattern: AttentionPattern | None, precomputed: tuple[torch.Tensor, torch.Tensor]
) -> None:
    if pattern is None or pattern.index is None:
        raise ValueError(
            "precomputed (out, lse) needs a pattern with an index: dense attention runs SDPA, which keeps its own"
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
    pattern: AttentionPattern | None,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    check_index: bool = True,
    precomputed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to an attention pattern, forward and backward.

    Query ``q`` at position i attends key j iff ``j <= i`` and (``j`` is a vertical column of its head, or the
    block offset ``i // bs - j // bs`` is a slash offset of its head; see ``VerticalSlashIndex``), and with packed
    documents ``j >= documents.starts[b, i]`` (docs/design.md, "Packed documents"): ``AttentionPattern``.

    Args:
        q: ``[B, N, Hq, D]``, fp32 / fp16 / bf16 (fp64 on the PyTorch path).
        k, v: ``[B, N, Hkv, D]``, same dtype and device; ``Hq % Hkv == 0`` and query head ``h`` reads kv head
            ``h // (Hq // Hkv)`` (GQA without repeating K/V).
        pattern: what is attended (``AttentionPattern`` over ``N`` tokens: the index per query head ``[B, Hq, ...]``
            or ``None`` for dense, the packed documents ``[B, N]`` or ``None``); ``None`` means dense causal
            attention over whole rows (``sparse.dense``: flash-attn-4 or SDPA, as measured).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp ``[B, Hq, N]``, fp32 (fp64 for fp64 inputs), natural log
            (not differentiable).
        check_index: validate the pattern first (``AttentionPattern.validate``: the index's rows canonical and in
            range, the documents' starts valid). It synchronises with the host, which stalls a model's layer-by-layer
            launches (4 layers of estimate + attention at 128K on an H200: 1-3 % slower,
            docs/measurements.md, "Index validation"). The estimators' indices are valid
            by construction, so the model integration passes ``False``; an index built any other way is worth
            checking (an invalid one gives wrong results without an error). Under ``torch.compile`` the sync is a
            graph break: pass ``False`` there.
        precomputed: ``(out, lse)`` that ``return_lse=True`` returned before for the same q, k, v, index and
            scale: returned as they are, without running the forward kernel, and the backward computes dq/dk/dv
            from them as usual. For an activation checkpoint's recomputation
            (``ds_mtraining.integration.recompute.keep_attention``); other values give wrong gradients without
            an error. Needs a pattern with an index.

    Returns:
        out ``[B, N, Hq, D]`` in q's dtype, and lse if ``return_lse``. With an index the backward is
        bitwise-repeatable on every device (dense runs ``sparse.dense``'s kernels or FlexAttention).
    """
    _check_inputs(q, k, v, pattern, check_index)
    if precomputed is not None:
        _check_precomputed(q, pattern, precomputed)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], "vertical_slash_attention")
    index = None if pattern is None else pattern.index
    documents = None if pattern is None else pattern.documents
    if index is None:
        if documents is not None and (uses_triton(q.device) or not return_lse):
            return _dense_in_documents(q, k, v, documents, scale, return_lse)
        if documents is None and not return_lse:
            return dense_causal_attention(q, k, v, scale)
        # SDPA does not expose the lse publicly; the all-offsets index is dense causal attention exactly.
        index = VerticalSlashIndex.dense(q.shape[0], q.shape[2], q.shape[1], 64, device=q.device)
    index_tensors = kernel_backend(q).index_tensors(index, q.shape[1])
    doc_start = None if documents is None else documents.starts
    out, lse = VerticalSlashAttentionFunction.apply(
        q, k, v, index.block_size, scale, precomputed, doc_start, *index_tensors
    )
    return (out, lse) if return_lse else out


def masked_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, scale: float
) -> torch.Tensor:
    """The pattern's attention computed as dense SDPA under its boolean mask (the same semantics in O(N²) memory):
    q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]``, any dtype SDPA takes, ``pattern`` over the ``N`` tokens; the output
    ``[B, N, Hq, D]`` in q's dtype.

    For accelerators where the sparse kernels are not available; the numbers it gives (perplexity, recall,
    NIAH) are those of the index, whatever computes it.
    """
    mask = pattern.dense_mask(q.device)  # [B, Hq or 1, N, N]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)
