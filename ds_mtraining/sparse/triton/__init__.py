"""Triton kernels of vertical-slash sparse attention (CUDA; CPU only under ``TRITON_INTERPRET=1``), and of the index
(``columns``, ``report``: imported on first use through ``sparse.backends``).

Semantics (``VerticalSlashIndex``): query q attends key k iff ``k <= q`` and (``k`` is a vertical column of its
head, or ``q // bs - k // bs`` is a slash offset of its head). Query tiles are the ``bs``-row blocks of the index,
so for query tile ``i`` a column ``c`` is "inside a chosen tile" iff offset ``i - c // bs`` is chosen; since offset
0 is always chosen, the columns a tile reads un-tiled are exactly those with ``c < i * bs`` whose offset is not
chosen, and the causal test ``c <= q`` is then automatic. With packed documents (``doc_start``, docs/design.md), also
``k >= doc_start[b, q]``: the tiles and columns before a query tile's first document are not visited.

The attention's modules, one job each:

- ``document_tiles``: packed documents in the kernels' form (per-row starts, the last query tile of each key block);
- ``kernel_index``: the index in the kernels' per-tile form (``KernelIndex``, ``prepare_index``; cached on the index
  by ``VerticalSlashIndex.kernel_index``), ring shards' tile maps (``TileMap``, ``prepare_tile_map``) and a ring
  step's own columns, their local rows and its offsets (``replace_columns``, ``replace_column_rows``,
  ``replace_slash``), plain PyTorch;
- ``launch_config``: tile shapes, warps and stages of every pass (``launch_config``, ``override_launch_config``);
- ``common``: the query tile's walk of the index that the forward and dq passes share, the slash tile load, and
  the launchers' input check (the limits);
- ``forward``: the forward kernel and ``vertical_slash_forward`` (optionally merging into a running fp32
  ``(out, lse)``, and on ring shards placed by tile maps);
- ``backward``, ``backward_dq``, ``backward_dkdv``: ``vertical_slash_backward`` (deterministic) and its passes, and
  ``backward_delta``, the rows' ``rowsum(dO * out)`` that a ring's steps share;
- ``ops``: both launchers of one device as ``torch.library`` custom ops (``forward_op``,
  ``backward_op``, ``index_tensors``), what ``vertical_slash_attention`` runs, traceable by ``torch.compile``.

Performance (H200, bf16, B=1, Hq=16, Hkv=2, D=128, bs=128, 128K tokens, 95 % sparsity): forward 9.7 ms, forward +
backward 37.9 ms (11.9x dense cuDNN SDPA; 13.0x at 256K); see benchmarks/results/. Provenance: the loop structure
follows the Triton fused-attention tutorial and FlashAttention-2; the vertical/slash split follows MInference /
MTraining.
"""

from .backward import backward_delta, vertical_slash_backward
from .forward import vertical_slash_forward
from .kernel_index import (
    KernelIndex,
    TileMap,
    prepare_index,
    prepare_tile_map,
    replace_column_rows,
    replace_columns,
    replace_slash,
)
from .ops import backward_op, forward_op, index_tensors

__all__ = [
    "KernelIndex",
    "TileMap",
    "backward_delta",
    "backward_op",
    "forward_op",
    "index_tensors",
    "prepare_index",
    "prepare_tile_map",
    "replace_column_rows",
    "replace_columns",
    "replace_slash",
    "vertical_slash_backward",
    "vertical_slash_forward",
]
