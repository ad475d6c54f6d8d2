"""Every attention entry point in one module, the way ``flash_attn/flash_attn_interface.py`` gathers FlashAttention's.

All take q ``[B, N, Hq, D]`` and k/v ``[B, N, Hkv, D]`` (``Hq % Hkv == 0``, GQA without repeating K/V) and one
:class:`AttentionPattern` that says what is attended (the vertical-slash index or ``None`` for dense, the packed
documents or ``None``, the rows' length); they return out ``[B, N, Hq, D]`` in q's dtype and, with
``return_lse=True``, the log-sum-exp ``[B, Hq, N]`` (fp32, natural log).

=================================  =====================================================================
``vertical_slash_attention``       one device: the sparse kernels (Triton on CUDA, PyTorch elsewhere) for a
                                   pattern with an index; dense causal (cuDNN first; FlexAttention inside
                                   documents) for one without, or for ``None``
``masked_sparse_attention``        one device, the pattern as SDPA under its dense boolean mask (O(N²)
                                   memory; for accelerators without the sparse kernels)
``sparse_ring_attention``          a sequence sharded over a ring of ranks (``parallel.layout``), the whole
                                   rows' pattern on every rank; its backward runs the ring again
``vertical_slash_attention_naive`` the definition, a float64-capable softmax under the pattern's mask: the
                                   reference every fast path is tested against
=================================  =====================================================================

The implementations live with what they need: ``sparse.attention`` (the one-device autograd function over the
custom ops), ``sparse.naive``, ``parallel.ring`` (the ring's schedule and per-step kernels). The index comes from
``estimator.estimate_index`` (``pattern.with_index(index)``).
"""

from .parallel.ring import sparse_ring_attention
from .sparse.attention import masked_sparse_attention, vertical_slash_attention
from .sparse.documents import Documents
from .sparse.index import VerticalSlashIndex
from .sparse.naive import vertical_slash_attention_naive
from .sparse.pattern import AttentionPattern

__all__ = [
    "AttentionPattern",
    "Documents",
    "VerticalSlashIndex",
    "masked_sparse_attention",
    "sparse_ring_attention",
    "vertical_slash_attention",
    "vertical_slash_attention_naive",
]
