"""Sparse ring attention on several GPUs (NCCL): distributed correctness, then weak scaling and measured imbalance.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/multi_gpu.py --out DIR [--skip-scaling]
    torchrun --nproc_per_node 2 benchmarks/multi_gpu.py --quick --out /tmp/mg      (CPU, gloo, fp32, seconds)

Backend NCCL when CUDA is available (device ``cuda:LOCAL_RANK``), gloo on CPU. NVLink multicast (NVLS) is left
off: ``NCCL_NVLS_ENABLE`` is set to 0 unless the environment sets it. Rank 0 writes ``DIR/multi_gpu.md``,
rewritten after every row so a run cut short still leaves its tables; the exit status is 1 if a check failed.
Imports nothing that needs pydantic, deepspeed or transformers (indices are planted, not estimated).

1. Correctness, W = world ranks, bf16 on CUDA (fp32 on CPU). Every rank builds the whole problem from a seed
   (B=2, N=8000 — not a multiple of W·64, so the layouts pad —, Hq=16, Hkv=2, D=128, block 64, a planted
   index of density ~0.1) and compares its rows of out / lse and its shards of dq / dk / dv with the one-GPU
   ``vertical_slash_attention`` on the unsharded tensors and the same index (Triton on CUDA; for the dense
   ring, index None: SDPA), the padding rows excluded. Cases: flat ring, striped layout with gathered columns
   (the default) and per-step columns, zigzag, dense ring (zigzag, index None); hierarchical ring with
   ``inner_size=1`` (each rank a "node": the outer ring carries every transfer); Ulysses U = world with
   Hkv = 2 (heads split) and Hkv = 1 (KV heads replicated). Errors over all ranks: max |err|, max |err| /
   max |ref| and ||err|| / ||ref|| (Frobenius). Pass (bf16): max |err| / max |ref| <= 2e-2 and Frobenius
   <= 1e-2. Why: the Triton reference itself is within ~2.5e-3 (cap 5e-3) of a float64 computation
   (``benchmarks/gpu_check.py``), the ring runs the same kernels on each shard pair, merges in fp32 and rounds
   its output (and each step's gradients) to bf16 (2^-9 relative per element); a wrong tile or column gives
   errors of order 1 on the rows it touches.
   fp32 (CPU): both sides run the same PyTorch path, so only summation order differs: 1e-4 and 1e-5.

2. Weak scaling (unless ``--skip-scaling``): B=1, Hq=16, Hkv=2, D=128, fixed tokens per GPU (32K, 64K),
   N = W x tokens for W = 1 and W = world. Index: the planted pattern of docs/design.md at 95 % sparsity
   (``ds_mtraining.sparse.planted``) with its local band (N/64 tokens) and random columns (960 per 128K)
   scaled with N, so the density stays ~0.05 at every N — at 128K it is exactly the docs/design.md pattern.
   Methods: the ring (striped + gathered columns, striped + per-step columns, zigzag, dense zigzag ring) and,
   at W = 1, the single-device kernels (``vertical_slash_attention``: Triton sparse, SDPA dense). The W = 1
   cases run on every rank at once, each on its own GPU (rings on a one-rank group per rank), so no GPU idles.
   Timing: CUDA events around forward and forward + backward, ``--warmup`` then ``--iters`` iterations, per
   iteration the slowest rank, median reported. One more iteration records each ring step's compute
   (``RingTimes``; it synchronises around steps, so it is not in the timings) for the measured imbalance,
   shown next to the work model's prediction for the same index and layout (``parallel.work.ring_work``;
   ``sim.gathered_columns_work`` for the gathered-column schedule). "µs / tile" divides the time by the
   busiest rank's modelled tiles (64x64 tiles plus column work): the per-GPU throughput at each W.
   The ring's steps run the Triton kernels on CUDA (tile maps place each shard in the global sequence) and
   the PyTorch path on CPU; the gathered-column pass is PyTorch on both. ``--budget-s`` bounds the scaling section: a case whose
   time, extrapolated from its smaller size (x4 per doubling of tokens per GPU), does not fit what is left
   is skipped and listed as such; a case that runs gets fewer iterations (at least one) when time runs short.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the device machine runs a checkout in which the package is not pip-installed

from ring_balance import _cpu_name  # benchmarks/ is on sys.path: the script's own directory

from ds_mtraining.parallel.comm import RingGroups, new_ring_groups
from ds_mtraining.parallel.layout import Layout, LayoutKind, make_layout
from ds_mtraining.parallel.mesh import Mesh, MeshShape
from ds_mtraining.parallel.ring import RingTimes, gather_step_times, sparse_ring_attention
from ds_mtraining.parallel.ulysses import gather_heads, scatter_heads
from ds_mtraining.parallel.work import RingWork, StepLoadMetrics, ring_work
from ds_mtraining.sim import gathered_columns_work
from ds_mtraining.sparse import VerticalSlashIndex, vertical_slash_attention
from ds_mtraining.sparse.attention import kernel_backend
from ds_mtraining.sparse.planted import planted_index

BLOCK = 64
Columns = Literal["gathered", "per_step"]


@dataclass(frozen=True)
class Shape:
    """Attention shape of one section: q ``[batch, seqlen, heads, dim]``, k/v ``[batch, seqlen, kv_heads, dim]``."""

    batch: int
    heads: int
    kv_heads: int
    dim: int


@dataclass(frozen=True)
class Settings:
    """Sizes of a run: full (GPU) or ``--quick`` (CPU smoke test)."""

    check: Shape
    check_len: int
    check_density: float
    scale: Shape
    tokens_per_gpu: tuple[int, ...]
    scale_density: float


FULL = Settings(Shape(2, 16, 2, 128), 8000, 0.1, Shape(1, 16, 2, 128), (32768, 65536), 0.05)
QUICK = Settings(Shape(2, 4, 2, 32), 1000, 0.3, Shape(1, 4, 2, 32), (256, 512), 0.05)


class Report:
    """Markdown lines, printed by rank 0 as they come and rewritten to ``path`` after each addition."""

    def __init__(self, path: Path | None):
        self.path, self.lines = path, []

    def add(self, *lines: str) -> None:
        if self.path is None:
            return
        print("\n".join(lines), flush=True)
        self.lines += lines
        self.path.write_text("\n".join(self.lines) + "\n")


class Clock:
    """Marks on the device timeline: CUDA events on a GPU (no host sync inside the timed region), wall time on
    CPU; :meth:`intervals` gives the ms between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def planted(shape: Shape, seqlen: int, density: float, seed: int, device: torch.device) -> VerticalSlashIndex:
    """docs/design.md's planted index with its local band (``seqlen / 64`` tokens) and random columns (960 per 128K
    tokens) scaled to ``seqlen``, so that ``density`` is reached at every length (the unscaled pattern alone
    is 15 % dense at 32K); ``[B, Hq, ·]`` on ``device``, the same on every rank for the same seed."""
    return planted_index(
        shape.batch,
        shape.heads,
        seqlen,
        BLOCK,
        density=density,
        sinks=min(64, seqlen // BLOCK),
        columns=max(8, seqlen * 960 // 131072),
        local_tokens=max(2 * BLOCK, seqlen // 64),
        generator=torch.Generator().manual_seed(seed),
        device=device,
    )


def agree_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks (e.g. the slowest rank's time): the same list on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# --------------------------------------------------------------------------------------------- correctness


@dataclass(frozen=True)
class Tolerance:
    """Pass limits: ``max |err| / max |ref|`` and ``||err|| / ||ref||`` over all ranks' rows."""

    max_rel: float
    fro_rel: float


TOLERANCE = {torch.bfloat16: Tolerance(2e-2, 1e-2), torch.float32: Tolerance(1e-4, 1e-5)}


def compare(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[str, bool]:
    """Table cells comparing this rank's ``got`` with ``ref`` (same shape), statistics over all ranks (a
    collective); non-finite values in ``got`` fail."""
    err = got.double() - ref.double()
    finite = torch.isfinite(err)
    sums = torch.stack([err.where(finite, 0.0).square().sum(), ref.double().square().sum(), (~finite).sum()])
    maxes = torch.stack([err.abs().where(finite, 0.0).max(), ref.double().abs().max()])
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    max_abs, ref_max = maxes.tolist()
    err_sq, ref_sq, non_finite = sums.tolist()
    max_rel, fro_rel = max_abs / max(ref_max, 1e-30), math.sqrt(err_sq / max(ref_sq, 1e-300))
    ok = non_finite == 0 and max_rel <= tol.max_rel and fro_rel <= tol.fro_rel
    bad = f", {int(non_finite)} non-finite" if non_finite else ""
    cells = f"{max_abs:.3e} | {max_rel:.3e} | {fro_rel:.3e}{bad} | {tol.max_rel:.0e} / {tol.fro_rel:.0e}"
    return cells, ok


def forward_backward(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor], dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """``fn`` on fresh leaf copies of ``inputs``: (out, lse or None, gradients of ``out · dout`` w.r.t. inputs)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    result = fn(*leaves)
    out, lse = result if isinstance(result, tuple) else (result, None)
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout)


@dataclass(frozen=True)
class Problem:
    """One correctness problem on every rank: q ``[B, N, Hq, D]``, k/v ``[B, N, Hkv, D]``, dout like q, and the
    one-GPU reference (out, lse or None, (dq, dk, dv)) on the unsharded tensors."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    index: VerticalSlashIndex | None
    ref: tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]


def make_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, index: VerticalSlashIndex | None
) -> Problem:
    """Attach the one-GPU reference: ``vertical_slash_attention`` (Triton on CUDA; SDPA when ``index`` is None)."""
    if index is None:
        ref = forward_backward(lambda *x: vertical_slash_attention(*x, None), [q, k, v], dout)
    else:
        ref = forward_backward(lambda *x: vertical_slash_attention(*x, index, return_lse=True), [q, k, v], dout)
    return Problem(q, k, v, dout, index, ref)


def check_sharded(
    report: Report,
    case: str,
    problem: Problem,
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    cut: Callable[[torch.Tensor, int], torch.Tensor],
    positions: torch.Tensor,
    tol: Tolerance,
) -> bool:
    """Run ``fn`` on this rank's shards (``cut(x, dim)`` of the global tensors) and compare out, lse, dq, dk, dv
    with the reference cut the same way; ``positions`` (global position of each local row) drops padding rows
    from the row-wise tensors (padding keys get zero gradients on both sides, so dk / dv are compared whole)."""
    got = forward_backward(fn, [cut(x, 1) for x in (problem.q, problem.k, problem.v)], cut(problem.dout, 1))
    real = (positions < problem.q.shape[1]).to(problem.q.device)
    pairs = [("out", got[0][:, real], cut(problem.ref[0], 1)[:, real])]
    if problem.ref[1] is not None and got[1] is not None:
        pairs.append(("lse", got[1][..., real], cut(problem.ref[1], 2)[..., real]))
    pairs.append(("dq", got[2][0][:, real], cut(problem.ref[2][0], 1)[:, real]))
    pairs += [(name, g, cut(r, 1)) for name, g, r in zip(("dk", "dv"), got[2][1:], problem.ref[2][1:])]
    passed = True
    for name, g, r in pairs:
        cells, ok = compare(g, r, tol)
        report.add(f"| {case} | {name} | {cells} | {'ok' if ok else 'FAIL'} |")
        passed &= ok
    return passed


def ulysses_attention(index: VerticalSlashIndex, mesh: Mesh, layout: Layout) -> Callable[..., torch.Tensor]:
    """Ulysses over ``mesh.ulysses`` with no ring (R = 1), as ``MTrainingAttention.attend`` does it: all-to-all to
    the whole sequence for ``Hq / U`` heads, single-device sparse attention with those heads' rows of the
    index, all-to-all back. Takes and returns this rank's ``[B, n, H, D]`` chunk."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = scatter_heads(q, k, v, group=mesh.ulysses)
        heads, n = q.shape[2], layout.seqlen
        h0 = mesh.ulysses_rank * heads  # rank u holds query heads u * Hq / U ... (scatter_heads)
        mine = VerticalSlashIndex(
            index.vertical[:, h0 : h0 + heads].contiguous(), index.slash[:, h0 : h0 + heads].contiguous(), BLOCK
        )
        out = vertical_slash_attention(q[:, :n], k[:, :n], v[:, :n], mine)
        out = torch.cat([out, out.new_zeros(out.shape[0], q.shape[1] - n, *out.shape[2:])], dim=1)  # layout padding
        return gather_heads(out, group=mesh.ulysses)

    return attend


def correctness(
    report: Report,
    settings: Settings,
    rings: dict[str, RingGroups],
    mesh: Mesh,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> bool:
    """Section 1 (see the module docstring); True when every check passed."""
    shape, n, world = settings.check, settings.check_len, dist.get_world_size()
    tol = TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(seed)
    # Built on the CPU from one seed so that every rank holds bit-identical inputs.
    q, k, v, dout = (
        torch.randn(shape.batch, n, h, shape.dim, generator=gen).to(device, dtype)
        for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
    )
    index = planted(shape, n, settings.check_density, seed, device)
    density = float(index.density(n).mean())
    report.add(
        "",
        "## 1. Distributed correctness",
        "",
        (
            f"B={shape.batch}, N={n}, Hq={shape.heads}, Hkv={shape.kv_heads}, D={shape.dim}, block {BLOCK}, "
            f"{str(dtype)[6:]}; planted index, density {density:.4f}; reference: one-GPU `vertical_slash_attention` "
            "on the unsharded tensors (dense ring: SDPA). Errors over all ranks' real rows; limits: max |err| / "
            "max |ref| and Frobenius."
        ),
        "",
        "| case | tensor | max abs err | max abs err / max abs ref | rel. Frobenius err | limits | result |",
        "|---|---|---|---|---|---|---|",
    )
    sparse, dense = make_problem(q, k, v, dout, index), make_problem(q, k, v, dout, None)
    cases: list[tuple[str, Problem, str, LayoutKind, Columns]] = [
        (f"ring W={world}, striped, gathered columns", sparse, "flat", "striped", "gathered"),
        (f"ring W={world}, striped, per-step columns", sparse, "flat", "striped", "per_step"),
        (f"ring W={world}, zigzag, gathered columns", sparse, "flat", "zigzag", "gathered"),
        (f"dense ring W={world}, zigzag", dense, "flat", "zigzag", "gathered"),
        (f"hierarchical ring {world} nodes x 1, striped, gathered columns", sparse, "hier", "striped", "gathered"),
    ]
    passed = True
    for case, problem, ring, kind, columns in cases:
        groups = rings[ring]
        layout = make_layout(kind, world, n, block_size=BLOCK)

        def ring_fn(*x: torch.Tensor, layout=layout, groups=groups, problem=problem, columns=columns):
            return sparse_ring_attention(
                *x, problem.index, groups=groups, layout=layout, columns=columns, return_lse=True
            )

        passed &= check_sharded(
            report,
            case,
            problem,
            ring_fn,
            lambda x, dim, layout=layout, groups=groups: layout.shard(x, groups.rank, dim),
            layout.positions(groups.rank),
            tol,
        )
    layout = mesh.shape.layout(n, kind="striped", block_size=BLOCK, stripe=None)
    positions = layout.positions(0).chunk(mesh.ulysses_size)[mesh.ulysses_rank]
    for kv_heads in (shape.kv_heads, 1):
        problem = (
            sparse
            if kv_heads == shape.kv_heads
            else make_problem(q, k[:, :, :1].contiguous(), v[:, :, :1].contiguous(), dout, index)
        )
        passed &= check_sharded(
            report,
            f"Ulysses U={world} (Hkv={kv_heads}{', replicated' if kv_heads < world else ''})",
            problem,
            ulysses_attention(index, mesh, layout),
            lambda x, dim: mesh.shard(x, layout, dim),
            positions,
            tol,
        )
    return passed


# --------------------------------------------------------------------------------------------- scaling


@dataclass(frozen=True)
class Method:
    """One way to run attention in the scaling section.

    Attributes:
        name: table label.
        ring: True for ``sparse_ring_attention`` (W = 1 or world), False for the single-device kernel (W = 1).
        sparse: the planted index, or dense causal attention (index None).
        layout, columns: the ring's layout and column schedule.
    """

    name: str
    ring: bool
    sparse: bool
    layout: LayoutKind = "striped"
    columns: Columns = "gathered"

    def model(self, index: VerticalSlashIndex, layout: Layout) -> RingWork:
        """The work model's tiles per (rank, step) for this method on ``layout``."""
        if not self.sparse:
            return ring_work(VerticalSlashIndex.dense(index.batch, index.heads, layout.seqlen, BLOCK), layout)
        if self.columns == "gathered" and layout.world > 1:
            return gathered_columns_work(index, layout)
        return ring_work(index, layout)


SINGLE = [
    Method("vertical_slash_attention (single-device kernel)", ring=False, sparse=True),
    Method("SDPA dense (single-device kernel)", ring=False, sparse=False),
    Method("sparse ring", ring=True, sparse=True),
    Method("dense ring", ring=True, sparse=False),
]
MULTI = [
    Method("sparse ring, striped, gathered columns", ring=True, sparse=True),
    Method("sparse ring, zigzag, gathered columns", ring=True, sparse=True, layout="zigzag"),
    Method("sparse ring, striped, per-step columns", ring=True, sparse=True, columns="per_step"),
    Method("dense ring, zigzag", ring=True, sparse=False, layout="zigzag"),
]


@dataclass
class Budget:
    """Seconds left for the scaling section, and each (method, W)'s last iteration time for extrapolation."""

    end: float
    device: torch.device
    seen: dict[tuple[str, int], tuple[int, float]]

    def left(self) -> float:
        """Seconds left, the same on every rank (the least any rank has)."""
        return -agree_max([time.perf_counter() - self.end], self.device)[0]

    def estimate(self, method: Method, world: int, tokens: int) -> float | None:
        """Extrapolated seconds per iteration: the ring's per-rank work grows with (tokens per GPU)^2 at fixed
        density and W (local tiles x slash offsets), so x4 per doubling; None when never run."""
        if (method.name, world) not in self.seen:
            return None
        seen_tokens, seconds = self.seen[(method.name, world)]
        return seconds * (tokens / seen_tokens) ** 2


def time_case(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dout: torch.Tensor, iters: int, device: torch.device
) -> list[tuple[float, float]]:
    """(forward ms, forward + backward ms) of ``iters`` iterations, each the slowest rank's (ranks start together)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    times = []
    for _ in range(iters):
        dist.barrier()
        clock = Clock(device)
        clock.mark()
        out = fn(*leaves)
        clock.mark()
        torch.autograd.grad(out, leaves, dout)
        clock.mark()
        fwd, bwd = clock.intervals()
        times.append((fwd, fwd + bwd))
    flat = agree_max([t for pair in times for t in pair], device)
    return list(zip(flat[::2], flat[1::2]))


def label(tokens: int) -> str:
    """``32768`` -> ``32K``; sizes that are not whole K as they are."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def load_cells(load: StepLoadMetrics) -> str:
    """The four imbalance metrics of ``load`` as table cells."""
    return (
        f"{load.worker_imbalance:.3f} | {load.step_worker_imbalance:.3f} | {load.step_imbalance:.3f} | "
        f"{load.ring_efficiency:.3f}"
    )


def per_rank(work: torch.Tensor, unit: str) -> str:
    """``[W, S]`` as ``r0: a / b; r1: c / d`` (rank: its steps in order)."""
    return "; ".join(f"r{r}: " + " / ".join(f"{x:.4g}" for x in row.tolist()) for r, row in enumerate(work)) + unit


def scaling(
    report: Report,
    settings: Settings,
    rings: dict[str, RingGroups],
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> None:
    """Section 2 (see the module docstring)."""
    shape, world = settings.scale, dist.get_world_size()
    budget = Budget(time.perf_counter() + args.budget_s, device, {})
    report.add(
        "",
        "## 2. Weak scaling: sparse ring attention forward + backward",
        "",
        (
            f"B={shape.batch}, Hq={shape.heads}, Hkv={shape.kv_heads}, D={shape.dim}, block {BLOCK}, {str(dtype)[6:]}; "
            f"planted index at {1 - settings.scale_density:.0%} sparsity (local band and columns scaled with N). "
            f"Ring kernels: `{kernel_backend(torch.empty(0, device=device)).__name__}` (this device's). "
            f"Median of the iterations after {args.warmup} warm-up; per iteration the slowest rank. W=1 "
            "cases run on every GPU at once, one problem each. Tiles: the work model's busiest rank (64x64 tiles + column "
            "work); µs / tile = fwd+bwd time / tiles."
        ),
        "",
        "| tokens/GPU | GPUs | N | method | density | iters | fwd ms | fwd+bwd ms | tiles (busiest rank) | µs / tile |",
        "|---|---|---|---|---|---|---|---|---|---|",
    )
    imbalance = [
        "",
        f"### Load imbalance at W={world}: work model (tiles) vs measured step compute (ms)",
        "",
        (
            "Measured: one extra iteration with `RingTimes` (synchronises around each step), gathered over the "
            "ring with `gather_step_times`. Per rank, the compute of each step in order. Reading it: the model "
            "counts attended tiles, which is what the Triton kernels (CUDA) pay for; the PyTorch path (CPU) "
            "gathers every slash offset of a query tile at every step and masks the ones whose keys are not in "
            "the shard in hand, so there a step costs about (local query tiles x offsets) whatever it attends."
        ),
        "",
        "| tokens/GPU | method | source | worker imb. | per-step worker imb. | step imb. | ring eff. | per rank, per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tokens in settings.tokens_per_gpu:
        for w, methods in ((1, SINGLE), (world, MULTI)):
            seqlen = w * tokens
            index = planted(shape, seqlen, settings.scale_density, args.seed, device)
            density = float(index.density(seqlen).mean())
            gen = torch.Generator(device).manual_seed(args.seed)
            q, k, v, dout = (
                torch.randn(shape.batch, seqlen, h, shape.dim, generator=gen, device=device, dtype=dtype)
                for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
            )
            groups = rings["single"] if w == 1 else rings["flat"]
            for method in methods:
                layout = make_layout(method.layout, w, seqlen, block_size=BLOCK)
                model = method.model(index, layout)
                tiles = float(model.work.sum(1).max())
                row = f"| {label(tokens)} | {w} | {seqlen} | {method.name} | {density if method.sparse else 1.0:.4f} | "
                profiled = int(method.ring and w > 1)  # the extra iteration that records step times
                estimate, left = budget.estimate(method, w, tokens), budget.left()
                if estimate is not None and estimate * (args.warmup + args.iters + profiled) > left:
                    report.add(row + f"skipped: ~{estimate:.3g} s per iteration, {max(left, 0):.0f} s left | | | | |")
                    continue
                sparse_index = index if method.sparse else None
                if method.ring:
                    mine = [layout.shard(x, groups.rank) for x in (q, k, v)]
                    d_mine = layout.shard(dout, groups.rank)

                    def fn(*x, method=method, layout=layout, groups=groups, sparse_index=sparse_index, times=None):
                        return sparse_ring_attention(
                            *x, sparse_index, groups=groups, layout=layout, columns=method.columns, times=times
                        )
                else:
                    mine, d_mine = [q, k, v], dout

                    def fn(*x, sparse_index=sparse_index):
                        return vertical_slash_attention(*x, sparse_index)

                warm = time_case(fn, mine, d_mine, args.warmup, device)
                per_iter = max(t for _, t in warm) / 1e3 if warm else None
                iters = args.iters
                if per_iter is not None:
                    fits = int(budget.left() / per_iter) - profiled
                    iters = max(1, min(args.iters, fits))
                measured = time_case(fn, mine, d_mine, iters, device)
                fwd = statistics.median(t for t, _ in measured)
                total = statistics.median(t for _, t in measured)
                budget.seen[(method.name, w)] = (tokens, total / 1e3)
                report.add(row + f"{iters} | {fwd:.1f} | {total:.1f} | {tiles:.0f} | {1e3 * total / tiles:.2f} |")
                if profiled:
                    times = RingTimes()
                    forward_backward(lambda *x, fn=fn, times=times: fn(*x, times=times), mine, d_mine)
                    forward, backward = gather_step_times(times, rings["flat"])
                    start = f"| {label(tokens)} | {method.name} | "
                    imbalance += [
                        start + f"model (tiles) | {load_cells(model)} | {per_rank(model.work, ' tiles')} |",
                        start + f"measured fwd | {load_cells(forward)} | {per_rank(forward.work, ' ms')} |",
                        start + f"measured bwd | {load_cells(backward)} | {per_rank(backward.work, ' ms')} |",
                    ]
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add(*imbalance)


# --------------------------------------------------------------------------------------------- main


def header(report: Report, device: torch.device, world: int) -> None:
    """Date, machine, versions, command and environment."""
    if device.type == "cuda":
        import triton

        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        machine = f"{world} x {torch.cuda.get_device_name(device)}"
        versions = f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {nccl}, Triton {triton.__version__}"
    else:
        machine = f"{_cpu_name()} ({torch.get_num_threads()} thread per rank), no GPU"
        versions = f"torch {torch.__version__}, gloo"
    report.add(
        f"# Multi-GPU sparse ring attention — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"Machine: {machine}; {versions}; backend {dist.get_backend()}, world {world}.",
        f"Command: `torchrun --nproc_per_node {world} {' '.join(sys.argv)}`",
        f"Environment: NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} (NVLink multicast off).",
    )
    if device.type == "cuda":  # the gathered-column pass computes in fp32 on PyTorch: TF32 changes its speed
        report.add(f"fp32 matmuls use TF32: {torch.backends.cuda.matmul.allow_tf32} (PyTorch's default is False).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for multi_gpu.md (rank 0)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test with gloo")
    parser.add_argument("--skip-scaling", action="store_true", help="correctness only")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per case (fewer if the budget says)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="seconds for the scaling section")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (read by NCCL at communicator init)
    torch.set_num_threads(1)  # ranks share the host's cores (torchrun sets OMP_NUM_THREADS=1 as well)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    world, rank = dist.get_world_size(), dist.get_rank()
    settings = QUICK if args.quick else FULL
    out_dir = Path(args.out)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir / "multi_gpu.md" if rank == 0 else None)
    header(report, device, world)

    # Every group is created by every rank in the same order (group creation is collective).
    singles = [dist.new_group([r]) for r in range(world)]
    rings = {
        "flat": new_ring_groups(list(range(world))),
        "hier": new_ring_groups(list(range(world)), inner_size=1),
        "single": RingGroups(singles[rank], singles[rank]),  # a W = 1 ring on this rank's own GPU
    }
    shape = settings.check
    mesh = Mesh(MeshShape.build(world=world, ulysses=world, ring=1, q_heads=shape.heads, kv_heads=shape.kv_heads))

    started = time.perf_counter()
    passed = correctness(report, settings, rings, mesh, device, dtype, args.seed)
    report.add(
        "", f"Correctness: {'all checks passed' if passed else 'FAILED'} ({time.perf_counter() - started:.0f} s)."
    )
    if not args.skip_scaling:
        started = time.perf_counter()
        scaling(report, settings, rings, device, dtype, args)
        report.add("", f"Scaling section: {time.perf_counter() - started:.0f} s.")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
