"""GPU time of the online estimator next to the sparse attention it feeds (issue 3: estimator <= 5 %).

    python benchmarks/estimator_bench.py [--seqlens 32768 131072] [--out FILE]

B=1, Hq=16, Hkv=2, D=128, bf16, default SparseAttentionConfig except block 128 (last_q=64 observation rows).
q/k are random: this times the estimator, it does not judge its index. The attention column is
``vertical_slash_attention`` fwd+bwd through autograd (Triton kernels) on a planted 95 %-sparse index.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch
import triton.testing

from ds_mtraining.sparse import estimate_index, vertical_slash_attention
from ds_mtraining.sparse.planted import planted_index

# The estimator reads these fields; a namespace keeps this script free of pydantic (absent on the GPU image).
CONFIG = SimpleNamespace(
    pattern="vertical_slash",
    estimator="baseline",
    block_size=128,
    last_q=64,
    vertical_recall=0.9,
    slash_recall=0.9,
    vertical_min=0,
    vertical_max=1024,
    slash_min=0,
    slash_max=1024,
    sink_tokens=64,
    local_blocks=1,
)


def _row(n: int, gen: torch.Generator) -> str:
    q = torch.randn(1, n, 16, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, n, 2, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    est = triton.testing.do_bench(lambda: estimate_index(q, k, CONFIG), warmup=25, rep=200)
    est_report = triton.testing.do_bench(lambda: estimate_index(q, k, CONFIG, return_report=True), warmup=25, rep=200)
    index = planted_index(1, 16, n, 128, density=0.05, generator=gen, device="cuda")
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def attention() -> None:
        out = vertical_slash_attention(qg, kg, vg, index)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    att = triton.testing.do_bench(attention, warmup=25, rep=200)
    return f"| {n} | {est:.2f} | {est_report:.2f} | {att:.2f} | {est / att:.1%} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = [
        (
            f"estimator vs sparse attention — {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}"
        ),
        "",
        "| N | estimate ms | estimate + report ms | attention fwd+bwd ms (95 %) | estimate / attention |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    gen = torch.Generator().manual_seed(0)
    for n in args.seqlens:
        lines.append(_row(n, gen))
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\ncommand: python " + " ".join(sys.argv) + "\n")


if __name__ == "__main__":
    main()
