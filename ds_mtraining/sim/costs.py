"""What one ring step costs on one GPU: the measured cost model the cluster simulator prices compute with.

``benchmarks/ring_steps.py`` runs every (rank, step) pair of a ring through the ring's own step kernels on one GPU and
fits, per direction, ``ms = fixed + per_tile · tiles + per_chunk · column chunks + per_offset · offsets walked +
per_program · query-tile programs`` (:class:`StepTerms`: tiles are one query head's ``bs × bs`` tiles attended,
``RingWork.tiles``; column chunks the chunks of the shard in hand's columns a step's kernels walk before its query
tiles, ``parallel.work.walked_columns``; offsets the chosen slash offsets they visit, ``parallel.work.walked_offsets``;
programs the launch's query tiles). Its ``--fit`` JSON loads here (:meth:`KernelCosts.from_fit`); :data:`CALIBRATED`
is the committed calibration.

A negative fitted coefficient is clamped to 0: the model never prices work below free. Other head dims scale the
per-tile and per-chunk terms by ``D / D₀`` (their loads and products are linear in ``D``); other block sizes are
refused (the kernels' per-tile efficiency differs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["CALIBRATED", "KernelCosts", "StepCost", "StepTerms"]


@dataclass(frozen=True)
class StepTerms:
    """What each ring step's kernels do: the cost model's inputs, float64 tensors (or numbers) broadcastable to the
    ``[W, S]`` (rank, step) of a ring.

    Attributes:
        tiles: slash tiles attended (``RingWork.tiles``).
        chunks: column chunks walked (``parallel.work.walked_columns`` on the schedule).
        offsets: slash offsets walked: every chosen offset up to each query tile that can reach the shard in hand
            is visited, its key tile loaded only where the shard holds it (``parallel.work.walked_offsets`` on the
            schedule).
        programs: query-tile programs the launch runs (batch x query heads x local tiles).
        runs: 1 where the step launches its kernels, 0 where it has no causal work and is skipped.
    """

    tiles: torch.Tensor | float
    chunks: torch.Tensor | float = 0.0
    offsets: torch.Tensor | float = 0.0
    programs: torch.Tensor | float = 0.0
    runs: torch.Tensor | float = 1.0


@dataclass(frozen=True)
class StepCost:
    """One direction's cost of a ring step that runs, milliseconds: ``fixed_ms + per_tile_ms · tiles + per_chunk_ms ·
    column chunks + per_offset_ms · slash offsets walked + per_program_ms · query-tile programs`` (coefficients clamped
    to >= 0); a step that does not run costs nothing."""

    fixed_ms: float
    per_tile_ms: float
    per_chunk_ms: float = 0.0
    per_offset_ms: float = 0.0
    per_program_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_tile_ms", "per_chunk_ms", "per_offset_ms", "per_program_ms"):
            object.__setattr__(self, name, max(0.0, float(getattr(self, name))))

    def __call__(self, terms: StepTerms) -> torch.Tensor:
        """ms of each step: float64 ``[W, S]`` like ``terms.tiles``."""
        ms = (
            self.fixed_ms
            + self.per_tile_ms * terms.tiles
            + self.per_chunk_ms * terms.chunks
            + self.per_offset_ms * terms.offsets
            + self.per_program_ms * terms.programs
        )
        return torch.as_tensor(ms * terms.runs, dtype=torch.float64)


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
            return StepCost(
                d["fixed_ms"], d["per_tile_ms"], d["per_column_chunk_ms"], d.get("per_offset_ms", 0.0),
                d.get("per_program_ms", 0.0),
            )  # fmt: skip

        return cls(cost(model["forward"]), cost(model["backward"]), block_size, head_dim, str(path))

    def for_head_dim(self, head_dim: int) -> KernelCosts:
        """These costs for heads of ``head_dim`` (per-tile terms scaled by ``head_dim / self.head_dim``)."""
        ratio = head_dim / self.head_dim

        def scaled(c: StepCost) -> StepCost:
            return replace(c, per_tile_ms=c.per_tile_ms * ratio, per_chunk_ms=c.per_chunk_ms * ratio)

        return replace(self, forward=scaled(self.forward), backward=scaled(self.backward), head_dim=head_dim)

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.block_size:
            raise ValueError(
                f"the kernel costs were measured at block size {self.block_size}, the pattern uses {block_size}: "
                f"simulate at block {self.block_size}, or calibrate with benchmarks.ring_steps at {block_size}"
            )


CALIBRATED = KernelCosts(
    forward=StepCost(0.0209069, 6.64751e-06, 2.43220e-06, 0, 3.24048e-05),
    backward=StepCost(0.0276020, 1.21434e-05, 3.83129e-05, 0, 6.71581e-05),
    block_size=64,
    head_dim=128,
    source=(
        "one H100. Forward: benchmarks/results/2026-12-07-h100-ring_overhead_and_calibration.md (186 pairs on "
        "sampled ranks: W = 8 and 32 at 256K, the ring and all-gathered groups of 8 and 32, and the whole K/V of "
        "W = 1024 at 4M, planted 5 %; per-shape error within 4 %); the column splits left the forward as it was (a "
        "refit on their steps moved no term by more than 5 %). Backward: benchmarks/results/"
        "2026-12-07-h100-ring_column_splits.md, the same 256K shapes on the column pass that splits its query tiles "
        "(92 pairs, per-shape error within 2.4 % on the sums; 1M and 4M extrapolated, not measured on these kernels)"
    ),
)
"""The committed calibration: the ring-step fit of the 3B shape's heads (16 query / 2 KV, D 128, bf16, block 64)."""
