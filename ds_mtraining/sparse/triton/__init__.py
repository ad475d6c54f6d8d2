"""Triton kernels for vertical-slash sparse attention (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Launchers: ``vertical_slash_forward`` (optionally merging into a running fp32 ``(out, lse)``),
``vertical_slash_backward`` (deterministic), and ``prepare_index``, which converts a ``VerticalSlashIndex``
to the kernels' per-tile form once so several calls (forward, backward, ring steps) can share it.
"""

from .vertical_slash import KernelIndex, prepare_index, vertical_slash_backward, vertical_slash_forward

__all__ = ["KernelIndex", "prepare_index", "vertical_slash_backward", "vertical_slash_forward"]
