"""Sparse ring attention on several GPUs (NCCL): weak scaling and measured imbalance.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 -m benchmarks.multi_gpu --out FILE
    torchrun --nproc_per_node 2 -m benchmarks.multi_gpu --quick --out FILE      (CPU, gloo, fp32, seconds)

Backend NCCL when CUDA is available (device ``cuda:LOCAL_RANK``), gloo on CPU. NVLink multicast (NVLS) is left
off: ``NCCL_NVLS_ENABLE`` is set to 0 unless the environment sets it. Rank 0 writes the report, rewritten after
every row so a run cut short still leaves its tables. Imports nothing that needs pydantic, deepspeed or transformers
(indices are planted, not estimated). The ring's distributed correctness is a test:
``tests/gpu/test_gpu_ring.py`` (``pytest -m cuda tests/gpu`` on a machine of two GPUs; gloo on CPU).

Weak scaling: B=1, Hq=16, Hkv=2, D=128, fixed tokens per GPU (32K, 64K),
   N = W x tokens for W = 1 and W = world. Index: the planted pattern of docs/design.md at 95 % sparsity
   (``ds_mtraining.sparse.planted``) with its local band (N/64 tokens) and random columns (960 per 128K)
   scaled with N, so the density stays ~0.05 at every N — at 128K it is exactly the docs/design.md pattern.
   Methods: the ring (striped + gathered columns, striped + per-step columns, zigzag, dense zigzag ring) and,
   at W = 1, the single-device kernels (``vertical_slash_attention``: Triton sparse, SDPA dense). The W = 1
   cases run on every rank at once, each on its own GPU (rings on a one-rank group per rank), so no GPU idles.
   Timing: CUDA events around forward and forward + backward, ``--warmup`` then ``--iters`` iterations, per
   iteration the slowest rank, median reported. One more iteration records each ring step's compute
   (``RingTrace``; it synchronises around steps, so it is not in the timings) for the measured imbalance,
   shown next to the work model's prediction for the same index and layout (``parallel.work.ring_work``;
   ``sim.gathered_columns_work`` for the gathered-column schedule). "µs / tile" divides the time by the
   busiest rank's modelled tiles (64x64 tiles plus column work): the per-GPU throughput at each W.
   The ring's steps run the Triton kernels on CUDA (tile maps place each shard in the global sequence) and
   the PyTorch path on CPU; the gathered-column pass is PyTorch on both. ``--budget-s`` bounds the run: a case whose
   time, extrapolated from its smaller size (x4 per doubling of tokens per GPU), does not fit what is left
   is skipped and listed as such; a case that runs gets fewer iterations (at least one) when time runs short.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from benchmarks import harness
from ds_mtraining.parallel.comm import RingGroups, new_ring_groups
from ds_mtraining.parallel.layout import Layout, LayoutKind, make_layout
from ds_mtraining.parallel.ring import RingTrace, gather_step_times, sparse_ring_attention
from ds_mtraining.parallel.work import RingWork, StepLoadMetrics, ring_work
from ds_mtraining.sim import gathered_columns_work
from ds_mtraining.sim.patterns import planted_pattern_index
from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex, vertical_slash_attention
from ds_mtraining.sparse.attention import kernel_backend

BLOCK = 64
DENSITY = 0.05
Columns = Literal["gathered", "per_step"]


@dataclass(frozen=True)
class Shape:
    """A run's sizes: q ``[batch, seqlen, heads, dim]``, k/v ``[batch, seqlen, kv_heads, dim]`` at each of
    ``tokens_per_gpu`` x W tokens."""

    batch: int
    heads: int
    kv_heads: int
    dim: int
    tokens_per_gpu: tuple[int, ...]


FULL = Shape(1, 16, 2, 128, (32768, 65536))
QUICK = Shape(1, 4, 2, 32, (256, 512))


def agree_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks (e.g. the slowest rank's time): the same list on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass(frozen=True)
class Method:
    """One way to run attention.

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
            index = VerticalSlashIndex.dense(index.batch, index.heads, layout.seqlen, BLOCK)
        pattern = AttentionPattern(layout.seqlen, index)
        if self.sparse and self.columns == "gathered" and layout.world > 1:
            return gathered_columns_work(pattern, layout)
        return ring_work(pattern, layout)


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
    """Seconds left for the run, and each (method, W)'s last iteration time for extrapolation."""

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
        clock = harness.Clock(device)
        clock.mark()
        out = fn(*leaves)
        clock.mark()
        torch.autograd.grad(out, leaves, dout)
        clock.mark()
        fwd, bwd = clock.intervals()
        times.append((fwd, fwd + bwd))
    flat = agree_max([t for pair in times for t in pair], device)
    return list(zip(flat[::2], flat[1::2]))


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
    report: harness.Report,
    shape: Shape,
    rings: dict[str, RingGroups],
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> None:
    """The tables of the module docstring."""
    world = dist.get_world_size()
    budget = Budget(time.perf_counter() + args.budget_s, device, {})
    report.add(
        "",
        "## Weak scaling: sparse ring attention forward + backward",
        "",
        (
            f"B={shape.batch}, Hq={shape.heads}, Hkv={shape.kv_heads}, D={shape.dim}, block {BLOCK}, {str(dtype)[6:]}; "
            f"planted index at {1 - DENSITY:.0%} sparsity (local band and columns scaled with N). "
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
            "Measured: one extra iteration with `RingTrace` (synchronises around each step), gathered over the "
            "ring with `gather_step_times`. Per rank, the compute of each step in order. Reading it: the model "
            "counts attended tiles, which is what the Triton kernels (CUDA) pay for; the PyTorch path (CPU) "
            "gathers every slash offset of a query tile at every step and masks the ones whose keys are not in "
            "the shard in hand, so there a step costs about (local query tiles x offsets) whatever it attends."
        ),
        "",
        "| tokens/GPU | method | source | worker imb. | per-step worker imb. | step imb. | ring eff. | per rank, per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tokens in shape.tokens_per_gpu:
        for w, methods in ((1, SINGLE), (world, MULTI)):
            seqlen = w * tokens
            index = planted_pattern_index(
                shape.batch, shape.heads, seqlen, BLOCK, density=DENSITY, seed=args.seed, device=device
            )
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
                row = f"| {harness.tokens(tokens)} | {w} | {seqlen} | {method.name} | {density if method.sparse else 1.0:.4f} | "
                profiled = int(method.ring and w > 1)  # the extra iteration that records step times
                estimate, left = budget.estimate(method, w, tokens), budget.left()
                if estimate is not None and estimate * (args.warmup + args.iters + profiled) > left:
                    report.add(row + f"skipped: ~{estimate:.3g} s per iteration, {max(left, 0):.0f} s left | | | | |")
                    continue
                pattern = AttentionPattern(seqlen, index) if method.sparse else None
                if method.ring:
                    mine = [layout.shard(x, groups.rank) for x in (q, k, v)]
                    d_mine = layout.shard(dout, groups.rank)

                    def fn(*x, method=method, layout=layout, groups=groups, pattern=pattern, trace=None):
                        return sparse_ring_attention(
                            *x, pattern, groups=groups, layout=layout, columns=method.columns, trace=trace
                        )
                else:
                    mine, d_mine = [q, k, v], dout

                    def fn(*x, pattern=pattern):
                        return vertical_slash_attention(*x, pattern)

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
                    trace = RingTrace()
                    leaves = [x.detach().clone().requires_grad_() for x in mine]
                    torch.autograd.grad(fn(*leaves, trace=trace), leaves, d_mine)
                    forward, backward = gather_step_times(trace, rings["flat"])
                    start = f"| {harness.tokens(tokens)} | {method.name} | "
                    imbalance += [
                        start + f"model (tiles) | {load_cells(model)} | {per_rank(model.work, ' tiles')} |",
                        start + f"measured fwd | {load_cells(forward)} | {per_rank(forward.work, ' ms')} |",
                        start + f"measured bwd | {load_cells(backward)} | {per_rank(backward.work, ' ms')} |",
                    ]
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add(*imbalance)


def environment(device: torch.device) -> list[str]:
    """What else the numbers depend on: the collective library and NVLink multicast, TF32 on a GPU."""
    lines = [f"backend {dist.get_backend()}, world {dist.get_world_size()}"]
    if device.type == "cuda":
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        lines[0] += f"; NCCL {nccl}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} (NVLink multicast off)"
        # The gathered-column pass computes in fp32 on PyTorch: TF32 changes its speed.
        lines.append(f"fp32 matmuls use TF32: {torch.backends.cuda.matmul.allow_tf32} (PyTorch's default is False).")
    else:
        lines[0] += f"; {torch.get_num_threads()} thread per rank"
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the report (written by rank 0)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test with gloo")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per case (fewer if the budget says)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

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
    report = harness.Report(args.out if rank == 0 else None, echo=rank == 0)
    title = "Multi-GPU sparse ring attention"
    launcher = f"torchrun --nproc_per_node {world} -m"
    report.add(
        *harness.header(title, __spec__.name, argv, device=device, count=world, launcher=launcher),
        "",
        *environment(device),
    )
    # Every group is created by every rank in the same order (group creation is collective).
    singles = [dist.new_group([r]) for r in range(world)]
    rings = {
        "flat": new_ring_groups(list(range(world))),
        "single": RingGroups(singles[rank], singles[rank]),  # a W = 1 ring on this rank's own GPU
    }
    started = time.perf_counter()
    scaling(report, QUICK if args.quick else FULL, rings, device, dtype, args)
    report.add("", f"Runtime: {time.perf_counter() - started:.0f} s.")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
