"""Pack tokenized documents into fixed-length sequences, and save / load them.

Documents are concatenated into one token stream, each followed by the separator (EOS), and the stream is
cut into rows of ``seqlen`` tokens. Nothing is padded or dropped except the tail shorter than ``seqlen``
(kept in :attr:`PackedSequences.remainder`), so ``cat(rows) + remainder`` is exactly the stream: packing
is lossless and depends only on the documents' order. Document *ids* travel with the tokens so training
can reset positions at boundaries or mask attention across documents (:func:`document_mask`); plain
causal training over the packed rows (the default, what long-context pre-training does) ignores them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["PackedSequences", "document_mask", "load_packed", "pack_documents", "position_ids", "save_packed"]


@dataclass(frozen=True)
class PackedSequences:
    """Fixed-length rows of a document stream.

    Attributes:
        tokens: int64 ``[M, seqlen]``, the stream cut into rows.
        documents: int64 ``[M, seqlen]``, index of the document each token belongs to (a document's
            separator carries its id).
        remainder: int64 ``[r]``, ``r < seqlen``, the stream's tail that did not fill a row.
        separator: the id appended after every document.
    """

    tokens: torch.Tensor
    documents: torch.Tensor
    remainder: torch.Tensor
    separator: int

    @property
    def seqlen(self) -> int:
        return self.tokens.shape[1]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def stream(self) -> torch.Tensor:
        """The whole token stream: rows then the remainder, int64 ``[M * seqlen + r]``."""
        return torch.cat([self.tokens.reshape(-1), self.remainder])


def pack_documents(documents: Sequence[Sequence[int]], seqlen: int, separator: int) -> PackedSequences:
    """Concatenate ``documents`` (token-id lists, in the order given), each followed by ``separator``, into rows.

    Raises ValueError if ``seqlen < 1`` or no row can be filled.
    """
    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1; got {seqlen}")
    lengths = np.fromiter((len(d) + 1 for d in documents), dtype=np.int64, count=len(documents))
    total = int(lengths.sum())
    stream = np.empty(total, dtype=np.int64)
    at = 0
    for doc in documents:
        stream[at : at + len(doc)] = doc
        at += len(doc)
        stream[at] = separator
        at += 1
    doc_ids = np.repeat(np.arange(len(documents), dtype=np.int64), lengths)
    rows = total // seqlen
    if rows == 0:
        raise ValueError(f"{total} tokens (separators included) do not fill one row of seqlen={seqlen}")
    cut = rows * seqlen
    return PackedSequences(
        tokens=torch.from_numpy(stream[:cut].reshape(rows, seqlen)),
        documents=torch.from_numpy(doc_ids[:cut].reshape(rows, seqlen)),
        remainder=torch.from_numpy(stream[cut:]),
        separator=separator,
    )


def position_ids(documents: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at each document start within a row: int64 like ``documents`` ``[..., N]``."""
    n = documents.shape[-1]
    idx = torch.arange(n, device=documents.device).expand_as(documents)
    start = torch.ones_like(documents, dtype=torch.bool)
    start[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(start, idx, 0).cummax(dim=-1).values  # index of the current document's first token
    return idx - first


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Causal attention mask that stays inside each document: bool ``[..., N, N]`` (query, key)."""
    n = documents.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=documents.device).tril()
    return causal & (documents[..., :, None] == documents[..., None, :])


def save_packed(packed: PackedSequences, path: str | os.PathLike[str], **meta) -> Path:
    """Save to a folder: ``tokens.npy``, ``documents.npy``, ``remainder.npy``, ``meta.json`` (``meta`` added)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / "tokens.npy", packed.tokens.numpy())
    np.save(path / "documents.npy", packed.documents.numpy())
    np.save(path / "remainder.npy", packed.remainder.numpy())
    info = {"rows": len(packed), "seqlen": packed.seqlen, "separator": packed.separator, **meta}
    (path / "meta.json").write_text(json.dumps(info, indent=2) + "\n")
    return path


def load_packed(path: str | os.PathLike[str]) -> PackedSequences:
    """Load what :func:`save_packed` wrote (token rows memory-mapped, so large corpora stay on disk)."""
    path = Path(path)
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{path} is not a packed dataset (no meta.json); make one with launch/prepare_data.py")
    meta = json.loads((path / "meta.json").read_text())
    tokens = torch.from_numpy(np.load(path / "tokens.npy", mmap_mode="c"))
    documents = torch.from_numpy(np.load(path / "documents.npy", mmap_mode="c"))
    return PackedSequences(tokens, documents, torch.from_numpy(np.load(path / "remainder.npy")), meta["separator"])
