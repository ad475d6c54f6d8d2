"""The spread estimator's GPU path at the sizes of training: its Triton kernels, its CUDA graphs, and the estimate
against the CPU's.

On CUDA the spread strategy (``ds_mtraining.estimator.spread``) takes its row statistics and evidence from the Triton
kernels of ``estimator.triton.evidence`` and runs its greedy's rounds as Triton kernels (``estimator.triton.greedy``).
Settings: ``benchmarks.strategies.STRATEGIES["spread"]`` (SparseAttentionConfig's defaults, block 128).

- Evidence kernels against the PyTorch path (``observation_logits`` -> ``row_statistics`` -> ``spread_evidence``) on
  the same device and bf16 inputs: row max and sum, block mass, column sums, column top-2, the tail rows' sums.
  Error max |x - ref| / max |ref| <= 1e-4 (both compute bf16 products exactly in fp32; only the summation order
  differs). Planted heads at 32K, random q/k at 128K.
- The Triton greedy against the PyTorch rounds on the same inputs: the same chosen columns and offsets (both sum in
  fp64), the kernels twice bit for bit, and their replay from a CUDA graph (``select`` with a ``GraphCache``; on a
  second input a stale static buffer would return the first index). Planted at 32K (two inputs), random at 128K
  (diffuse attention: every round runs up to the caps), and ``SHAPES``.
- The whole estimate replayed from its CUDA graph against the same steps launched op by op, on inputs that change
  between calls: the same index, observed recall and density (32K planted, 128K random, ``SHAPES``); the report's
  kernels (density, recall) against their PyTorch paths on the CPU at the estimated index.
- The estimate on the GPU against the estimate on the CPU (which materialises the fp32 attention) from the same bf16
  values, planted heads at 16K: mean per-head Jaccard overlap of the chosen entries >= 0.95, density within 2 %
  (near-ties may flip a pick: summation orders differ).

The evidence and greedy comparisons also run unmarked at a tiny size through the Triton interpreter on CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.cases import planted_heads
from benchmarks.strategies import STRATEGIES
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

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = STRATEGIES["spread"]
# The interpreter sorts 2 x the column cap in Python: small caps keep the tiny case to seconds.
TINY_CONFIG = CONFIG.model_copy(
    update={"estimator": CONFIG.estimator.model_copy(update={"max_columns": 32, "max_offsets": 32})}
)
cuda = pytest.mark.cuda


def with_shape(block_size: int, sink_tokens: int) -> SparseAttentionConfig:
    return SparseAttentionConfig.model_validate(
        CONFIG.model_dump() | {"block_size": block_size, "sink_tokens": sink_tokens}
    )


def inputs(kind: str, n: int, seed: int, hq: int = 16, hkv: int = 2, d: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[1, n, hq, d]``, k ``[1, n, hkv, d]`` on the device: planted heads (``hq`` of 128, GQA 8) or random; bf16
    on a GPU, fp32 on CPU (the interpreter's bf16 dot is wrong)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    if kind == "planted":
        return planted_heads(n, hq, seed, device=DEVICE, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, h, d, generator=gen).to(DEVICE, dtype) for h in (hq, hkv))


def rel_max(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def differing(a: VerticalSlashIndex, b: VerticalSlashIndex) -> int:
    """Chosen columns and offsets in one index but not the other, over all heads."""
    count = 0
    for part in ("vertical", "slash"):
        x, y = getattr(a, part), getattr(b, part)
        for row_x, row_y in zip(x.flatten(0, 1).cpu(), y.flatten(0, 1).cpu(), strict=True):
            count += len(set(row_x[row_x >= 0].tolist()) ^ set(row_y[row_y >= 0].tolist()))
    return count


@pytest.mark.parametrize(
    "kind, n, seed",
    [pytest.param("planted", 32768, 1, marks=cuda), pytest.param("random", 131072, 2, marks=cuda),
     pytest.param("planted", 512, 1, id="tiny")],
)  # fmt: skip
def test_evidence_kernels_match_pytorch(kind, n, seed):
    q, k = inputs(kind, n, seed, hq=16 if n > 512 else 8)
    scale, count = q.shape[-1] ** -0.5, CONFIG.estimator.tail_rows
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
    errors = {"row max": rel_max(row_max, want_max), "row sum": rel_max(row_sum, want_sum)}
    names = ("block mass", "column sum", "column top-2", "tail rows' sums per key and block")
    errors |= {name: rel_max(x, ref) for name, x, ref in zip(names, got, dataclasses.astuple(want), strict=True)}
    assert all(err <= 1e-4 for err in errors.values()), errors


SHAPES = [
    # N, block, Hq, Hkv, D, sink_tokens: SmolLM2-135M's heads with ds_configs/zero2.json's settings at the
    # evaluation lengths (N <= 2048 puts a multiple of 16 candidate chunks through the greedy's kernels, which
    # Triton 3.6 once failed to compile), a length that is not a multiple of the block, and block 128 at 2K.
    pytest.param(1024, 64, 9, 3, 64, 4, marks=cuda),
    pytest.param(2048, 64, 9, 3, 64, 4, marks=cuda),
    pytest.param(3000, 64, 9, 3, 64, 4, marks=cuda),
    pytest.param(4096, 64, 9, 3, 64, 4, marks=cuda),
    pytest.param(8192, 64, 9, 3, 64, 4, marks=cuda),
    pytest.param(2048, 128, 16, 2, 128, 64, marks=cuda),
]


def check_greedy(q: torch.Tensor, k: torch.Tensor, trials: int, config: SparseAttentionConfig) -> None:
    """The Triton greedy against the PyTorch rounds, against itself and against its CUDA-graph replay, on
    ``trials`` inputs (the second on, q rolled): one graph cache for all, a stale static buffer would show."""
    n, scale, bs = q.shape[1], q.shape[-1] ** -0.5, config.block_size
    settings = SpreadSettings.of(config)
    rows = spread_rows(n, config.estimator.rows, bs, q.device)
    keys = torch.arange(n, device=q.device)
    graphs = GraphCache()
    for trial in range(trials):
        q_obs = (q if trial == 0 else q.roll(4097, dims=1)).index_select(1, rows)
        row_max, row_sum = kernels.row_statistics(q_obs, k, rows, keys, scale)
        evidence = SpreadEvidence(
            *kernels.spread_evidence(q_obs, k, rows, keys, row_max, row_sum, scale, n, bs, config.estimator.exclusion)
        )
        cands = candidate_columns(evidence, rows, n, settings)
        cand_attn = candidate_attention(q_obs, k, rows, keys, cands, row_max, row_sum, scale, n)
        args = (evidence.block_mass, cands, cand_attn, rows, n, settings)
        want = spread_select(*args, backend="torch")
        got = spread_select(*args, backend="triton")
        counts = {
            "Triton vs PyTorch": differing(got, want),
            "Triton run twice": differing(got, spread_select(*args, backend="triton")),
            "CUDA-graph replay vs Triton": differing(select(*args, graphs), got),
        }
        chosen = int(want.vertical.ge(0).sum() + want.slash.ge(0).sum())
        assert not any(counts.values()), f"input {trial}: entries differing (of {chosen}): {counts}"


@pytest.mark.parametrize(
    "kind, n, seed, trials",
    [pytest.param("planted", 32768, 1, 2, marks=cuda), pytest.param("random", 131072, 2, 1, marks=cuda)],
)
def test_triton_greedy_matches_pytorch_rounds(kind, n, seed, trials):
    check_greedy(*inputs(kind, n, seed), trials, CONFIG)


@pytest.mark.parametrize("n, bs, hq, hkv, d, sinks", [s for s in SHAPES if s.values[0] % s.values[1] == 0])
def test_triton_greedy_matches_pytorch_rounds_at_small_shapes(n, bs, hq, hkv, d, sinks):
    check_greedy(*inputs("random", n, 4, hq, hkv, d), 1, with_shape(bs, sinks))  # whole blocks only: kernels direct


def test_triton_greedy_matches_pytorch_rounds_tiny():
    check_greedy(*inputs("planted", 512, 1, hq=8), 1, TINY_CONFIG)


def check_report(index: VerticalSlashIndex, rows: torch.Tensor, n: int) -> dict[str, float]:
    """The report's kernels (what ``density`` and ``index_recall`` take on CUDA) against their PyTorch paths on the
    CPU at an estimated index; the recall from random masses (only where the index reads them matters)."""
    gen = torch.Generator().manual_seed(n)
    cpu = VerticalSlashIndex(index.vertical.cpu(), index.slash.cpu(), index.block_size)
    batch, heads, kv = cpu.vertical.shape
    rows = rows.cpu()
    block_mass = torch.rand(batch, heads, rows.numel(), cpu.num_blocks(n), generator=gen)
    causal = (cpu.vertical[:, :, None, :] <= rows[:, None]) & (cpu.vertical[:, :, None, :] >= 0)
    column_attn = torch.where(causal, torch.rand(batch, heads, rows.numel(), kv, generator=gen), 0.0)
    want = index_recall(cpu, block_mass, column_attn, rows, n)
    got = index_recall(index, block_mass.cuda(), column_attn.cuda(), rows.cuda(), n).cpu()
    return {"density": rel_max(index.density(n).cpu(), cpu.density(n)), "recall": rel_max(got, want)}


def check_graphed_estimate(q: torch.Tensor, k: torch.Tensor, trials: int, config: SparseAttentionConfig) -> None:
    """``estimate_index`` replayed from one CUDA graph against the same estimate launched op by op, on ``trials``
    inputs that change between calls; the report's kernels at the first estimate."""
    n = q.shape[1]
    graphs = GraphCache()
    for trial in range(trials):
        q_t, k_t = (x.roll(4097 * trial, dims=1) for x in (q, k))
        graphed, report = estimate_index(q_t, k_t, config, return_report=True, graphs=graphs)
        direct, direct_report = estimate_index(q_t, k_t, config, return_report=True)
        assert differing(graphed, direct) == 0, f"input {trial}: the graph's index differs from op by op"
        assert rel_max(report.recall, direct_report.recall) <= 1e-6, f"input {trial}: observed recall"
        assert rel_max(report.density, direct.density(n)) <= 1e-12, f"input {trial}: report density"
        if trial == 0:
            rows = spread_rows(n, config.estimator.rows, config.block_size, q.device)
            errors = check_report(direct, rows, n)
            assert errors["density"] <= 1e-12 and errors["recall"] <= 1e-6, errors


@cuda
@pytest.mark.parametrize("kind, n, seed, trials", [("planted", 32768, 1, 3), ("random", 131072, 2, 2)])
def test_graphed_estimate_matches_op_by_op(kind, n, seed, trials):
    check_graphed_estimate(*inputs(kind, n, seed), trials, CONFIG)


@pytest.mark.parametrize("n, bs, hq, hkv, d, sinks", SHAPES)
def test_graphed_estimate_matches_op_by_op_at_small_shapes(n, bs, hq, hkv, d, sinks):
    check_graphed_estimate(*inputs("random", n, 4, hq, hkv, d), 2, with_shape(bs, sinks))


@cuda
def test_gpu_estimate_matches_cpu_estimate(n: int = 16384):
    q, k = inputs("planted", n, 3)
    gpu = estimate_index(q, k, CONFIG, graphs=GraphCache())  # as the training job runs it
    cpu = estimate_index(q.cpu().float(), k.cpu().float(), CONFIG)
    overlaps = []
    for h in range(q.shape[2]):
        sets = []
        for index in (gpu, cpu):
            cols = {("c", int(c)) for c in index.vertical[0, h].cpu() if c >= 0}
            offs = {("o", int(o)) for o in index.slash[0, h].cpu() if o >= 0}
            sets.append(cols | offs)
        overlaps.append(len(sets[0] & sets[1]) / max(1, len(sets[0] | sets[1])))
    d_gpu, d_cpu = gpu.density(n).mean().item(), cpu.density(n).mean().item()
    assert sum(overlaps) / len(overlaps) >= 0.95, overlaps
    assert abs(d_gpu - d_cpu) / d_cpu <= 0.02, (d_gpu, d_cpu)
