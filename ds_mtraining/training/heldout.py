"""The held-out loss of a training run: the mean token loss of a fixed set of rows under the current weights.

Every data-parallel group evaluates all the rows, so that every rank runs the same forwards: ZeRO-3 gathers each
layer's parameters over the whole world in every forward, and a rank skipping one would hang the others. Within a
sequence-parallel group the ranks' loss parts sum to each row's mean (``integration.batch``), as in training. The
forwards run under ``torch.no_grad`` with the training attention (sparse layers estimate their index as in
training), so the number is what the model in training does, not a dense evaluation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..integration.batch import make_batch
from ..integration.loss import forward_loss

if TYPE_CHECKING:
    from ..parallel.layout import Layout
    from ..parallel.mesh import Mesh
    from ..integration.transformers import MTrainingAttention

__all__ = ["heldout_loss"]


@torch.no_grad()
def heldout_loss(
    engine,
    rows: torch.Tensor,
    attention: MTrainingAttention,
    mesh: Mesh,
    layout: Layout | None,
    pad_id: int,
    documents: torch.Tensor | None = None,
) -> float:
    """Mean token loss of ``rows`` (LongTensor ``[M, N]``, the same on every rank), one row per forward; a
    collective over the world (every rank must call it with the same rows).

    Args:
        engine: the DeepSpeed engine in training (its weights now).
        attention: the training attention handle (its ``stats`` are overwritten by these forwards).
        mesh, layout: as for the training batches.
        pad_id: the token that pads a sequence-parallel layout.
        documents: integer ``[M, N]``, the rows' per-token document ids when training masks documents
            (``integration.batch.make_batch``), else ``None``.
    """
    total = torch.zeros((), dtype=torch.float64)
    for i, row in enumerate(rows):
        docs = None if documents is None else documents[i : i + 1]
        batch = make_batch(row[None], mesh=mesh, layout=layout, pad_id=pad_id, documents=docs)
        total += forward_loss(engine, batch, attention).double().cpu()
    reduced = total.to(engine.device)  # NCCL reduces device tensors only
    dist.all_reduce(reduced)  # SP parts sum to each row's mean; every DP group adds the same rows
    return float(reduced.cpu()) / (mesh.shape.dp * rows.shape[0])
