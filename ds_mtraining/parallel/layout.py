"""Token layouts for context parallelism: which global positions each ring rank holds.

A layout is a permutation of the (padded) global token order, applied once where tokens enter (input ids,
labels, position ids) and undone only where a user sees tokens. Rank ``r`` holds the ``r``-th contiguous
slice of the permuted order. Every layout keeps whole ``block_size`` tiles together, so a local tile is one
global block and the sparse kernels run unchanged on a shard:

- ``contiguous``: rank r holds chunk r of W equal chunks.
- ``zigzag``: 2W chunks; rank r holds chunks r and 2W-1-r (balances dense causal work).
- ``striped``: global stripe j (``stripe`` tokens, a multiple of the block size) goes to rank j mod W, so
  every slash offset falls on every rank equally (balances sparse work).

Sequences are padded at the end to a length the layout splits evenly (``Layout.padded_len``). Padding is
safe for causal attention: a padded position is after every real query, so no real query attends it, and
its own outputs are dropped when the layout is undone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

LayoutKind = Literal["contiguous", "zigzag", "striped"]


@dataclass(frozen=True)
class Layout:
    """A layout of ``seqlen`` tokens over ``world`` ring ranks, padded to ``padded_len``.

    Attributes:
        kind: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
        world: ring ranks.
        seqlen: real tokens.
        padded_len: tokens after padding; ``padded_len / world`` per rank.
        unit: tokens in one indivisible piece (chunk, or stripe), a multiple of ``block_size``.
        block_size: the sparse tile size the layout keeps whole.
        order: LongTensor ``[padded_len]``, global position of each token in layout order; rank ``r`` holds
            ``order[r * local_len : (r + 1) * local_len]``.
    """

    kind: LayoutKind
    world: int
    seqlen: int
    padded_len: int
    unit: int
    block_size: int
    order: torch.Tensor
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions held by ``rank``, in local order: LongTensor ``[local_len]``."""
        return self.order[rank * self.local_len : (rank + 1) * self.local_len]

    def positions_on(self, rank: int, device: torch.device) -> torch.Tensor:
        """:meth:`positions` on ``device``: copied once per (rank, device), then shared (read-only). A host-to-device
        copy synchronises the host with the GPU, and the ring needs these in every layer's forward."""
        return self._copy("positions", rank, device)

    def block_ids_on(self, rank: int, device: torch.device) -> torch.Tensor:
        """:meth:`block_ids` on ``device``, copied once per (rank, device) like :meth:`positions_on`."""
        return self._copy("block_ids", rank, device)

    def block_owner_on(self, device: torch.device) -> torch.Tensor:
        """:meth:`block_owner` on ``device``, copied once per device like :meth:`positions_on`."""
        key = ("block_owner", None, torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = self.block_owner().to(device)
        return self._on_device[key]

    def _copy(self, what: str, rank: int, device: torch.device) -> torch.Tensor:
        key = (what, rank, torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = getattr(self, what)(rank).to(device)
        return self._on_device[key]

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s part of ``x`` (global order, ``seqlen`` or ``padded_len`` long along ``dim``).

        Positions past ``seqlen`` are zero-filled; pass ids/labels already padded where zero is not right.
        """
        if x.shape[dim] == self.seqlen and self.padded_len != self.seqlen:
            pad_shape = list(x.shape)
            pad_shape[dim] = self.padded_len - self.seqlen
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        if x.shape[dim] != self.padded_len:
            raise ValueError(
                f"cannot shard a tensor of {x.shape[dim]} tokens along dim {dim} with a layout of {self.seqlen} "
                f"tokens (padded to {self.padded_len})"
            )
        return x.index_select(dim, self.positions_on(rank, x.device))

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Global order from all ranks' shards (rank order), padding dropped: ``seqlen`` long along ``dim``."""
        if len(shards) != self.world:
            raise ValueError(f"unshard needs {self.world} shards, one per rank; got {len(shards)}")
        permuted = torch.cat(shards, dim=dim)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.padded_len)
        return permuted.index_select(dim, inverse[: self.seqlen].to(permuted.device))

    def block_ids(self, rank: int) -> torch.Tensor:
        """Global block of each local tile of ``rank``: LongTensor ``[local_len / block_size]``."""
        return self.positions(rank)[:: self.block_size] // self.block_size

    def block_owner(self) -> torch.Tensor:
        """Ring rank holding each global block: LongTensor ``[padded_len / block_size]`` (the inverse of
        :meth:`block_ids` over every rank)."""
        starts = torch.arange(0, self.padded_len, self.block_size)  # each local tile's first slot in layout order
        owner = torch.empty(self.padded_len // self.block_size, dtype=torch.long)
        owner[self.order[starts] // self.block_size] = starts // self.local_len
        return owner


def make_layout(kind: LayoutKind, world: int, seqlen: int, *, block_size: int, stripe: int | None = None) -> Layout:
    """The ``kind`` layout of ``seqlen`` tokens over ``world`` ranks, padded at the end to split evenly.

    Args:
        block_size: the sparse tile size; every chunk/stripe is a whole number of blocks.
        stripe: tokens per stripe of the striped layout (a multiple of ``block_size``; default ``block_size``).
    """
    if world < 1 or seqlen < 1:
        raise ValueError(f"make_layout needs world >= 1 and seqlen >= 1; got world={world}, seqlen={seqlen}")
    if kind == "striped":
        unit = block_size if stripe is None else stripe
        if unit % block_size:
            raise ValueError(f"stripe={unit} must be a multiple of block_size={block_size} so tiles stay whole")
        pieces_per_rank = -(-seqlen // (unit * world))
        pieces = pieces_per_rank * world
        # Piece j goes to rank j % W: in layout order, rank r holds pieces r, r + W, r + 2W, ...
        piece_order = torch.arange(pieces).view(pieces_per_rank, world).t().flatten()
    elif kind in ("contiguous", "zigzag"):
        chunks = world if kind == "contiguous" else 2 * world
        unit = -(-seqlen // (chunks * block_size)) * block_size
        pieces = chunks
        if kind == "contiguous":
            piece_order = torch.arange(chunks)
        else:
            piece_order = torch.stack([torch.arange(world), 2 * world - 1 - torch.arange(world)], dim=1).flatten()
    else:
        raise ValueError(f"unknown layout {kind!r}; choose one of 'contiguous', 'zigzag', 'striped'")
    order = (piece_order[:, None] * unit + torch.arange(unit)).flatten()
    return Layout(kind, world, seqlen, pieces * unit, unit, block_size, order)
