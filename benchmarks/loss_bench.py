"""The training loss, LM head + cross-entropy: the project's tiled loss vs Liger Kernel's fused linear
cross-entropy, side by side in one run.

    python -m benchmarks.loss_bench --out benchmarks/results/loss_bench.md        # GPU: Qwen2.5-3B head, 128K, 256K
    python -m benchmarks.loss_bench --tokens 256 --hidden 64 --vocab 1000 --dtype fp32 --rep-ms 1   # CPU

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

Columns: forward + backward of the loss alone (ms, ``benchmarks.harness.median_ms`` over ``--rep-ms``), TFLOP/s of
the useful
work ``6 * N * hidden * vocab`` (the logits, the hidden-state gradient and the weight gradient: 2 N·hidden·vocab
each; ours computes the logits twice, 8 N·hidden·vocab, and is credited 6), the peak GPU memory of one more pass above
the inputs (including the gradients the pass leaves in ``.grad``), both as ratios to ``tiled``, that pass's loss value,
and its largest gradient difference from ``tiled`` relative to its largest entry (hidden / weight).

Liger's Triton kernels need a GPU, or the Triton interpreter on CPU (``TRITON_INTERPRET=1``: kernels run in
Python, so the times say nothing about speed); without either the table says "liger: not run (needs a GPU)".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch

from benchmarks import harness
from ds_mtraining.integration.batch import IGNORE
from ds_mtraining.integration.loss import _tile_rows, liger_sequence_loss, tiled_sequence_loss

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


def measure(loss_fn: Callable[[], torch.Tensor], leaves: tuple[torch.Tensor, ...], *, rep_ms: float) -> dict:
    """Forward + backward of ``loss_fn``, each from cleared ``.grad``: the median ms (``harness.median_ms``), then
    one more pass for its peak memory above what was allocated before it (GiB; ``None`` on CPU), its loss and its
    gradients (``hidden``, weight)."""
    device = leaves[0].device

    def step() -> torch.Tensor:
        for leaf in leaves:
            leaf.grad = None
        loss = loss_fn()
        loss.backward()
        return loss

    ms = harness.median_ms(step, rep_ms=rep_ms, device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    loss = step()
    harness.sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None
    return {"ms": ms, "peak_gib": peak, "loss": float(loss.detach()), "grads": tuple(leaf.grad for leaf in leaves)}


def run_tokens(args: argparse.Namespace, tokens: int, device: torch.device) -> list[dict]:
    """The rows of one token count."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = harness.DTYPES[args.dtype]
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
            row = measure(loss_fn, (hidden, head.weight), rep_ms=args.rep_ms)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--hidden", type=int, default=2048, help="Qwen2.5-3B: 2048")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5-3B: 151936")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="hidden states and head weight")
    parser.add_argument("--rep-ms", type=float, default=1000.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if min(args.tokens) < 2:
        parser.error("--tokens must be >= 2")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [row for tokens in args.tokens for row in run_tokens(args, tokens, device)]
    title = "LM head + cross-entropy: tiled loss vs Liger fused linear cross-entropy"
    harness.Report(args.out).add(
        *harness.header(title, __spec__.name, argv, packages=("liger-kernel",)),
        "",
        f"hidden {args.hidden}, vocab {args.vocab}, {args.dtype} hidden states and head weight; median ms; TFLOP/s of "
        "6·N·hidden·vocab; peak memory above the inputs, gradients included (GPU only); chunks = count x tokens.",
        "",
        table(rows, args.hidden, args.vocab),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
