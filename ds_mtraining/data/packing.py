"""Pack tokenized documents into fixed-length sequences, and save / load them.

Documents are concatenated into one token stream, each followed by the separator (EOS), and the stream is
cut into rows of ``seqlen`` tokens. Nothing is padded or dropped except the tail shorter than ``seqlen``
(kept in :attr:`PackedSequences.remainder`), so ``cat(rows) + remainder`` is exactly the stream: packing
is lossless and depends only on the documents' order. Document *ids* travel with the tokens so training
can restart positions at each document (:func:`position_ids`) and keep attention and labels inside it
(``mtraining.data.document_masking``, ``integration.batch``; :func:`document_mask` is the dense mask of that
attention); plain causal training over the packed rows (the default, what long-context pre-training does) ignores
them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "PackedDataError",
    "PackedSequences",
    "check_token_ids",
    "document_mask",
    "load_packed",
    "pack_documents",
    "position_ids",
    "save_packed",
]


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


class PackedDataError(ValueError):
    """A packed dataset folder cannot be trained on; the message names the file, what is wrong and the fix."""


_REMAKE = "make the folder again with launch/prepare_data.py"
_TOKEN_DTYPES = (np.int32, np.int64)
"""Token ids an embedding accepts (torch indexes with int32 or int64 only); :func:`save_packed` writes int64."""


def _load_array(file: Path, *, mmap: bool) -> np.ndarray:
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: the folder is not a complete packed dataset; {_REMAKE}")
    with file.open("rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise PackedDataError(f"{file} is not a .npy file (it lacks numpy's header); {_REMAKE}")
    try:
        return np.load(file, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # truncated, not .npy at all, or pickled objects
        reason = " ".join(str(e).split())[:200]
        raise PackedDataError(f"{file} is not a readable .npy array ({reason}); {_REMAKE}") from None


def _check_ids(file: Path, array: np.ndarray, ndim: int, what: str) -> None:
    if array.dtype not in _TOKEN_DTYPES:
        raise PackedDataError(f"{file} holds {array.dtype} values; {what} must be int64 (or int32) ids; {_REMAKE}")
    if array.ndim != ndim:
        shape = "[rows, seqlen]" if ndim == 2 else "[tokens]"
        raise PackedDataError(
            f"{file} has shape {list(array.shape)} ({array.ndim}-D); {what} must be {ndim}-D {shape}; {_REMAKE}"
        )


def load_packed(path: str | os.PathLike[str]) -> PackedSequences:
    """Load what :func:`save_packed` wrote (token rows memory-mapped, so large corpora stay on disk), checked from
    the metadata, dtypes and shapes; the ids against a model's vocabulary: :func:`check_token_ids`.

    Raises:
        FileNotFoundError: the folder, ``meta.json`` or one of the ``.npy`` files is missing.
        PackedDataError: a file is unreadable (truncated, not ``.npy``, not JSON), of the wrong dtype or shape,
            holds no row, or disagrees with ``meta.json``.
    """
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise FileNotFoundError(f"packed dataset {path} {what}; make one with launch/prepare_data.py (its OUT/train)")
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{path} is not a packed dataset (no meta.json); make one with launch/prepare_data.py")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackedDataError(f"{path / 'meta.json'} is not valid JSON ({e}); {_REMAKE}") from None
    if not isinstance(meta, dict):
        raise PackedDataError(f"{path / 'meta.json'} must hold a JSON object, got {type(meta).__name__}; {_REMAKE}")
    separator = meta.get("separator")
    if isinstance(separator, bool) or not isinstance(separator, int):
        found = "has no" if separator is None else f"has a non-integer ({separator!r})"
        raise PackedDataError(
            f'{path / "meta.json"} {found} "separator" (the end-of-document token id the rows are packed with); '
            f"{_REMAKE}"
        )
    tokens_np = _load_array(path / "tokens.npy", mmap=True)
    _check_ids(path / "tokens.npy", tokens_np, 2, "token rows")
    rows, seqlen = tokens_np.shape
    if rows == 0 or seqlen == 0:
        raise PackedDataError(
            f"{path / 'tokens.npy'} holds no tokens (shape {list(tokens_np.shape)}); the corpus did not fill one row: "
            f"give launch/prepare_data.py more text or a smaller --seqlen"
        )
    for key, found in (("rows", rows), ("seqlen", seqlen)):
        if key in meta and meta[key] != found:
            raise PackedDataError(
                f"{path / 'meta.json'} says {key}={meta[key]!r} but tokens.npy has {found} (shape "
                f"{list(tokens_np.shape)}): the files are from different runs; {_REMAKE}"
            )
    documents_np = _load_array(path / "documents.npy", mmap=True)
    _check_ids(path / "documents.npy", documents_np, 2, "document ids")
    if documents_np.shape != tokens_np.shape:
        raise PackedDataError(
            f"{path / 'documents.npy'} has shape {list(documents_np.shape)}, tokens.npy {list(tokens_np.shape)}; "
            f"they must match; {_REMAKE}"
        )
    remainder_np = _load_array(path / "remainder.npy", mmap=False)
    _check_ids(path / "remainder.npy", remainder_np, 1, "the remainder")
    tokens, documents = torch.from_numpy(tokens_np), torch.from_numpy(documents_np)
    return PackedSequences(tokens, documents, torch.from_numpy(remainder_np), separator)


def check_token_ids(packed: PackedSequences, vocab_size: int, model: str, where: str = "the packed rows") -> None:
    """Every id of ``packed`` (rows, remainder, separator) in ``[0, vocab_size)`` of ``model``, else
    :class:`PackedDataError` naming the offending id (on a GPU an id past the embedding is a device-side assert
    naming no data): one min/max pass, memory-mapped rows stay on disk."""
    tokens, remainder, separator = packed.tokens.numpy(), packed.remainder.numpy(), packed.separator
    low, high = int(tokens.min()), int(tokens.max())
    if remainder.size:
        low, high = min(low, int(remainder.min())), max(high, int(remainder.max()))
    low, high = min(low, separator), max(high, separator)
    if low < 0 or high >= vocab_size:
        bad = f"max id {high}" if high >= vocab_size else f"min id {low}"
        raise PackedDataError(
            f"{where} holds token ids in [{low}, {high}] ({bad}, separator {separator}), outside {model}'s vocabulary "
            f"of {vocab_size} (ids 0..{vocab_size - 1}): the data was tokenized for another model; pack it with "
            f"this model's tokenizer (launch/prepare_data.py --model ...) or train the model it was made for"
        )
