"""CPU time of the PyTorch sparse path vs dense SDPA, side by side, so the CPU path cannot silently get slow.

    python -m benchmarks.cpu_sparse_attention [--seqlens 4096 8192 16384] [--density 0.05] --out FILE

Planted indices (``ds_mtraining.sparse.planted``: sinks, columns, a local band, far bands) at the target density;
B=1, Hq=8, Hkv=2, D=64, fp32, causal, block 64. Times: ``benchmarks.harness.median_ms`` on CPU (one warm-up call,
then calls for ``--rep-ms``, median). FLOPs count the attended entries only: 4·D per entry forward (QKᵀ and PV), 2.5×
that for the backward.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from benchmarks import harness
from ds_mtraining.sparse import AttentionPattern, vertical_slash_attention
from ds_mtraining.sparse.planted import planted_index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--density", type=float, default=0.05, help="target density (0.05 = 95%% sparsity)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rep-ms", type=float, default=3000.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    report = harness.Report(args.out)
    report.add(
        *harness.header("CPU sparse attention vs SDPA", __spec__.name, argv, device="cpu"),
        "",
        f"B=1, Hq={h}, Hkv={hkv}, D={d}, fp32, causal, block 64, median ms",
        "",
        "| N | density | sparse fwd ms | SDPA fwd ms | fwd speed-up | sparse fwd+bwd ms | SDPA fwd+bwd ms "
        "| fwd+bwd speed-up | sparse GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    )
    for n in args.seqlens:
        q = torch.randn(1, n, h, d, generator=gen)
        k, v = torch.randn(2, 1, n, hkv, d, generator=gen)
        index = planted_index(
            1, h, n, 64, density=args.density, sinks=16, columns=16, local_tokens=128, band_tokens=128, generator=gen
        )
        density = index.density(n).mean().item()
        sparse = functools.partial(vertical_slash_attention, pattern=AttentionPattern(n, index))
        dense = functools.partial(vertical_slash_attention, pattern=None)
        dout = torch.randn_like(q)
        sparse_fwd, sparse_all = harness.forward_backward_ms(sparse, [q, k, v], dout, rep_ms=args.rep_ms)
        dense_fwd, dense_all = harness.forward_backward_ms(dense, [q, k, v], dout, rep_ms=args.rep_ms)
        flops = 4 * d * h * density * n * (n + 1) / 2 * 3.5
        report.add(
            f"| {n} | {density:.3f} | {sparse_fwd:.0f} | {dense_fwd:.0f} | {dense_fwd / sparse_fwd:.2f}x "
            f"| {sparse_all:.0f} | {dense_all:.0f} | {dense_all / sparse_all:.2f}x | {flops / sparse_all / 1e6:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
