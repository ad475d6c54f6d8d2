"""Where a ring's kernel time goes: each kernel's device time summed over the (rank, step) pairs of a ring, against
the one-device call, for the planted index and for parts of it (issue 53).

``benchmarks.ring_steps`` times each pair's forward and backward as a whole; this runs the same pairs (its
``measure``, the ring's own step kernels and tile maps) under ``torch.profiler`` and sums each kernel's time per
direction, so a ring's overhead can be put on the pass that pays it (forward, dq, column or dk/dv). Variants of the
planted index separate the costs:

- ``full``: the pattern;
- ``no-columns``: its slash offsets only;
- ``diagonal``: offset 0 alone, no columns: the per-program floor no sparsity removes;
- ``diagonal+columns``: offset 0 and the columns: what the columns cost beyond the floor.

    python -m benchmarks.ring_kernels --seqlen 262144 --shapes 1:1 32:32 --variants full diagonal+columns --out F.md
    python -m benchmarks.ring_kernels --seqlen 262144 --shapes 1:1 32:32 --launch-config dkdv=64,32,4,2
    python -m benchmarks.ring_kernels --device cpu --dtype fp32 --seqlen 512 --shapes 1:1 4:2 --heads 4 \\
        --head-dim 64   # CPU smoke test: the PyTorch path's operators, times that say nothing of the GPU

A shape ``W:G`` is a ring of W ranks whose inner groups of G ranks all-gather their K/V (G = 1: the ring). Each call
is run once to warm up, then three times under the profiler; the report gives the mean per call, summed over the
pairs. On a GPU the kernels are CUDA kernels; on the CPU, the top-level operators (self time).
``--launch-config PASS=BLOCK,INNER,WARPS,STAGES`` runs the Triton kernels' pass (``fwd``, ``dq``, ``dkdv``, ``col``)
with that config in every call instead of the tuned one (``sparse.triton.override_launch_config``), so a pass's
configs can be compared on the ring's own steps; the report's header names them.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from benchmarks import harness, ring_steps
from ds_mtraining.sparse import AttentionPattern
from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.triton.launch_config import launch_config, override_launch_config

VARIANTS = ("full", "no-columns", "diagonal", "diagonal+columns")
CALLS = 3
"""Profiled calls per pair (after one warm-up call)."""


def variant(pattern: AttentionPattern, name: str) -> AttentionPattern:
    """``pattern``'s index cut to one of :data:`VARIANTS` (module docstring)."""
    index = pattern.index
    vertical, slash = index.vertical, index.slash
    if name in ("no-columns", "diagonal"):
        vertical = torch.full_like(vertical, -1)  # every column padding, as the kernels read an index without any
    if name in ("diagonal", "diagonal+columns"):
        slash = torch.full_like(slash[..., :1], 0)  # offset 0 alone
    return AttentionPattern(pattern.seqlen, VerticalSlashIndex(vertical, slash, index.block_size))


class KernelTimes:
    """A ``ring_steps.TimeCall`` that profiles each call and sums its kernels' times (ms per call) per direction."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device == "cuda"
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def __call__(self, fn: Callable[[], object], direction: str) -> float:
        fn()
        harness.sync(self.device)
        activity = torch.profiler.ProfilerActivity.CUDA if self.cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(CALLS):
                fn()
            harness.sync(self.device)
        spent = 0.0
        for event in prof.key_averages():
            us = event.device_time_total if self.cuda else event.self_cpu_time_total
            if us > 0:
                self.totals[direction][event.key] += us / CALLS / 1e3
                spent += us / CALLS / 1e3
        return spent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ring_kernels", description=__doc__.split("\n\n")[0])
    harness.add_device_args(parser)
    harness.add_shape_args(parser)
    parser.add_argument("--seqlen", type=int, default=262144)
    parser.add_argument("--shapes", nargs="+", default=["1:1", "32:32"], help="W:G rings (module docstring)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["full"])
    parser.add_argument("--density", type=float, default=0.05, help="planted pattern's density")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=None, help="measure this many evenly spaced ranks (ring_steps)")
    parser.add_argument(
        "--launch-config", nargs="+", default=[], metavar="PASS=B,M,WARPS,STAGES",
        help="run these passes of the Triton kernels with this launch config (module docstring)",
    )  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    overrides = {}
    for spec in args.launch_config:
        name, _, values = spec.partition("=")
        numbers = values.split(",")
        if len(numbers) != 4 or not all(x.isdigit() for x in numbers):
            parser.error(f"--launch-config takes PASS=BLOCK,INNER,WARPS,STAGES (e.g. dkdv=64,32,4,2); got {spec!r}")
        overrides[name] = tuple(int(x) for x in numbers)
    shapes = []
    for spec in args.shapes:
        world, _, group = spec.partition(":")
        if not (world.isdigit() and group.isdigit()) or int(group) < 1 or int(world) % int(group):
            parser.error(f"--shapes takes W:G with G dividing W (G = 1: the ring); got {spec!r}")
        shapes.append((int(world), int(group)))
    with contextlib.ExitStack() as stack:
        try:  # checked here (passes, configs, the block size): a usage error, not a traceback at the first launch
            stack.enter_context(override_launch_config(**overrides))
            launch_config(harness.DTYPES[args.dtype], ring_steps.BLOCK, args.head_dim)
        except ValueError as error:
            parser.error(f"--launch-config: {error}")
        return _report(args, argv, shapes)


def _report(args: argparse.Namespace, argv: Sequence[str] | None, shapes: list[tuple[int, int]]) -> int:
    """``main``'s measurements and report, for its parsed ``args`` and ``shapes`` (W, G)."""
    if args.device == "cuda":
        harness.require_kernels(args.device)
    # What ring_steps.measure reads of its arguments besides the shape ones.
    args.pattern, args.check_ranks, args.rep_ms = "planted", 0, 0.0
    report = harness.Report(args.out)
    report.add(
        *harness.header("Ring kernels: device time per pass", __spec__.name, argv, device=args.device),
        "",
        f"B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, block {ring_steps.BLOCK}, "
        f"striped layout; planted pattern (density {args.density}); ms summed over the ring's (rank, step) pairs"
        + ("" if args.ranks is None else f", {args.ranks} sampled ranks scaled to the ring")
        + "".join(f"; {spec} (launch config)" for spec in args.launch_config),
    )
    planted = ring_steps.make_pattern(args, args.seqlen)
    for name in args.variants:
        pattern = variant(planted, name)
        report.add("", f"## {name}", "", "| W | K/V | direction | total ms | over W = 1 | kernels (ms) |",
                   "|---|---|---|---|---|---|")  # fmt: skip
        one: dict[str, float] = {}
        for world, group in shapes:
            times = KernelTimes(args.device)
            rows = ring_steps.measure(args, args.seqlen, world, group, pattern=pattern, time_call=times)
            weight = rows[0]["weight"]
            for direction, kernels in times.totals.items():
                total = weight * sum(kernels.values())
                if world == 1:
                    one[direction] = total
                ratio = f"{total / one[direction]:.2f}" if one.get(direction) else "-"
                top = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
                listed = ", ".join(f"{key[:40]} {weight * ms:.2f}" for key, ms in top)
                report.add(
                    f"| {world} | {ring_steps.exchange(group)} | {direction} | {total:.2f} | {ratio} | {listed} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
