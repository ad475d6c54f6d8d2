"""A deterministic, resumable sampler over packed rows, sharded over data-parallel ranks.

Epoch ``e`` visits the rows in the order ``randperm(num_rows, generator=seed + e)`` (or ``0..M-1`` without
shuffling); rank ``r`` of ``world`` takes positions ``r, r + world, ...`` of it (the tail that does not
divide evenly is dropped, so every rank sees the same number of rows per epoch). The state is just
``(epoch, position)``: :meth:`ResumableSampler.state_dict` goes into the checkpoint and
:meth:`ResumableSampler.load_state_dict` makes a new sampler continue with exactly the rows the
uninterrupted run would have seen next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """Row indices for one data-parallel rank, epoch after epoch, resumable mid-epoch.

    Args:
        num_rows: rows in the dataset.
        seed: the shuffle of epoch ``e`` is seeded with ``seed + e``.
        shuffle: ``False`` visits rows in order.
        rank, world_size: this rank's share of each epoch.
    """

    def __init__(self, num_rows: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size; got rank={rank}, world_size={world_size}")
        if num_rows < world_size:
            raise ValueError(f"num_rows={num_rows} is smaller than world_size={world_size}: some rank gets no data")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.position = 0  # rows of the current epoch this rank has already handed out

    def __len__(self) -> int:
        """Rows per epoch for this rank."""
        return self.num_rows // self.world_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's rows of ``epoch``: int64 ``[len(self)]``."""
        if self.shuffle:
            order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_rows)
        return order[: len(self) * self.world_size][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        """Endless: continues from the current state, advancing it as rows are handed out."""
        while True:
            order = self.epoch_order(self.epoch)
            while self.position < len(order):
                row = int(order[self.position])
                self.position += 1
                yield row
            self.epoch += 1
            self.position = 0

    def take(self, count: int) -> list[int]:
        """The next ``count`` rows (advances the state)."""
        it = iter(self)
        return [next(it) for _ in range(count)]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume exactly."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.num_rows,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the dataset, seed, shuffling and world size must be the ones it was saved with."""
        for key in ("seed", "shuffle", "num_rows", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "resume with the same dataset and settings"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
