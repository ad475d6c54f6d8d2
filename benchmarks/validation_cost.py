"""What ``vertical_slash_attention``'s index validation costs on a GPU, alone and in a chain of layers.

    python -m benchmarks.validation_cost [--seqlen 131072] --out FILE
    python -m benchmarks.validation_cost --device cpu --seqlen 256 --repeats 1 --rep-ms 1     # CPU smoke test

``VerticalSlashIndex.validate`` synchronises with the host (four ``.any()`` checks). Alone, a sync costs little:
the GPU drains the queue either way. In a model the host launches layer after layer ahead of the GPU, and each
sync makes it wait, so the next layer's launches are no longer hidden behind the GPU's work. Times at 128K, B=1,
16 query / 2 kv heads of 128, bf16: fwd+bwd of the kernels alone (the PyTorch path on CPU), then through autograd
on a planted 5 %-dense index, and ``--layers`` (4) "layers" (the spread estimate, then the attention forward; one
backward through all), with ``check_index`` True and False, alternated ``--repeats`` times (medians of
``benchmarks.harness.median_ms``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import harness
from benchmarks.cases import random_qkv
from benchmarks.strategies import GRAPHS, STRATEGIES
from ds_mtraining.estimator import estimate_index
from ds_mtraining.sparse import AttentionPattern, vertical_slash_attention
from ds_mtraining.sparse.attention import kernel_backend
from ds_mtraining.sparse.planted import planted_index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=3, help="alternations of check_index True / False")
    parser.add_argument("--layers", type=int, default=4, help="layers of the chain")
    parser.add_argument("--rep-ms", type=float, default=1500.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    harness.add_device_args(parser)
    args = parser.parse_args(argv)
    n, device = args.seqlen, args.device
    gen = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(n, gen, device=device, dtype=harness.DTYPES[args.dtype])
    scale = 128**-0.5
    index = planted_index(1, 16, n, 128, density=0.05, generator=gen, device=device)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    config = STRATEGIES["spread"]

    def ms(fn, rep_ms: float = args.rep_ms) -> float:
        return harness.median_ms(fn, rep_ms=rep_ms, device=device)

    backend = kernel_backend(q)  # the Triton kernels on a GPU, the PyTorch path on CPU

    def kernels() -> None:
        fresh = type(index)(index.vertical, index.slash, index.block_size)  # converted anew, as each step's index
        out, lse = backend.vertical_slash_forward(q, k, v, fresh, scale)
        backend.vertical_slash_backward(do, q, k, v, out, lse, fresh, scale)

    def autograd(check: bool) -> None:
        out = vertical_slash_attention(qg, kg, vg, AttentionPattern(n, index), check_index=check)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def layers(check: bool) -> None:
        total = 0
        for _ in range(args.layers):
            idx = estimate_index(q, k, config, graphs=GRAPHS)
            pattern = AttentionPattern(n, idx)
            total = total + vertical_slash_attention(qg, kg, vg, pattern, check_index=check).float().square().mean()
        torch.autograd.grad(total, (qg, kg, vg))

    report = harness.Report(args.out)
    report.add(
        *harness.header("Index validation cost", __spec__.name, argv, device=device),
        "",
        f"N={n}, B=1, Hq=16, Hkv=2, D=128, {args.dtype}; planted index of density 0.05.",
        "",
        "| case | check_index=True ms | check_index=False ms | difference |",
        "|---|---|---|---|",
        f"| kernel API fwd+bwd (no validation) | {ms(kernels):.2f} | | |",
    )
    # The chain of layers runs longer per call: a longer budget keeps its number of calls near the others'.
    chain = f"{args.layers} layers estimate + attention fwd+bwd"
    for name, fn, rep_ms in (("autograd fwd+bwd", autograd, args.rep_ms), (chain, layers, 8 / 3 * args.rep_ms)):
        for _ in range(args.repeats):  # alternating: the difference must repeat
            with_check, without = ms(lambda fn=fn: fn(True), rep_ms), ms(lambda fn=fn: fn(False), rep_ms)
            diff = f"{with_check - without:+.2f} ({with_check / without - 1:+.1%})"
            report.add(f"| {name} | {with_check:.2f} | {without:.2f} | {diff} |")
    idx = estimate_index(q, k, config, graphs=GRAPHS)
    report.add("", f"validate alone: {ms(lambda: idx.validate(n)):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
