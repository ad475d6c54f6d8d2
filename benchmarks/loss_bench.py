"""The training loss, LM head + cross-entropy: the project's tiled loss vs Liger Kernel's fused linear
cross-entropy, side by side in one run.

    python benchmarks/loss_bench.py --out benchmarks/results/loss_bench.md        # GPU: Qwen2.5-3B head, 128K, 256K
    python benchmarks/loss_bench.py --tokens 256 --hidden 64 --vocab 1000 --dtype fp32 --reps 1 --warmup 0   # CPU

Inputs, as the ZeRO-2 bf16 engine hands them to the loss: final hidden states ``[N, hidden]`` and the bias-free head
weight ``[vocab, hidden]``, both ``--dtype`` (the engine's low-precision copy; fp32 only for an fp32 model), labels
uniform over the vocabulary, the last one ``-100`` (``make_batch``'s shift), the loss ``Σ CE / label tokens``.

Rows per token count:

- ``tiled``: ``integration.loss.tiled_sequence_loss`` with its default tiles (``TILE_BYTES`` of fp32 logits); the
  backward recomputes each tile's logits.
- ``liger (accum fp32)``: ``liger_fused_linear_cross_entropy(reduction="sum", accum_dtype=torch.float32) /
  label_tokens``, the wiring ``tests/test_loss_choice.py`` checks in the engines; the gradients are computed in the
  forward, chunk by chunk (Liger's chunk: ``next_pow2(N / ceil(vocab / hidden))`` tokens).
- ``liger (accum weight dtype)``: the same with Liger's default ``accum_dtype=None``, which sums a bf16 weight's
  chunk gradients in bf16 (what its Hugging Face integration does); only for bf16.

Columns: forward + backward of the loss alone (ms, median of ``--reps`` after ``--warmup``), TFLOP/s of the useful
work ``6 * N * hidden * vocab`` (the logits, the hidden-state gradient and the weight gradient: 2 N·hidden·vocab
each; ours computes the logits twice, 8 N·hidden·vocab, and is credited 6), the peak GPU memory above the inputs
(including the gradients the pass leaves in ``.grad``), both as ratios to ``tiled``, the loss value, and the largest
gradient difference from ``tiled`` relative to its largest entry (hidden / weight).

Liger's Triton kernels need a GPU, or the Triton interpreter on CPU (``TRITON_INTERPRET=1``: kernels run in
Python, so the times say nothing about speed); without either the table says "liger: not run (needs a GPU)".
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ds_mtraining.integration.batch import IGNORE
from ds_mtraining.integration.loss import _tile_rows, liger_sequence_loss, tiled_sequence_loss

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NOT_RUN = "liger: not run (needs a GPU)"
COLUMNS = (
    "tokens",
    "loss",
    "chunks",
    "ms fwd+bwd",
    "TFLOP/s",
    "peak GiB",
    "time / tiled",
    "memory / tiled",
    "loss value",
    "grad diff vs tiled (hidden / weight)",
)


def liger_runs() -> bool:
    """Whether Liger's Triton kernels can run here: on a GPU, or on CPU under the Triton interpreter."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _liger_chunk(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk of tokens (``fused_linear_cross_entropy_forward``, ``chunk_mem_const`` 1)."""
    import triton

    return min(tokens, triton.next_power_of_2(triton.cdiv(tokens, triton.cdiv(vocab, hidden))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(loss_fn: Callable[[], torch.Tensor], leaves: tuple[torch.Tensor, ...], *, warmup: int, reps: int) -> dict:
    """Forward + backward of ``loss_fn`` ``warmup + reps`` times, each from cleared ``.grad``: the median time of the
    last ``reps`` (ms), their peak memory above what was allocated before them (GiB; ``None`` on CPU), the loss and
    the gradients of the last one (``hidden``, weight)."""
    device = leaves[0].device
    times = []
    for rep in range(warmup + reps):
        for leaf in leaves:
            leaf.grad = None
        if rep == warmup and device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        _sync(device)
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None
    return {
        "ms": statistics.median(times[warmup:]),
        "peak_gib": peak,
        "loss": float(loss.detach()),
        "grads": tuple(leaf.grad for leaf in leaves),
    }


def run_tokens(args: argparse.Namespace, tokens: int, device: torch.device) -> list[dict]:
    """The rows of one token count."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=gen) * 0.02)  # Qwen2's initializer range
    hidden = torch.randn(tokens, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (tokens,), generator=gen).to(device)
    labels[-1] = IGNORE
    label_tokens = tokens - 1

    candidates = {"tiled": lambda: tiled_sequence_loss(hidden[None], head, labels[None], label_tokens)}
    if liger_runs():
        candidates["liger (accum fp32)"] = lambda: liger_sequence_loss(hidden[None], head, labels[None], label_tokens)
        if dtype != torch.float32:  # Liger's default accum_dtype, as its Hugging Face integration calls it
            candidates["liger (accum weight dtype)"] = lambda: liger_fused_linear_cross_entropy(
                hidden, head.weight, labels, ignore_index=IGNORE, reduction="sum"
            ) / label_tokens
    rows, tiled_grads = [], None
    for name, loss_fn in candidates.items():
        try:
            row = measure(loss_fn, (hidden, head.weight), warmup=args.warmup, reps=args.reps)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            row = {"oom": True}
        row |= {"tokens": tokens, "name": name}
        grads = row.pop("grads", None)
        if name == "tiled":
            tiled_grads = grads
        elif grads is not None and tiled_grads is not None:
            row["diff"] = tuple(_relative_difference(g, t) for g, t in zip(grads, tiled_grads))
        del grads
        hidden.grad = head.weight.grad = None
        if name == "tiled":
            chunk = _tile_rows(tokens, args.vocab, None)
        else:
            chunk = _liger_chunk(tokens, args.hidden, args.vocab)
        row["chunks"] = f"{math.ceil(tokens / chunk)} x {chunk}"
        print(f"{tokens} {name}: " + ("out of memory" if "oom" in row else f"{row['ms']:.1f} ms"), flush=True)
        rows.append(row)
    if not liger_runs():
        rows.append({"tokens": tokens, "name": NOT_RUN})
    return rows


def _relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def table(rows: list[dict], hidden: int, vocab: int) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    base = {}
    for row in rows:
        tokens, name = row["tokens"], row["name"]
        if name == NOT_RUN or "oom" in row:
            note = name if name == NOT_RUN else f"{name}: out of memory"
            lines.append(f"| {tokens} | {note} |" + " – |" * (len(COLUMNS) - 2))
            continue
        if name == "tiled":
            base[tokens] = row
        tiled = base.get(tokens)
        tflops = 6 * tokens * hidden * vocab / (row["ms"] * 1e-3) / 1e12
        peak = "–" if row["peak_gib"] is None else f"{row['peak_gib']:.3g}"
        if name == "tiled":
            ratios, diff = ("1.00", "1.00" if row["peak_gib"] is not None else "–"), "–"
        elif tiled is None:  # out of memory
            ratios, diff = ("–", "–"), "–"
        else:
            memory = "–" if row["peak_gib"] is None else f"{row['peak_gib'] / tiled['peak_gib']:.2f}"
            ratios = (f"{row['ms'] / tiled['ms']:.2f}", memory)
            diff = " / ".join(f"{x:.1e}" for x in row["diff"])
        cells = (tokens, name, row["chunks"], f"{row['ms']:.1f}", f"{tflops:.3g}", peak, *ratios, f"{row['loss']:.6f}",
                 diff)  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--hidden", type=int, default=2048, help="Qwen2.5-3B: 2048")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5-3B: 151936")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="hidden states and head weight")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if min(args.tokens) < 2 or args.reps < 1 or args.warmup < 0:
        parser.error("--tokens must be >= 2, --reps >= 1, --warmup >= 0")
    from importlib.metadata import version

    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [row for tokens in args.tokens for row in run_tokens(args, tokens, device)]
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        interpreter = " (Liger under the Triton interpreter: its times are not kernel times)" if liger_runs() else ""
        where = f"{platform.machine()} CPU{interpreter}"
    command = " ".join(sys.argv if argv is None else ["benchmarks/loss_bench.py", *argv])
    versions = f"torch {torch.__version__} · triton {triton.__version__} · liger-kernel {version('liger-kernel')}"
    report = (
        f"# LM head + cross-entropy: tiled loss vs Liger fused linear cross-entropy — "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
        f"{where} · {versions} · command: `python {command}`\n\n"
        f"hidden {args.hidden}, vocab {args.vocab}, {args.dtype} hidden states and head weight; median of {args.reps} "
        f"after {args.warmup} warm-up; TFLOP/s of 6·N·hidden·vocab; peak memory above the inputs, gradients "
        f"included (GPU only); chunks = count x tokens.\n\n" + table(rows, args.hidden, args.vocab) + "\n"
    )
    print(report)
    if args.out:
        args.out.write_text(report)
    return report


if __name__ == "__main__":
    main()
