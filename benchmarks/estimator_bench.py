"""GPU time of the online estimators next to the sparse attention they feed (target: estimator <= 5 %).

    python benchmarks/estimator_bench.py [--seqlens 32768 131072] [--out FILE]

B=1, Hq=16, Hkv=2, D=128, bf16, default SparseAttentionConfig except block 128: the "baseline" strategy
(``BaselineEstimator``, last_q=64 rows) and the "spread" strategy (``SpreadEstimator``, rows=128, the default; also
64). q/k are random (diffuse attention: the spread greedy runs every round up to its caps, its slowest case): this
times the estimators, it does not judge their indices. "Spread + recall report" is what a training step pays per
layer (the job logs each layer's observed recall: ``return_report=True``). The last column times the spread strategy
on planted heads (:func:`planted`: sinks, 12 far columns, a local band and 4 far diagonals per head, light noise),
where, as on real attention, heads reach the recall target after a few rounds and skip the rest. The attention column is
``vertical_slash_attention`` fwd+bwd through autograd (Triton kernels, ``check_index=False`` as in a model) on a
planted 95 %-sparse index.

A second table sets each estimate against the attention on *the index it produced*: random q/k (whose estimate
is ~10 % dense), the planted heads (~1 %) and heads planted to land near 95 % sparsity (:func:`sparse95`: 100
columns, 12 near and 12 far diagonals), with the index's density and observed recall. A torch-profiler breakdown
of the spread estimator at the largest N follows.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import triton
import triton.testing

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import GraphCache, estimate_index
from ds_mtraining.sparse import vertical_slash_attention
from ds_mtraining.sparse.planted import plant_head, planted_index

# SparseAttentionConfig's defaults, except the block size (spelled out: the recorded results were taken with them).
BASE = {"pattern": "vertical_slash", "block_size": 128, "sink_tokens": 4, "local_blocks": 1}
"""The index-wide settings every strategy below shares."""
BASELINE = BaselineEstimator(
    last_q=64, column_recall=0.9, diagonal_recall=0.9, min_columns=0, max_columns=1024, min_diagonals=0,
    max_diagonals=1024,
)  # fmt: skip
SPREAD = SpreadEstimator(
    rows=128, recall=0.98, max_columns=1024, max_offsets=1024, min_ratio=0.0, exclusion=256, tail_rows=32,
    tail_columns=64,
)  # fmt: skip
STRATEGIES = {
    "baseline": SparseAttentionConfig(**BASE, estimator=BASELINE),
    "spread": SparseAttentionConfig(**BASE, estimator=SPREAD),
    "spread, 64 rows": SparseAttentionConfig(**BASE, estimator=SPREAD.model_copy(update={"rows": 64})),
    "spread, 2048 columns": SparseAttentionConfig(**BASE, estimator=SPREAD.model_copy(update={"max_columns": 2048})),
    "spread, 4096 columns": SparseAttentionConfig(**BASE, estimator=SPREAD.model_copy(update={"max_columns": 4096})),
}
"""The settings each timed column uses, by its name (``kernel_bench.py`` and ``ab_main.py`` use them too)."""
GRAPHS = GraphCache()
"""The CUDA graphs the estimates replay from: the training job's attention handle owns one such cache per model."""


def _planted_heads(n: int, heads: int, seed: int, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 q ``[1, n, heads, 128]``, k ``[1, n, heads // 8, 128]`` (GQA 8) from :func:`plant_head`; ``spec(gen)``
    gives each head's planted columns and diagonals (token distance -> share); each kv head's group shares the keys
    of its first head, with light noise on q."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    for h in range(heads):
        columns, diagonals = spec(gen)
        q, k = plant_head(n, columns=columns, diagonals=diagonals, sink=0.1, seed=seed * 100 + h // 8)
        qs.append(q * 128**0.5)  # the D**-0.5-scaled logits land on the planted values
        ks.append(k)
    q = torch.stack(qs, dim=1)[None]
    k = torch.stack(ks[::8], dim=1)[None]
    q = q + 0.02 * torch.randn(q.shape, generator=gen, dtype=q.dtype)
    return q.to("cuda", torch.bfloat16), k.to("cuda", torch.bfloat16)


@functools.lru_cache(maxsize=4)
def planted(n: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Light planted heads: sinks, 12 far columns, diagonals 0 and 1 and 4 far ones (their index: ~1 % dense).
    Cached: both tables time the same heads, and planting them on the CPU takes seconds at 256K."""

    def spec(gen):
        cols = torch.randperm(n - 1, generator=gen)[:12] + 1
        diags = torch.randperm(n // 2, generator=gen)[:4] + 300
        return {int(c): 0.03 for c in cols}, {0: 0.05, 1: 0.03, **{int(d): 0.04 for d in diags}}

    return _planted_heads(n, heads, seed, spec)


def sparse95(n: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads whose index lands near 95 % sparsity at 128K: sinks, 100 columns (40 % of the mass), 12 diagonals
    within 1536 tokens (25 %) and 12 far ones (20 %)."""

    def spec(gen):
        cols = torch.randperm(n - 1, generator=gen)[:100] + 1
        near = torch.randperm(1536, generator=gen)[:12]
        far = torch.randperm(n // 2, generator=gen)[:12] + 2048
        diagonals = {0: 0.05, **{int(d): 0.25 / 12 for d in near}, **{int(d): 0.2 / 12 for d in far}}
        return {int(c): 0.004 for c in cols}, diagonals

    return _planted_heads(n, heads, seed, spec)


def _inputs(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(1, n, 16, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, n, 2, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    return q, k, v


def _attention_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index) -> float:
    """fwd+bwd ms of ``vertical_slash_attention`` through autograd on ``index``, called as the model integration
    calls it (``check_index=False``: no host-syncing validation)."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def attention() -> None:
        out = vertical_slash_attention(qg, kg, vg, index, check_index=False)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return triton.testing.do_bench(attention, warmup=25, rep=200)


def _row(n: int, gen: torch.Generator) -> str:
    q, k, v = _inputs(n, gen)
    times = [
        triton.testing.do_bench(lambda c=c: estimate_index(q, k, c, graphs=GRAPHS), warmup=25, rep=200)
        for c in STRATEGIES.values()
    ]
    att = _attention_ms(q, k, v, planted_index(1, 16, n, 128, density=0.05, generator=gen, device="cuda"))
    spread = STRATEGIES["spread"]
    report = triton.testing.do_bench(
        lambda: estimate_index(q, k, spread, return_report=True, graphs=GRAPHS), warmup=25, rep=200
    )
    q_p, k_p = planted(n, 16, n)
    times += [
        report,
        triton.testing.do_bench(lambda: estimate_index(q_p, k_p, spread, graphs=GRAPHS), warmup=25, rep=200),
    ]
    cells = [f"{t:.2f} ({t / att:.1%})" for t in times]
    return f"| {n} | {att:.2f} | " + " | ".join(cells) + " |"


def _own_index_rows(n: int, gen: torch.Generator) -> list[str]:
    """Per input, the spread estimate (and with its report) against the attention on the index it produced."""
    q, k, v = _inputs(n, gen)
    spread, lines = STRATEGIES["spread"], []
    for name, (qi, ki) in (("random", (q, k)), ("planted", planted(n, 16, n)), ("95 %-sparse", sparse95(n, 16, n))):
        est = triton.testing.do_bench(
            lambda qi=qi, ki=ki: estimate_index(qi, ki, spread, graphs=GRAPHS), warmup=25, rep=200
        )
        rep = triton.testing.do_bench(
            lambda qi=qi, ki=ki: estimate_index(qi, ki, spread, return_report=True, graphs=GRAPHS), warmup=25, rep=200
        )
        index, report = estimate_index(qi, ki, spread, return_report=True, graphs=GRAPHS)
        att = _attention_ms(qi, ki, v, index)
        recall = report.recall.mean().item()
        lines.append(
            f"| {n} | {name} | {index.density(n).mean().item():.4f} | {recall:.3f} | {att:.2f} | {est:.2f} "
            f"({est / att:.1%}) | {rep:.2f} ({rep / att:.1%}) |"
        )
    return lines


def _profile(n: int, gen: torch.Generator) -> list[str]:
    q, k, _ = _inputs(n, gen)
    config = STRATEGIES["spread"]
    for _ in range(3):
        estimate_index(q, k, config, graphs=GRAPHS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            estimate_index(q, k, config, graphs=GRAPHS)
        torch.cuda.synchronize()
    rows = [
        (getattr(e, "device_time_total", 0) / 3 / 1e3, e.key)
        for e in prof.key_averages()
        if getattr(e, "device_time_total", 0) > 0
    ]
    rows.sort(reverse=True)
    lines = [f"\nSpread estimator at N={n}, CUDA kernels (ms per call, top 15 of {len(rows)}):\n"]
    lines += [f"- {ms:.3f} ms: {key[:110]}" for ms, key in rows[:15]]
    lines.append(f"- total: {sum(ms for ms, _ in rows):.3f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = [
        (
            f"estimators vs sparse attention — {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}"
        ),
        "",
        "| N | attention fwd+bwd ms (95 %) | "
        + " | ".join(f"{name} ms (share)" for name in STRATEGIES)
        + " | spread + recall report ms (share) | spread, planted heads ms (share) |",
        "|---|---|" + "---|" * (len(STRATEGIES) + 2),
    ]
    print("\n".join(lines), flush=True)
    gen = torch.Generator().manual_seed(0)
    for n in args.seqlens:
        lines.append(_row(n, gen))
        print(lines[-1], flush=True)
    lines += [
        "",
        "Each input's spread estimate against the attention on the index it produced:",
        "",
        (
            "| N | input | index density | observed recall | attention on it, fwd+bwd ms | spread ms (share) | "
            "spread + recall report ms (share) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for n in args.seqlens:
        lines += _own_index_rows(n, gen)
        print("\n".join(lines[-3:]), flush=True)
    lines += _profile(max(args.seqlens), gen)
    print("\n".join(lines[-17:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\ncommand: python " + " ".join(sys.argv) + "\n")


if __name__ == "__main__":
    main()
