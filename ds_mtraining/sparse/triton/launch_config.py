"""Launch configs of the attention kernels: tile shapes, warps and pipeline stages per pass, and the tuning override.

Passes: ``fwd`` (forward), ``dq``, ``dkdv`` and ``col`` (the backward's dq, dk/dv and column passes). A config is
``(block per program, inner block, num_warps, num_stages)``: ``fwd`` / ``dq``: query rows, key sub-block;
``dkdv``: keys, query sub-block; ``col``: columns, query sub-block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

LaunchConfig = tuple[int, int, int, int]  # (block per program, inner block, num_warps, num_stages)

# Per (block size, head dim). BLOCK_M / BLOCK_N of a pass must divide the block size. (128, 128) was tuned on an
# H200 (benchmarks/kernel_tune.py, through ``override_launch_config``; its column pass together with ``COL_SPLIT``:
# docs/measurements.md, "Kernel launch configurations"); the others are scaled from it.
_CONFIG: dict[tuple[int, int], dict[str, LaunchConfig]] = {
    (64, 64): {"fwd": (64, 64, 4, 3), "dq": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "col": (64, 64, 4, 2)},
    (64, 128): {"fwd": (64, 64, 4, 3), "dq": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "col": (64, 32, 4, 2)},
    (128, 64): {"fwd": (128, 128, 8, 3), "dq": (128, 128, 8, 2), "dkdv": (128, 64, 8, 3), "col": (128, 64, 8, 2)},
    (128, 128): {"fwd": (128, 128, 8, 3), "dq": (128, 128, 8, 2), "dkdv": (128, 64, 8, 3), "col": (128, 64, 8, 2)},
}
# fp32 inputs: twice the bytes per tile, so smaller tiles and no pipelining (fits every block size / head dim).
_CONFIG_FP32: dict[str, LaunchConfig] = {
    "fwd": (64, 64, 4, 1),
    "dq": (64, 32, 4, 1),
    "dkdv": (64, 32, 4, 1),
    "col": (32, 32, 4, 1),
}
_PASSES = tuple(_CONFIG_FP32)

BLOCK_C_MERGE = 16  # columns matched at a time when the dk/dv pass adds column gradients to a key tile's rows
# The column pass splits each chunk's query tiles over several programs (every split-th tile each), each writing its
# partial gradients to a plane of an fp32 buffer that the launcher sums in a fixed order (deterministic). Two reasons:
# - a chunk's work falls with its columns' position (the sink chunk walks every query tile), and one program per chunk
#   left a long sequence's pass waiting on the first chunks: up to COL_SPLIT splits where a program would otherwise
#   walk more than COL_SPLIT_TILES query tiles;
# - a ring step holds few columns (about 1 / W of them: one chunk a head) and few query tiles, so one program per chunk
#   is a launch of B x Hq programs, each walking every local query tile one after another while the GPU idles (a
#   fixed cost of each step's backward): splits up to COL_PROGRAMS programs in all, each walking at least
#   COL_SPLIT_MIN_TILES query tiles.
# The planes together stay within COL_BUFFER_BYTES.
COL_SPLIT = 4
COL_SPLIT_TILES = 256
COL_PROGRAMS = 512
COL_SPLIT_MIN_TILES = 8
COL_BUFFER_BYTES = 512 << 20


def column_splits(query_tiles: int, chunks: int, plane_bytes: int) -> int:
    """How many programs share each column chunk's ``query_tiles`` local query tiles: ``chunks`` column chunks in all
    (batch x query heads x chunks of a head's column list), each split's plane of partial gradients ``plane_bytes``
    (the comment above has the rule)."""
    long_pole = min(COL_SPLIT, query_tiles // COL_SPLIT_TILES)
    fill = min(-(-COL_PROGRAMS // max(chunks, 1)), query_tiles // COL_SPLIT_MIN_TILES)
    return max(1, min(max(long_pole, fill), COL_BUFFER_BYTES // max(plane_bytes, 1)))


# Per-pass overrides set by ``override_launch_config``, as (pass, config) pairs: a ContextVar so a ``with`` block
# in one thread does not leak into launches from another, immutable so no holder of a value can change it.
_OVERRIDE: ContextVar[tuple[tuple[str, LaunchConfig], ...]] = ContextVar("vertical_slash_launch_config", default=())


@contextlib.contextmanager
def override_launch_config(**passes: LaunchConfig) -> Iterator[None]:
    """Launch the named passes with these configs instead of ``_CONFIG``'s inside the ``with`` block (tuning).

    Keys are pass names: ``fwd``, ``dq``, ``dkdv``, ``col``; values are configs as in the module docstring. They
    apply to every dtype, block size and head dim launched inside the block; a launch whose block size they do not
    divide raises ``ValueError``. Nested blocks override the outer one pass by pass. Example::

        with override_launch_config(dq=(128, 64, 8, 3)):
            vertical_slash_backward(do, q, k, v, out, lse, index)
    """
    unknown = sorted(set(passes) - set(_PASSES))
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; expected some of {list(_PASSES)}")
    for name, cfg in passes.items():
        ok = isinstance(cfg, tuple) and len(cfg) == 4 and all(isinstance(x, int) and x > 0 for x in cfg)
        # tl.arange needs powers of two and tl.dot needs at least 16 rows / columns per operand.
        if not ok or any(x < 16 or x & (x - 1) for x in cfg[:2]) or cfg[2] & (cfg[2] - 1):
            raise ValueError(
                f"{name}: expected (block, inner block, num_warps, num_stages) with blocks powers of two >= 16 and "
                f"num_warps a power of two; got {cfg!r}"
            )
    token = _OVERRIDE.set(tuple({**dict(_OVERRIDE.get()), **passes}.items()))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def launch_config(dtype: torch.dtype, block_size: int, head_dim: int) -> dict[str, LaunchConfig]:
    """The launch config of every pass for inputs of this dtype, block size and head dim: ``_CONFIG`` (fp32:
    ``_CONFIG_FP32``) with the passes set by an enclosing ``override_launch_config`` replaced."""
    base = _CONFIG_FP32 if dtype == torch.float32 else _CONFIG[(block_size, head_dim)]
    override = dict(_OVERRIDE.get())
    for name, (outer, inner, _, _) in override.items():
        # Every pass walks a tile in inner sub-blocks; all but the column pass also split a tile into programs.
        column_pass = name == "col"
        if block_size % inner or (not column_pass and block_size % outer):
            what = "the inner block" if column_pass else "both blocks"
            raise ValueError(
                f"override_launch_config {name}={override[name]}: {what} must divide the block size {block_size}"
            )
    return {**base, **override}
