"""Whether the estimator's budgets fit the run: which cap bound each layer's index, and a loud recall warning.

The ``"spread"`` estimator adds key columns and block offsets until its observation rows keep ``recall`` of their
attention mass, but never more than ``max_columns`` columns (sinks not counted) or ``max_offsets`` offsets (beyond
the ``local_blocks`` forced ones); the tail repair then adds at most ``tail_columns`` columns (all
``sparse_attention.estimator`` settings, ``config.SpreadEstimator``). When a
cap binds, the recall ends wherever the cap left it (0.026 against 0.98 on a real run at 128K) and nothing said
so. Here:

- :func:`capped_heads`: per layer and forward, the share of (batch, head) pairs whose index reached each cap, read
  from the index alone (device tensors, no host synchronisation; ``integration.transformers.LayerStats`` keeps them
  next to the density and the observed recall, and the training loop reduces them over the ranks like those);
- :class:`RecallWatch`: from each step's reduced per-layer values, one warning line per layer and run when the
  layer's observed recall ends well below its target (:data:`RECALL_MARGIN`) *and* a cap bound, naming the cap and
  the fix;
- :func:`sparse_mean` and :func:`layer_table`: the progress line's and the summary's density and recall over the
  sparse layers only (a dense layer's 1.0 / 1.0 says nothing about the budgets).

What the index tells about the caps (spread estimator, module docstring of ``estimator.spread``):

- offsets: only the greedy adds them, at most ``max_offsets`` beyond the forced ones, so "``max_offsets`` reached"
  is exact;
- columns: the index's columns beyond the sinks are the greedy's plus the tail's, disjoint (the tail adds only keys
  outside the index), at most ``max_columns`` and ``tail_columns``. "``max_columns`` reached" is read as
  ``count >= max_columns``: exact without a tail; with the tail on it can also be a greedy that stopped up to
  ``tail_columns`` short, topped up by the tail — the index cannot tell them apart. Where the recall ended
  well below the target that hardly happens: the greedy stops short of its target only at a cap, at
  ``min_ratio``, with no candidate left that gains mass, or at the end of its rounds (``greedy.rounds``).
  "``tail_columns`` reached" is read as ``count >= max_columns + tail_columns``, which is exact but means both column caps bound (the tail's
  cap binding alone is not visible in the index).

The baseline estimator's ``max_columns`` counts columns too (flagged the same way); its ``max_diagonals`` counts token
diagonals, which the block offsets do not reveal (never flagged), and its recall targets are per family, not the
observed recall's, so :class:`RecallWatch` judges spread layers only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..config import SpreadEstimator

if TYPE_CHECKING:
    from rich.table import Table

    from ..config import SparseAttentionConfig
    from ..sparse import VerticalSlashIndex

__all__ = ["CAPS", "RECALL_MARGIN", "RecallWatch", "capped_heads", "layer_table", "sparse_layers", "sparse_mean"]

CAPS: dict[str, str] = {
    "capped_columns": "max_columns",
    "capped_offsets": "max_offsets",
    "capped_tail": "tail_columns",
}
"""``LayerStats`` field (and per-layer metrics key) -> the ``sparse_attention.estimator`` setting whose cap it
reports."""

RECALL_MARGIN = 0.05
"""How far below its target a layer's observed recall must end to be "well below" it. Without a binding cap the
greedy stops on the same rows' forecast mass, and the exact recall of those rows lands at the target or just past it
(random q/k at 1-2K tokens: +0.002 to +0.02 per head). A cap that barely binds costs a few hundredths (0.94-0.96 for
0.98 at 2K with caps of 1024) and is not worth a warning on every run; 0.05 below 0.98 leaves 3.5x the mass out
that the target allows, and the perplexity cost grows with it (0.98 keeps SmolLM2-135M within ~1.2 % of dense,
0.90 costs ~11 %, ``config.SpreadEstimator.recall``)."""


def capped_heads(index: VerticalSlashIndex, config: SparseAttentionConfig) -> dict[str, torch.Tensor]:
    """Share of the index's (batch, head) pairs that reached each cap (module docstring): :data:`CAPS`' keys ->
    float32 scalars on the index's device, in [0, 1]. Device ops only: nothing synchronises with the host.

    Args:
        index: the layer's estimated index, ``vertical`` / ``slash`` LongTensors ``[B, H, ·]`` padded with -1.
        config: the layer's settings (``for_layer`` applied), ``pattern="vertical_slash"``.
    """
    # Sinks are positions 0 .. sink_tokens-1 and always in the index; they never count against max_columns.
    columns = (index.vertical >= config.sink_tokens).sum(-1)  # [B, H]
    estimator = config.estimator
    spread = isinstance(estimator, SpreadEstimator)
    if spread and estimator.tail_rows > 0 and estimator.tail_columns > 0:
        tail = columns >= estimator.max_columns + estimator.tail_columns
    else:
        tail = torch.zeros_like(columns, dtype=torch.bool)
    if spread:
        # max_offsets counts the offsets beyond the forced 0 .. local_blocks-1; those are counted where present (a
        # sequence shorter than local_blocks blocks has fewer), so the sequence length is not needed.
        forced = (index.slash >= 0) & (index.slash < max(config.local_blocks, 1))
        offsets = ((index.slash >= 0).sum(-1) - forced.sum(-1)) >= estimator.max_offsets
    else:  # the baseline's max_diagonals counts token diagonals, which the offsets do not reveal
        offsets = torch.zeros_like(columns, dtype=torch.bool)
    return {
        "capped_columns": (columns >= estimator.max_columns).float().mean(),
        "capped_offsets": offsets.float().mean(),
        "capped_tail": tail.float().mean(),
    }


def sparse_layers(sparse: SparseAttentionConfig, num_layers: int) -> list[int]:
    """The layers in ``0 .. num_layers-1`` that run sparse attention (``pattern="vertical_slash"``)."""
    return [layer for layer in range(num_layers) if sparse.for_layer(layer).pattern == "vertical_slash"]


def sparse_mean(values: Sequence[float], sparse: SparseAttentionConfig) -> float:
    """Mean of the per-layer ``values`` (``values[i]`` is layer ``i``'s) over the sparse layers; over all layers
    when none is sparse (a dense run then shows its 1.0)."""
    if not values:
        raise ValueError("sparse_mean needs one value per layer; got none")
    layers = sparse_layers(sparse, len(values)) or range(len(values))
    return sum(values[layer] for layer in layers) / len(layers)


def _share(share: float) -> str:
    """A share of heads as a percentage; a nonzero one never shows as 0 %."""
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"


class RecallWatch:
    """Turns each step's reduced per-layer values into the recall warnings to print, at most one per layer and run.

    A spread layer warns when its observed recall ends below ``recall - margin`` and at least one of its heads
    reached a cap (:func:`capped_heads`); a recall short of the target for another reason (``min_ratio``,
    a forecast that fell short) is not this warning, and dense and baseline layers are never judged.

    Args:
        sparse: the ``sparse_attention`` settings of the run (per-layer overrides applied here).
        margin: :data:`RECALL_MARGIN` unless told.
    """

    def __init__(self, sparse: SparseAttentionConfig, *, margin: float = RECALL_MARGIN):
        if not 0 <= margin < 1:
            raise ValueError(f"RecallWatch: margin must be in [0, 1); got {margin}")
        self.sparse = sparse
        self.margin = margin
        self.warned: set[int] = set()

    def check(self, record: Mapping[str, Any]) -> list[str]:
        """The new warnings for one step: one line per layer that warns now for the first time in the run.

        Args:
            record: the step's per-layer values, each a sequence indexed by layer (``record[key][i]`` is layer
                ``i``'s), reduced over the ranks: ``"recall"`` and the :data:`CAPS` keys (shares of heads).
        """
        lines = []
        for layer, recall in enumerate(record["recall"]):
            if layer in self.warned:
                continue
            config = self.sparse.for_layer(layer)
            if config.pattern != "vertical_slash" or not isinstance(config.estimator, SpreadEstimator):
                continue
            if not recall < config.estimator.recall - self.margin:  # `not <`: a NaN recall is not judged
                continue
            bound = {CAPS[key]: float(record[key][layer]) for key in CAPS if float(record[key][layer]) > 0}
            if bound:
                self.warned.add(layer)
                lines.append(self._message(layer, float(recall), config, bound))
        return lines

    def _message(self, layer: int, recall: float, config: SparseAttentionConfig, bound: dict[str, float]) -> str:
        """The warning line: the layer, recall vs target, the caps that bound (share of heads), the fix."""
        estimator = config.estimator
        reached = ", ".join(
            f"{name}={getattr(estimator, name)} ({_share(share)} of heads)" for name, share in bound.items()
        )
        # Doubling is a step that visibly moves the recall without guessing the need; at least 1 for a cap of 0.
        raised = ", ".join(f'"{name}": {max(2 * getattr(estimator, name), 1)}' for name in bound)
        raised = f'"estimator": {{"strategy": "spread", {raised}}}'
        them = "them" if len(bound) > 1 else "it"
        owner = next((i for i, o in enumerate(self.sparse.overrides) if layer in o.layers), None)
        if owner is None:
            fix = (
                f'raise {them} in "mtraining.sparse_attention.estimator" of the DeepSpeed JSON, or for this layer '
                f'only: "overrides": [{{"layers": [{layer}], {raised}}}]'
            )
        else:  # a layer lives in one override only: the fix goes into the one it is in
            layers = list(self.sparse.overrides[owner].layers)
            fix = f'raise {them} in "mtraining.sparse_attention.overrides[{owner}]" (layers {layers}): {raised}'
        return (
            f"warning: layer {layer}: observed recall {recall:.3f} < recall target {estimator.recall:g} with "
            f"{reached} reached; {fix}"
        )


def layer_table(
    record: Mapping[str, Any], sparse: SparseAttentionConfig, *, title: str = "attention per layer"
) -> Table:
    """A rich table of one step's per-layer density, observed recall, target and caps reached (the summary's).

    Args:
        record: per-layer sequences indexed by layer, reduced over the ranks: ``"density"``, ``"recall"`` and,
            when present, the :data:`CAPS` keys.
        sparse: the run's ``sparse_attention`` settings (the attention and target columns).
    """
    from rich.table import Table

    table = Table(title=title)
    for name in ("layer", "attention", "density", "recall", "target", "caps reached (share of heads)"):
        table.add_column(name, justify="left" if name in ("attention", "caps reached (share of heads)") else "right")
    for layer, (density, recall) in enumerate(zip(record["density"], record["recall"], strict=True)):
        config = sparse.for_layer(layer)
        if config.pattern == "dense":
            table.add_row(str(layer), "dense", f"{density:.3f}", f"{recall:.3f}", "-", "-")
            continue
        estimator = config.estimator
        target = f"{estimator.recall:g}" if isinstance(estimator, SpreadEstimator) else "-"
        caps = [
            f"{name}={getattr(estimator, name)} {_share(float(record[key][layer]))}"
            for key, name in CAPS.items()
            if key in record and float(record[key][layer]) > 0 and hasattr(estimator, name)
        ]
        table.add_row(str(layer), estimator.strategy, f"{density:.3f}", f"{recall:.3f}", target, ", ".join(caps) or "-")
    return table
