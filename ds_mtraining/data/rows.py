"""Packed rows as a training dataset addressed by sample id: epoch-wise shuffled, so a position resumes exactly.

Sample ``i`` is row ``perm_e[i mod M]`` of epoch ``e = i // M``, with ``perm_e = randperm(M)`` seeded by
``seed + e``: like :class:`~ds_mtraining.data.synthetic.SyntheticCopyData`, the data depends only on the sample
id, so the training loop's cursor (the next sample id, saved in every checkpoint) is the whole sampler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .packing import PackedDataError, PackedSequences

__all__ = ["PackedRows"]


@dataclass
class PackedRows:
    """Training samples from :class:`PackedSequences` rows (``pad_id`` = the separator: rows are full).

    Attributes:
        packed: the rows, ``[M, seqlen]``.
        seed: the shuffle of epoch ``e`` is seeded with ``seed + e``.
    """

    packed: PackedSequences
    seed: int = 0
    _orders: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.packed) == 0 or self.packed.seqlen == 0:
            raise PackedDataError(
                f"packed rows of shape {list(self.packed.tokens.shape)} hold no sample; pack more text or a "
                "smaller seqlen"
            )

    @property
    def seqlen(self) -> int:
        return self.packed.seqlen

    @property
    def pad_id(self) -> int:
        return self.packed.separator

    def row(self, i: int) -> int:
        """The row sample ``i`` reads."""
        epoch, at = divmod(i, len(self.packed))
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.packed), generator=gen)}  # one epoch cached
        return int(self._orders[epoch][at])

    def batch(self, indices: list[int]) -> torch.Tensor:
        """Samples ``indices`` stacked: LongTensor ``[len(indices), seqlen]``."""
        return self.packed.tokens[[self.row(i) for i in indices]]

    def documents(self, indices: list[int]) -> torch.Tensor:
        """The document id of each token of :meth:`batch`'s samples: integer ``[len(indices), seqlen]``."""
        return self.packed.documents[[self.row(i) for i in indices]]
