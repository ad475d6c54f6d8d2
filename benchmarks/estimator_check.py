"""GPU correctness of the spread estimator's CUDA path, printed as a table; exit 1 on failure.

On CUDA, the spread strategy (``ds_mtraining.estimator.spread``) takes its row statistics and evidence from the
Triton kernels of ``estimator.triton.evidence`` and runs its greedy's rounds as Triton kernels
(``estimator.triton.greedy``). Checks:

1. Evidence kernels against the PyTorch path (``observation_logits`` -> ``row_statistics`` -> ``spread_evidence``,
   run on the same GPU and the same bf16 inputs): row max, row sum, block mass, column sums, column top-2 and the
   tail rows' sums per key and query block.
   Error = max |x - ref| / max |ref|; pass <= 1e-4 (both compute bf16 products exactly in fp32; only the
   summation order differs). N = 32K (planted heads: columns, diagonals and a band) and 128K (random q/k).
2. The Triton greedy against the PyTorch rounds (``backend="torch"``) on the same GPU inputs: the same chosen
   columns and offsets (both sum in fp64; only the summation order differs), planted at 32K (two inputs) and
   random at 128K (diffuse attention: every round runs up to the caps); the kernels twice, bit for bit; and their
   replay from a CUDA graph (``select`` with a ``GraphCache``; on a second input a stale static buffer would return
   the first index).
3. The whole estimator on the GPU against the same estimator on the CPU (the CPU path materialises the fp32
   attention) from the same bf16 values, planted heads at 16K: mean per-head Jaccard overlap of the chosen
   columns and offsets >= 0.95 and density within 2 %. Near-ties may flip a pick: summation orders differ.
4. The whole estimator replayed from its CUDA graph (``estimate_index`` with a ``GraphCache``) against the same
   steps launched op by op (``estimate_index`` without one): the same index, observed recall and density, on inputs
   that change between calls, at 32K (planted) and 128K (random). The report's kernels (``sparse.triton.report``:
   density; ``estimator.triton.recall``: recall) against their PyTorch paths on the CPU at the estimated index.
5. Small shapes (``SHAPES``: SmolLM2-135M's 9/3 heads of 64 at 1K-8K with block 64, and block 128 at 2K): checks 2
   and 4 again, random q/k, so every kernel is compiled and run at the shapes the evaluations use.

Usage: python benchmarks/estimator_check.py [--out FILE]   (about a minute on an H200)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.estimator import GraphCache, estimate_index
from ds_mtraining.estimator.observe import normalise, observation_logits, row_statistics
from ds_mtraining.estimator.spread.candidates import candidate_attention, candidate_columns
from ds_mtraining.estimator.spread.evidence import SpreadEvidence, spread_evidence
from ds_mtraining.estimator.spread.greedy import select, spread_select
from ds_mtraining.estimator.spread.report import index_recall
from ds_mtraining.estimator.spread.rows import spread_rows, tail_rows
from ds_mtraining.estimator.spread.settings import SpreadSettings
from ds_mtraining.estimator.triton import evidence as kernels
from ds_mtraining.sparse.index import VerticalSlashIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimator_bench import STRATEGIES, planted

CONFIG = STRATEGIES["spread"]  # SparseAttentionConfig's defaults, block 128 (estimator_bench)
ROWS: list[str] = []
FAILED: list[str] = []


def record(case: str, name: str, err: float, limit: float, better: str = "<=") -> None:
    ok = err <= limit if better == "<=" else err >= limit
    ROWS.append(f"| {case} | {name} | {err:.3e} | {better} {limit:.1e} | {'ok' if ok else 'FAIL'} |")
    print(ROWS[-1], flush=True)
    if not ok:
        FAILED.append(f"{case} {name}")


def rel_max(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_evidence(case: str, q: torch.Tensor, k: torch.Tensor) -> None:
    n, scale = q.shape[1], q.shape[-1] ** -0.5
    count = CONFIG.estimator.tail_rows
    rows = torch.cat(
        [spread_rows(n, CONFIG.estimator.rows, CONFIG.block_size, q.device), tail_rows(n, count, q.device)]
    )
    keys = torch.arange(n, device=q.device)
    q_obs = q.index_select(1, rows)
    logits = observation_logits(q_obs, k, rows, keys, scale)
    want_max, want_sum = row_statistics(logits)
    want = spread_evidence(normalise(logits, want_max, want_sum), rows, keys, n, CONFIG.block_size, 256, count)
    del logits
    row_max, row_sum = kernels.row_statistics(q_obs, k, rows, keys, scale)
    got = kernels.spread_evidence(q_obs, k, rows, keys, want_max, want_sum, scale, n, CONFIG.block_size, 256, count)
    record(case, "row max", rel_max(row_max, want_max), 1e-4)
    record(case, "row sum", rel_max(row_sum, want_sum), 1e-4)
    names = ("block mass", "column sum", "column top-2", "tail rows' sums per key and block")
    for name, x, ref in zip(names, got, dataclasses.astuple(want), strict=True):
        record(case, name, rel_max(x, ref), 1e-4)


def _differing(a, b) -> int:
    """Chosen columns and offsets in one index but not the other, over all heads."""
    count = 0
    for part in ("vertical", "slash"):
        x, y = getattr(a, part), getattr(b, part)
        for row_x, row_y in zip(x.flatten(0, 1).cpu(), y.flatten(0, 1).cpu(), strict=True):
            count += len(set(row_x[row_x >= 0].tolist()) ^ set(row_y[row_y >= 0].tolist()))
    return count


def check_greedy(case: str, q: torch.Tensor, k: torch.Tensor, trials: int, config=CONFIG) -> None:
    n, scale, bs = q.shape[1], q.shape[-1] ** -0.5, config.block_size
    settings = SpreadSettings.of(config)
    rows = spread_rows(n, config.estimator.rows, bs, q.device)
    keys = torch.arange(n, device=q.device)
    graphs = GraphCache()  # one cache for every trial: a stale static buffer would return an earlier index
    for trial in range(trials):
        q_t = q if trial == 0 else q.roll(4097, dims=1)
        q_obs = q_t.index_select(1, rows)
        row_max, row_sum = kernels.row_statistics(q_obs, k, rows, keys, scale)
        evidence = SpreadEvidence(
            *kernels.spread_evidence(q_obs, k, rows, keys, row_max, row_sum, scale, n, bs, config.estimator.exclusion)
        )
        cands = candidate_columns(evidence, rows, n, settings)
        cand_attn = candidate_attention(q_obs, k, rows, keys, cands, row_max, row_sum, scale, n)
        inputs = (evidence.block_mass, cands, cand_attn, rows, n, settings)
        want = spread_select(*inputs, backend="torch")
        got = spread_select(*inputs, backend="triton")
        again = spread_select(*inputs, backend="triton")
        graphed = select(*inputs, graphs)
        chosen = int(want.vertical.ge(0).sum() + want.slash.ge(0).sum())
        record(
            f"{case} input {trial}",
            f"Triton vs PyTorch greedy: entries differing (of {chosen})",
            _differing(got, want),
            0,
        )
        record(f"{case} input {trial}", "Triton greedy run twice: entries differing", _differing(got, again), 0)
        record(
            f"{case} input {trial}",
            "CUDA-graph replay vs Triton greedy: entries differing",
            _differing(graphed, got),
            0,
        )


def check_graphed_estimator(case: str, q: torch.Tensor, k: torch.Tensor, trials: int, config=CONFIG) -> None:
    """``estimate_index`` (the whole estimate replayed from one CUDA graph) against the same estimate launched op by
    op (no ``GraphCache``), on inputs that change between calls (a stale static buffer would show)."""
    n = q.shape[1]
    rows = spread_rows(n, config.estimator.rows, config.block_size, q.device)
    graphs = GraphCache()
    for trial in range(trials):
        q_t, k_t = (x.roll(4097 * trial, dims=1) for x in (q, k))
        graphed, report = estimate_index(q_t, k_t, config, return_report=True, graphs=graphs)
        direct, direct_report = estimate_index(q_t, k_t, config, return_report=True)
        recall = direct_report.recall
        chosen = int(direct.vertical.ge(0).sum() + direct.slash.ge(0).sum())
        case_t = f"{case} input {trial}"
        record(case_t, f"estimator graph vs op by op: entries differing (of {chosen})", _differing(graphed, direct), 0)
        record(case_t, "estimator graph vs op by op: observed recall", rel_max(report.recall, recall), 1e-6)
        record(case_t, "report density graph vs op by op", rel_max(report.density, direct.density(n)), 1e-12)
        if trial == 0:
            check_report(case, direct, rows, n)


def check_report(case: str, index: VerticalSlashIndex, rows: torch.Tensor, n: int) -> None:
    """The report's kernels (``sparse.triton.report``, what ``density`` and ``index_recall`` take on CUDA) against
    their PyTorch paths on the CPU, at an estimated index; the recall from random masses (its inputs' values do
    not matter to the check, only where the index reads them)."""
    gen = torch.Generator().manual_seed(n)
    cpu = VerticalSlashIndex(index.vertical.cpu(), index.slash.cpu(), index.block_size)
    record(case, "report density: kernel vs PyTorch (CPU)", rel_max(index.density(n).cpu(), cpu.density(n)), 1e-12)
    batch, heads, kv = cpu.vertical.shape
    rows = rows.cpu()
    block_mass = torch.rand(batch, heads, rows.numel(), cpu.num_blocks(n), generator=gen)
    causal = (cpu.vertical[:, :, None, :] <= rows[:, None]) & (cpu.vertical[:, :, None, :] >= 0)
    column_attn = torch.where(causal, torch.rand(batch, heads, rows.numel(), kv, generator=gen), 0.0)
    want = index_recall(cpu, block_mass, column_attn, rows, n)
    got = index_recall(index, block_mass.cuda(), column_attn.cuda(), rows.cuda(), n).cpu()
    record(case, "report recall: kernel vs PyTorch (CPU), random masses", rel_max(got, want), 1e-6)


def check_cpu_vs_gpu(n: int, seed: int) -> None:
    q, k = planted(n, 16, seed)
    gpu = estimate_index(q, k, CONFIG, graphs=GraphCache())  # as the training job runs it
    cpu = estimate_index(q.cpu().float(), k.cpu().float(), CONFIG)
    overlaps = []
    for h in range(16):
        sets = []
        for index in (gpu, cpu):
            cols = {("c", int(c)) for c in index.vertical[0, h].cpu() if c >= 0}
            offs = {("o", int(o)) for o in index.slash[0, h].cpu() if o >= 0}
            sets.append(cols | offs)
        overlaps.append(len(sets[0] & sets[1]) / max(1, len(sets[0] | sets[1])))
    case = f"planted N={n}"
    record(case, "mean Jaccard of chosen entries", sum(overlaps) / len(overlaps), 0.95, ">=")
    d_gpu, d_cpu = gpu.density(n).mean().item(), cpu.density(n).mean().item()
    record(case, f"density gap (GPU {d_gpu:.4f}, CPU {d_cpu:.4f})", abs(d_gpu - d_cpu) / d_cpu, 0.02)


SHAPES = [
    # N, block, Hq, Hkv, D, sink_tokens: SmolLM2-135M's heads with ds_configs/zero2.json's settings at the
    # evaluation lengths (N <= 2048 puts a multiple of 16 candidate chunks through the greedy's kernels, which
    # Triton 3.6 once failed to compile), a length that is not a multiple of the block, and block 128 at 2K.
    (1024, 64, 9, 3, 64, 4),
    (2048, 64, 9, 3, 64, 4),
    (3000, 64, 9, 3, 64, 4),
    (4096, 64, 9, 3, 64, 4),
    (8192, 64, 9, 3, 64, 4),
    (2048, 128, 16, 2, 128, 64),
]


def check_shapes() -> None:
    """The whole estimator (compiled for each shape) and its greedy against the PyTorch rounds at small shapes."""
    gen = torch.Generator().manual_seed(4)
    for n, bs, hq, hkv, d, sinks in SHAPES:
        config = SparseAttentionConfig.model_validate(CONFIG.model_dump() | {"block_size": bs, "sink_tokens": sinks})
        q = torch.randn(1, n, hq, d, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(1, n, hkv, d, generator=gen).to("cuda", torch.bfloat16)
        case = f"N={n} block {bs}, {hq}/{hkv} heads, D {d}"
        if n % bs == 0:  # the greedy check feeds the kernels directly: whole blocks only
            check_greedy(case, q, k, trials=1, config=config)
        check_graphed_estimator(case, q, k, trials=2, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ROWS.extend(["| case | check | value | limit | |", "|---|---|---|---|---|"])
    q, k = planted(32768, 16, seed=1)
    check_evidence("planted N=32768", q, k)
    check_greedy("planted N=32768", q, k, trials=2)
    check_graphed_estimator("planted N=32768", q, k, trials=3)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 131072, 16, 128, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(1, 131072, 2, 128, generator=gen).to("cuda", torch.bfloat16)
    check_evidence("random N=131072", q, k)
    check_greedy("random N=131072", q, k, trials=1)
    check_graphed_estimator("random N=131072", q, k, trials=2)
    del q, k
    check_cpu_vs_gpu(16384, seed=3)
    check_shapes()
    summary = f"{len(ROWS) - 2 - len(FAILED)} of {len(ROWS) - 2} checks pass" + (
        f"; FAILED: {', '.join(FAILED)}" if FAILED else ""
    )
    print(summary, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(ROWS) + f"\n\n{summary}\n\ncommand: python " + " ".join(sys.argv) + "\n")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
