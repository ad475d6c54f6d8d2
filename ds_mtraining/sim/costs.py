"""What one ring step costs on one GPU: the measured cost model the cluster simulator prices compute with.

``benchmarks/ring_steps.py`` runs every (rank, step) pair of a ring through the ring's own step kernels on one GPU and
fits, per direction, ``ms = fixed + per_tile · tiles + per_chunk · column chunks`` (tiles: one query head's
``bs × bs`` tile, ``RingWork.tiles``; column chunks: the chunks of columns a step's kernels walk before its query
tiles, the shard in hand's, ``parallel.work.walked_columns``). Its ``--fit`` JSON loads here (:meth:`KernelCosts.from_fit`); :data:`CALIBRATED` is
the committed calibration.

A negative fitted coefficient is clamped to 0: the model never prices work below free. Other head dims scale the per-tile terms by ``D / D₀`` (a
tile's matrix work is linear in ``D``); other block sizes are refused (the kernels' per-tile efficiency differs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["CALIBRATED", "KernelCosts", "StepCost"]


@dataclass(frozen=True)
class StepCost:
    """One direction's cost of a ring step, milliseconds: ``fixed_ms + per_tile_ms · tiles + per_chunk_ms ·
    column chunks`` (coefficients clamped to >= 0)."""

    fixed_ms: float
    per_tile_ms: float
    per_chunk_ms: float

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_tile_ms", "per_chunk_ms"):
            object.__setattr__(self, name, max(0.0, float(getattr(self, name))))

    def __call__(self, tiles: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """ms of each step: float64 like ``tiles`` (``[W, S]`` slash tiles of a ring's steps; ``chunks`` the column
        chunks each step walks, e.g. ``walked_columns(...)`` gathered on the ring's schedule)."""
        return self.fixed_ms + self.per_tile_ms * tiles + self.per_chunk_ms * chunks


@dataclass(frozen=True)
class KernelCosts:
    """The forward and backward step costs of the ring's kernels on one GPU model, and what they were measured on.

    Attributes:
        forward / backward: the fitted :class:`StepCost` of each direction.
        block_size: the tile size the tiles were counted in.
        head_dim: the head dim measured (per-tile terms scale with it, :meth:`for_head_dim`).
        source: where the numbers come from (GPU, result file).
    """

    forward: StepCost
    backward: StepCost
    block_size: int
    head_dim: int
    source: str

    @classmethod
    def from_fit(cls, path: Path | str, *, block_size: int = 64, head_dim: int = 128) -> KernelCosts:
        """The model ``benchmarks.ring_steps --fit PATH`` wrote (its ``model`` entry)."""
        model = json.loads(Path(path).read_text())["model"]

        def cost(d: dict[str, float]) -> StepCost:
            return StepCost(d["fixed_ms"], d["per_tile_ms"], d["per_column_chunk_ms"])

        return cls(cost(model["forward"]), cost(model["backward"]), block_size, head_dim, str(path))

    def for_head_dim(self, head_dim: int) -> KernelCosts:
        """These costs for heads of ``head_dim`` (per-tile terms scaled by ``head_dim / self.head_dim``)."""
        ratio = head_dim / self.head_dim

        def scaled(c: StepCost) -> StepCost:
            return StepCost(c.fixed_ms, c.per_tile_ms * ratio, c.per_chunk_ms * ratio)

        return replace(self, forward=scaled(self.forward), backward=scaled(self.backward), head_dim=head_dim)

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.block_size:
            raise ValueError(
                f"the kernel costs were measured at block size {self.block_size}, the pattern uses {block_size}: "
                f"simulate at block {self.block_size}, or calibrate with benchmarks.ring_steps at {block_size}"
            )


CALIBRATED = KernelCosts(
    forward=StepCost(0.06153, 0.009558e-3, 0.017532e-3),
    backward=StepCost(0.23259, 0.024114e-3, 0.033996e-3),
    block_size=64,
    head_dim=128,
    source=(
        "one H100, benchmarks/results/2026-12-05-h100-ring_steps.md (2,240 pairs: W = 8 at 128K-512K, W = 32 at "
        "256K-512K, planted 5 %; every pair within 3.2 % forward, 9.5 % backward)"
    ),
)
"""The committed calibration: the ring-step fit of the 3B shape's heads (16 query / 2 KV, D 128, bf16, block 64)."""
