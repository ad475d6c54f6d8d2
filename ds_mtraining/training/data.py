"""The run's rows: what is trained on (synthetic copies, the bundled corpus, or prepared packed rows), the
held-out rows, and the sampler's position in them (:class:`Cursor`, saved with every checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import SyntheticCopyData
from ..data.corpus import TRAIN_SOURCES
from ..data.rows import PackedRows
from ..integration.model_loading import ModelSpec
from .settings import TrainSettings, UsageError

__all__ = ["Cursor", "TrainData", "build_data", "build_heldout", "describe_data"]

TrainData = SyntheticCopyData | PackedRows
"""Training samples: ``.batch(ids)`` (integer ``[len(ids), seqlen]``), ``.pad_id``; packed rows also
``.documents(ids)``."""


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
