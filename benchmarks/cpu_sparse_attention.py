"""CPU time of the PyTorch sparse path vs dense SDPA, side by side, so the CPU path cannot silently get slow.

    python benchmarks/cpu_sparse_attention.py [--seqlens 4096 8192 16384] [--density 0.05] [--out FILE]

Planted indices (sinks, columns, a local band, far bands) at the target density; B=1, Hq=8, Hkv=2, D=64,
fp32, causal. Times are the median of ``--repeats`` runs after one warm-up. FLOPs count the attended entries
only: 4·D per entry forward (QKᵀ and PV), 2.5× that for the backward.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
from datetime import date

import torch

from ds_mtraining.sparse import vertical_slash_attention
from ds_mtraining.sparse.planted import planted_index


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _fwd_bwd(attention, q, k, v):
    def run():
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        attention(q_, k_, v_).sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--density", type=float, default=0.05, help="target density (0.05 = 95%% sparsity)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    lines = [
        f"CPU sparse attention vs SDPA — {date.today()}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        f"B=1, Hq={h}, Hkv={hkv}, D={d}, fp32, causal, block 64, median of {args.repeats}",
        "",
        "| N | density | sparse fwd ms | SDPA fwd ms | fwd speed-up | sparse fwd+bwd ms | SDPA fwd+bwd ms "
        "| fwd+bwd speed-up | sparse GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for n in args.seqlens:
        q = torch.randn(1, n, h, d, generator=gen)
        k, v = torch.randn(2, 1, n, hkv, d, generator=gen)
        index = planted_index(
            1, h, n, 64, density=args.density, sinks=16, columns=16, local_tokens=128, band_tokens=128, generator=gen
        )
        density = index.density(n).mean().item()
        sparse = functools.partial(vertical_slash_attention, index=index)
        dense = functools.partial(vertical_slash_attention, index=None)
        with torch.no_grad():
            sparse_fwd = _median_ms(functools.partial(sparse, q, k, v), args.repeats)
            dense_fwd = _median_ms(functools.partial(dense, q, k, v), args.repeats)
        sparse_all = _median_ms(_fwd_bwd(sparse, q, k, v), args.repeats)
        dense_all = _median_ms(_fwd_bwd(dense, q, k, v), args.repeats)
        flops = 4 * d * h * density * n * (n + 1) / 2 * 3.5
        row = (
            f"| {n} | {density:.3f} | {sparse_fwd:.0f} | {dense_fwd:.0f} | {dense_fwd / sparse_fwd:.2f}x "
            f"| {sparse_all:.0f} | {dense_all:.0f} | {dense_all / sparse_all:.2f}x | {flops / sparse_all / 1e6:.1f} |"
        )
        lines.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\ncommand: python " + " ".join(sys.argv) + "\n")


if __name__ == "__main__":
    main()
