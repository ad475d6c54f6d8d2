"""Turn a checkpoint of launch/train.py into a Hugging Face folder (safetensors, config, tokenizer).

    python launch/export.py --checkpoint runs/train/checkpoints --model smollm2-135m --out runs/train/hf
    python launch/export.py --checkpoint runs/train/checkpoints --tag step4 --model tiny-qwen2 --out runs/hf4

``--model`` (and ``--rope-kind``/``--rope-factor``; for tiny-qwen2 ``--vocab-size``/``--max-positions``) must
describe the model that was trained, as given to launch/train.py. Problems with the inputs end with one
``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True, help="the checkpoints/ folder of a training run")
    parser.add_argument("--tag", help="checkpoint tag, e.g. step4 (default: the one the 'latest' file names)")
    parser.add_argument("--model", required=True, help="registered name, Hugging Face folder or config.json")
    parser.add_argument("--rope-kind", choices=["linear", "yarn", "ntk"], help="the RoPE scaling trained with")
    parser.add_argument("--rope-factor", type=float, default=2.0, help="new context / trained context")
    parser.add_argument("--vocab-size", type=int, default=512, help="tiny-qwen2 only (launch/train.py: 512)")
    parser.add_argument(
        "--max-positions", type=int, default=8192, help="tiny-qwen2 only (launch/train.py: max(--seqlen, 8192))"
    )
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write (must not exist)")
    return parser.parse_args(argv)


def checkpoint_tag(directory: Path, tag: str | None) -> str:
    """``tag``, or the tag ``directory/latest`` names; raises :class:`FileNotFoundError` when there is no such
    checkpoint."""
    from ds_mtraining.integration.deepspeed import Checkpoints

    if tag is None:
        tag = Checkpoints(directory).latest_tag()
        if tag is None:
            raise FileNotFoundError(
                f"{directory / 'latest'} not found; --checkpoint takes the checkpoints/ folder of a training run"
            )
    if not tag or not (directory / tag).is_dir():
        raise FileNotFoundError(f"checkpoint {directory / tag} does not exist")
    return tag


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ds_mtraining.console import print_error
    from ds_mtraining.integration.export import export_checkpoint
    from ds_mtraining.integration.models import resolve_model
    from ds_mtraining.models import RopeScaling

    try:
        tag = checkpoint_tag(args.checkpoint, args.tag)
        if args.out.exists():
            raise FileExistsError(f"{args.out} already exists; pass another --out or remove it")
        rope = RopeScaling(kind=args.rope_kind, factor=args.rope_factor) if args.rope_kind else None
        spec = resolve_model(args.model, rope=rope, vocab_size=args.vocab_size, max_positions=args.max_positions)
    except (OSError, ValueError) as e:  # ValueError: ModelError and RopeScaling's validation
        print_error(e)
        return 2
    out = export_checkpoint(args.checkpoint, tag, spec, args.out)
    print(f"wrote {out} ({spec.name}, checkpoint {args.checkpoint / tag})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
