"""Tokenizing documents for packing: no special tokens inside documents, one end-of-text separator between them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["separator_id", "tokenize_documents"]


def separator_id(tokenizer) -> int:
    """The document separator: ``<|endoftext|>`` when the vocabulary has it (SmolLM2, GPT-2, Qwen), else EOS."""
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return vocab["<|endoftext|>"]
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither <|endoftext|> nor an EOS token to separate documents")
    return tokenizer.eos_token_id


def tokenize_documents(
    tokenizer, documents: Sequence[str], batch: int = 256, advance: Callable[[int], object] | None = None
) -> list[list[int]]:
    """Token ids of each document, without BOS/EOS (the packer adds separators); ``advance(n)`` is called after each
    batch of ``n`` documents."""
    ids: list[list[int]] = []
    for start in range(0, len(documents), batch):
        part = list(documents[start : start + batch])
        ids.extend(tokenizer(part, add_special_tokens=False)["input_ids"])
        if advance is not None:
            advance(len(part))
    return ids
