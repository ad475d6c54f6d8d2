"""Turn a checkpoint of launch/train.py into a Hugging Face folder (safetensors, config, tokenizer).

    python launch/export.py --checkpoint runs/train/checkpoints --model smollm2-135m --out runs/train/hf
    python launch/export.py --checkpoint runs/train/checkpoints --tag step4 --model tiny-qwen2 --out runs/hf4

``--model`` (for tiny-qwen2 also ``--vocab-size``/``--max-positions``) must describe the model that was trained,
as given to launch/train.py. The RoPE stretch it trained with is read from the checkpoint's manifest: the exported
config carries it, and ``--rope-kind``/``--rope-factor`` that contradict it are refused (checkpoints saved before
the manifest recorded it take them from the flags). Problems with the inputs end with one ``error:`` line and exit
status 2.
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
    parser.add_argument(
        "--rope-kind", choices=["linear", "yarn", "ntk"], help="the RoPE scaling trained with (default: the checkpoint's)"
    )
    parser.add_argument(
        "--rope-factor", type=float, help="new context / trained context (default: the checkpoint's, else 2)"
    )
    parser.add_argument("--vocab-size", type=int, default=512, help="tiny-qwen2 only (launch/train.py: 512)")
    parser.add_argument(
        "--max-positions", type=int, default=8192, help="tiny-qwen2 only (launch/train.py: max(--seqlen, 8192))"
    )
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write (must not exist)")
    return parser.parse_args(argv)


def checkpoint_tag(directory: Path, tag: str | None) -> str:
    """``tag``, or the tag ``directory/latest`` names; raises :class:`FileNotFoundError` when there is no such
    checkpoint."""
    from ds_mtraining.training.checkpoints import Checkpoints

    if tag is None:
        tag = Checkpoints(directory).latest_tag()
        if tag is None:
            raise FileNotFoundError(
                f"{directory / 'latest'} not found; --checkpoint takes the checkpoints/ folder of a training run"
            )
    if not tag or not (directory / tag).is_dir():
        raise FileNotFoundError(f"checkpoint {directory / tag} does not exist")
    return tag


def trained_rope(folder: Path, kind: str | None, factor: float | None) -> tuple[str | None, float | None]:
    """The RoPE stretch of the checkpoint ``folder`` (one tag) from its manifest, checked against the flags
    ``kind``/``factor`` (``None``: not given); raises ``ValueError`` naming both when they contradict it."""
    from ds_mtraining.training.manifest import read_manifest

    settings = read_manifest(folder)["settings"]
    if "rope_kind" not in settings:  # saved before the manifest recorded the stretch: the flags say it
        return kind, 2.0 if factor is None else factor
    saved_kind, saved_factor = settings["rope_kind"], settings["rope_factor"]
    saved = f"--rope-kind {saved_kind} --rope-factor {saved_factor:g}" if saved_kind else "no --rope-kind"
    if (kind is not None and kind != saved_kind) or (factor is not None and factor != saved_factor):
        given = " ".join(f"--rope-{n} {v:g}" if isinstance(v, float) else f"--rope-{n} {v}"
                         for n, v in (("kind", kind), ("factor", factor)) if v is not None)  # fmt: skip
        raise ValueError(f"checkpoint {folder} was trained with {saved}, not {given}; drop the flags (the checkpoint's "
                         "stretch is exported) or export another checkpoint")  # fmt: skip
    return saved_kind, saved_factor


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ds_mtraining.console import print_error
    from ds_mtraining.integration.export import export_checkpoint
    from ds_mtraining.integration.model_loading import resolve_model
    from ds_mtraining.models import RopeScaling
    from ds_mtraining.notices import quiet_library_notices

    quiet_library_notices()
    try:
        tag = checkpoint_tag(args.checkpoint, args.tag)
        if args.out.exists():
            raise FileExistsError(f"{args.out} already exists; pass another --out or remove it")
        kind, factor = trained_rope(args.checkpoint / tag, args.rope_kind, args.rope_factor)
        rope = RopeScaling(kind=kind, factor=factor) if kind else None
        spec = resolve_model(args.model, rope=rope, vocab_size=args.vocab_size, max_positions=args.max_positions)
    except (OSError, ValueError) as e:  # ValueError: ManifestError, ModelError and RopeScaling's validation
        print_error(e)
        return 2
    out = export_checkpoint(args.checkpoint, tag, spec, args.out)
    print(f"wrote {out} ({spec.name}, checkpoint {args.checkpoint / tag})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
