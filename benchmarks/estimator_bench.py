"""GPU time of the online estimators next to the sparse attention they feed (target: estimator <= 5 %).

    python -m benchmarks.estimator_bench [--seqlens 32768 131072] --out FILE
    python -m benchmarks.estimator_bench --device cpu --seqlens 256 --rep-ms 1      # CPU smoke test

B=1, Hq=16, Hkv=2, D=128, bf16, the settings of ``benchmarks.strategies`` (SparseAttentionConfig's defaults except
block 128): the "baseline" strategy (``BaselineEstimator``, last_q=64 rows) and the "spread" strategy
(``SpreadEstimator``, rows=128, the default; also 64). q/k are random (diffuse attention: the spread greedy runs every
round up to its caps, its slowest case): this times the estimators, it does not judge their indices. "Spread + recall
report" is what a training step pays per layer (the job logs each layer's observed recall: ``return_report=True``).
The last column times the spread strategy on planted heads (``benchmarks.cases.planted_heads``: sinks, 12 far
columns, a local band and 4 far diagonals per head, light noise), where, as on real attention, heads reach the recall
target after a few rounds and skip the rest. The attention column is ``vertical_slash_attention`` fwd+bwd through
autograd (Triton kernels, ``check_index=False`` as in a model) on a planted 95 %-sparse index.

A second table sets each estimate against the attention on *the index it produced*: random q/k (whose estimate
is ~10 % dense), the planted heads (~1 %) and heads planted to land near 95 % sparsity
(``benchmarks.cases.sparse95_heads``: 100 columns, 12 near and 12 far diagonals), with the index's density and
observed recall. A torch-profiler breakdown of the spread estimator at the largest N follows. Times:
``benchmarks.harness.median_ms``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import harness
from benchmarks.cases import planted_heads, random_qkv, sparse95_heads
from benchmarks.strategies import GRAPHS, STRATEGIES
from ds_mtraining.estimator import estimate_index
from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex, vertical_slash_attention
from ds_mtraining.sparse.planted import planted_index


class Bench:
    """The device, dtype and timing budget every measurement of a run shares."""

    def __init__(self, args: argparse.Namespace):
        self.device, self.dtype, self.rep_ms = args.device, harness.DTYPES[args.dtype], args.rep_ms
        self.strategies = args.strategies

    def ms(self, fn) -> float:
        return harness.median_ms(fn, rep_ms=self.rep_ms, device=self.device)

    def estimate_ms(self, q: torch.Tensor, k: torch.Tensor, strategy: str, report: bool = False) -> float:
        return self.ms(lambda: estimate_index(q, k, STRATEGIES[strategy], return_report=report, graphs=GRAPHS))

    def attention_ms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex) -> float:
        """fwd+bwd ms of ``vertical_slash_attention`` on ``index``, called as the model integration calls it
        (``check_index=False``: no host-syncing validation)."""

        pattern = AttentionPattern(q.shape[1], index)

        def attention(q, k, v):
            return vertical_slash_attention(q, k, v, pattern, check_index=False)

        return harness.forward_backward_ms(attention, [q, k, v], torch.randn_like(q), rep_ms=self.rep_ms)[1]

    def heads(self, n: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        plant = {"planted": planted_heads, "95 %-sparse": sparse95_heads}[kind]
        return plant(n, 16, n, device=self.device, dtype=self.dtype)

    def row(self, n: int, gen: torch.Generator) -> str:
        """The first table's row at ``n``: every strategy on random q/k, then spread with its report and on planted
        heads, each with its share of the attention."""
        q, k, v = random_qkv(n, gen, device=self.device, dtype=self.dtype)
        times = [self.estimate_ms(q, k, name) for name in self.strategies]
        index = planted_index(1, 16, n, 128, density=0.05, generator=gen, device=self.device)
        attention = self.attention_ms(q, k, v, index)
        times += [self.estimate_ms(q, k, "spread", report=True), self.estimate_ms(*self.heads(n, "planted"), "spread")]
        return f"| {n} | {attention:.2f} | " + " | ".join(f"{t:.2f} ({t / attention:.1%})" for t in times) + " |"

    def own_index_rows(self, n: int, gen: torch.Generator) -> list[str]:
        """Per input, the spread estimate (and with its report) against the attention on the index it produced."""
        q, k, v = random_qkv(n, gen, device=self.device, dtype=self.dtype)
        lines = []
        for name, (qi, ki) in (
            ("random", (q, k)),
            *((kind, self.heads(n, kind)) for kind in ("planted", "95 %-sparse")),
        ):
            est, rep = self.estimate_ms(qi, ki, "spread"), self.estimate_ms(qi, ki, "spread", report=True)
            index, report = estimate_index(qi, ki, STRATEGIES["spread"], return_report=True, graphs=GRAPHS)
            attention = self.attention_ms(qi, ki, v, index)
            lines.append(
                f"| {n} | {name} | {index.density(n).mean().item():.4f} | {report.recall.mean().item():.3f} | "
                f"{attention:.2f} | {est:.2f} ({est / attention:.1%}) | {rep:.2f} ({rep / attention:.1%}) |"
            )
        return lines

    def profile(self, n: int, gen: torch.Generator) -> list[str]:
        """The spread estimator's kernels (ops on CPU) at ``n``, the 15 slowest and the total."""
        q, k, _ = random_qkv(n, gen, device=self.device, dtype=self.dtype)
        times = harness.profile_ms(
            lambda: estimate_index(q, k, STRATEGIES["spread"], graphs=GRAPHS), device=self.device
        )
        what = "CUDA kernels" if self.device == "cuda" else "CPU ops"
        lines = [f"Spread estimator at N={n}, {what} (ms per call, top 15 of {len(times)}):", ""]
        lines += [f"- {ms:.3f} ms: {key[:110]}" for key, ms in list(times.items())[:15]]
        return [*lines, f"- total: {sum(times.values()):.3f} ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES),
                        help="the first table's estimator columns")  # fmt: skip
    parser.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    harness.add_device_args(parser)
    args = parser.parse_args(argv)
    bench = Bench(args)
    report = harness.Report(args.out)
    report.add(
        *harness.header("Estimators vs sparse attention", __spec__.name, argv, device=args.device),
        "",
        "| N | attention fwd+bwd ms (95 %) | "
        + " | ".join(f"{name} ms (share)" for name in args.strategies)
        + " | spread + recall report ms (share) | spread, planted heads ms (share) |",
        "|---|---|" + "---|" * (len(args.strategies) + 2),
    )
    gen = torch.Generator().manual_seed(0)
    for n in args.seqlens:
        report.add(bench.row(n, gen))
    report.add(
        "",
        "Each input's spread estimate against the attention on the index it produced:",
        "",
        (
            "| N | input | index density | observed recall | attention on it, fwd+bwd ms | spread ms (share) | "
            "spread + recall report ms (share) |"
        ),
        "|---|---|---|---|---|---|---|",
    )
    for n in args.seqlens:
        report.add(*bench.own_index_rows(n, gen))
    report.add("", *bench.profile(max(args.seqlens), gen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
