"""The run's rows: what is trained on (synthetic copies, the bundled corpus, prepared packed rows, or the caller's
own micro-batches), the held-out rows, and the sampler's position in them (:class:`Cursor`, saved with every
checkpoint).

Both sources reach the step the same way: an iterator of :data:`Rows` (:func:`plan_rows` over the plan's data,
:func:`caller_rows` over the caller's iterable), each micro-batch checked by :func:`check_rows`, then laid out for
this rank by ``integration.batch.make_batch``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import torch

from ..data import SyntheticCopyData
from ..data.corpus import TRAIN_SOURCES
from ..data.rows import PackedRows
from ..integration.model_loading import ModelSpec
from .settings import TrainSettings, UsageError

__all__ = [
    "Batches",
    "Cursor",
    "Rows",
    "TrainData",
    "build_data",
    "build_heldout",
    "caller_rows",
    "check_rows",
    "describe_data",
    "plan_rows",
]

TrainData = SyntheticCopyData | PackedRows
"""Training samples: ``.batch(ids)`` (integer ``[len(ids), seqlen]``), ``.pad_id``; packed rows also
``.documents(ids)``."""

Rows: TypeAlias = tuple[torch.Tensor, torch.Tensor | None]
"""One micro-batch of this rank's whole sequences: token ids, integer ``[B, N]``, and each token's document id
(integer ``[B, N]``) or ``None`` (each row one sequence)."""

Batches: TypeAlias = Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
"""The caller's micro-batches, one item per micro-batch of this rank: token ids (integer ``[B, N]``, ``B`` =
``train_micro_batch_size_per_gpu``, ``N`` = the run's sequence length) or ``(token ids, document ids)``."""


def build_data(settings: TrainSettings, spec: ModelSpec) -> TrainData:
    """Synthetic copies for a model without a tokenizer, else packed real text (``settings.data`` or the bundled
    corpus tokenized by the model's tokenizer), its token ids checked against the model's vocabulary."""
    if spec.tokenizer_dir is None:
        return SyntheticCopyData(settings.seqlen, vocab_size=spec.config.vocab_size, seed=settings.seed)
    from transformers import AutoTokenizer

    from ..data.corpus import default_corpus
    from ..data.packing import check_token_ids, load_packed, pack_documents
    from ..data.tokenize import separator_id, tokenize_documents

    if settings.data:
        packed = load_packed(settings.data)  # metadata, dtypes and shapes checked
        if packed.seqlen != settings.seqlen:
            raise UsageError(
                f"--data {settings.data} holds rows of {packed.seqlen} tokens; pass --seqlen {packed.seqlen}"
            )
        where = str(settings.data)
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
        documents = tokenize_documents(tokenizer, default_corpus(TRAIN_SOURCES))
        packed = pack_documents(documents, settings.seqlen, separator_id(tokenizer))
        where = f"the bundled corpus tokenized by {spec.name}"  # a tokenizer may know more ids than the model embeds
    check_token_ids(packed, spec.config.vocab_size, spec.name, where)  # here, not as a device-side assert mid-step
    return PackedRows(packed, seed=settings.seed)


def build_heldout(settings: TrainSettings, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first ``heldout_rows`` rows of ``settings.heldout`` and their document ids: LongTensors
    ``[M, seqlen]``, checked like the training rows; ``None`` without held-out rows."""
    if not settings.heldout:
        return None
    from ..data.packing import check_token_ids, load_packed

    packed = load_packed(settings.heldout)
    if packed.seqlen != settings.seqlen:
        raise UsageError(
            f"--heldout {settings.heldout} holds rows of {packed.seqlen} tokens; --seqlen is {settings.seqlen}"
        )
    if len(packed) < settings.heldout_rows:
        raise UsageError(
            f"--heldout {settings.heldout} holds {len(packed)} rows; pass --heldout-rows {len(packed)} or fewer"
        )
    check_token_ids(packed, spec.config.vocab_size, spec.name, str(settings.heldout))
    rows = settings.heldout_rows
    return packed.tokens[:rows].long().clone(), packed.documents[:rows].long().clone()


def describe_data(settings: TrainSettings, spec: ModelSpec) -> str:
    """What the run trains on, in a few words (the banner's data line)."""
    if spec.tokenizer_dir is None:
        return "synthetic long-range copies"
    if settings.data:
        return f"packed rows from {settings.data}"
    return f"bundled corpus ({', '.join(TRAIN_SOURCES)}) packed with the {spec.name} tokenizer"


@dataclass
class Cursor:
    """The data sampler's state: the next micro-batch (global over data-parallel ranks) to read."""

    next_micro: int = 0

    def indices(self, micro_batch: int, dp: int, dp_index: int) -> list[int]:
        """Sample ids of this rank's next micro-batch (each DP rank its own, every SP rank of a group the same)."""
        first = (self.next_micro * dp + dp_index) * micro_batch
        self.next_micro += 1
        return list(range(first, first + micro_batch))


def plan_rows(data: Callable[[], TrainData], cursor: Cursor, *, micro_batch: int, dp: int, dp_index: int,
              documents: bool) -> Iterator[Rows]:  # fmt: skip
    """This rank's micro-batches of the plan's data from ``cursor`` on (advanced as each is drawn), with their
    document ids when ``documents``. ``data()`` is read at each draw: a Trainer's plan may be replaced between
    micro-batches (``benchmarks.train_throughput`` runs one engine at several lengths)."""
    while True:
        ids = cursor.indices(micro_batch, dp, dp_index)
        rows = data()
        yield rows.batch(ids), rows.documents(ids) if documents else None


def caller_rows(batches: Batches, cursor: Cursor) -> Iterator[Rows]:
    """The caller's micro-batches as :data:`Rows`, counted by ``cursor`` as the plan's are. A resumed run's cursor
    is past the micro-batches its checkpoint trained on: that many items are skipped, so that an iterable that
    starts over from its beginning continues where the checkpoint left off."""
    items = itertools.islice(batches, cursor.next_micro, None)
    for item in items:
        cursor.next_micro += 1
        yield (item, None) if isinstance(item, torch.Tensor) else item


def check_rows(rows: object, *, where: str, micro_batch: int, seqlen: int, vocab_size: int,
               documents: bool) -> Rows:  # fmt: skip
    """``rows`` (a :data:`Rows`, or what a caller passed for one) if it is one micro-batch this run can train on,
    else ``UsageError`` in one line naming ``where`` (e.g. ``"batch 3"``), what it got and what it needs: integer
    token ids ``[micro_batch, seqlen]`` within the model's vocabulary, and document ids of the same shape exactly
    when ``documents`` (``mtraining.data.document_masking``)."""
    need = f"integer token ids [{micro_batch}, {seqlen}] (train_micro_batch_size_per_gpu x sequence length)"
    if not (isinstance(rows, tuple | list) and len(rows) == 2 and isinstance(rows[0], torch.Tensor)):
        raise UsageError(f"{where} is a {type(rows).__name__}; each batch must be {need}, or (those, document ids)")
    tokens, ids = rows
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise UsageError(f"{where}: token ids of dtype {tokens.dtype}; each batch must be {need}")
    if tuple(tokens.shape) != (micro_batch, seqlen):
        raise UsageError(f"{where}: token ids of shape {list(tokens.shape)}; each batch must be {need}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise UsageError(f"{where}: token ids {low}..{high} outside the model's vocabulary 0..{vocab_size - 1}")
    if documents and ids is None:
        raise UsageError(
            f"{where} has no document ids, but mtraining.data.document_masking is true; pass (token ids, document "
            "ids) or set it false"
        )
    if not documents and ids is not None:
        raise UsageError(
            f"{where} has document ids, but mtraining.data.document_masking is false, which trains each row as one "
            "sequence; set it true to keep the documents apart, or pass the token ids alone"
        )
    if ids is not None and (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != tuple(tokens.shape)):
        got = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise UsageError(f"{where}: document ids {got}; they must be integer [{micro_batch}, {seqlen}], one a token")
    return tokens, ids
