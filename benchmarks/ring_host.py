"""The host's share of a ring step: the time to issue one step's forward and backward calls, beside the step run back
to back (issue 53).

    python -m benchmarks.ring_host --seqlens 262144 1048576 4194304 --worlds 32 128 1024 --out F.md
    TRITON_INTERPRET=1 python -m benchmarks.ring_host --device cpu --seqlens 2048 --worlds 4 --heads 2 --head-dim 64

A ring of W ranks runs W steps a layer, each one call of the sparse kernels forward and one backward over a shard of
``N / W`` tokens. ``benchmarks.ring_steps`` times them on the GPU (CUDA events, calls queued back to back); where a
step's kernels take less than the host needs to check its inputs and launch them, the GPU waits for the host and the
step costs the host's time, which no kernel work changes. This times, for rank 0's step over shard 1 of a striped
ring (the ring's own inputs: tile maps, the step's index from ``parallel.ring.shard_index``, the running out / lse,
the rows' delta, the running fp32 dq and the fp32 dK/dV buffer), ``--calls`` calls issued without a sync (the host
time a call) and the same calls until the GPU is done (a call's time back to back): the step is host-bound where the
two are equal. On the CPU both are the PyTorch path's or the interpreter's time (the smoke run above).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from benchmarks import harness, ring_steps


def issue_and_total_us(fn: Callable[[], object], calls: int, device: str) -> tuple[float, float]:
    """(host µs to issue one call, µs a call until the device is done) over ``calls`` calls issued back to back,
    after a warm-up call."""
    fn()
    harness.sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    harness.sync(device)
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def measure(args: argparse.Namespace, seqlen: int, world: int) -> list[tuple[str, float, float]]:
    """(call, host µs, back-to-back µs) of rank 0's forward and backward step over shard 1 of a ``world``-rank
    ring."""
    device, dtype = args.device, harness.DTYPES[args.dtype]
    ring = ring_steps.Ring(ring_steps.make_pattern(args, seqlen), world, device, dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n = ring.layout.local_len
    q, do = (torch.randn(1, n, args.heads, args.head_dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    kv = {1: [torch.randn(1, n, args.kv_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
              for _ in range(2)]}  # fmt: skip
    step = range(1, 2)
    rank = ring_steps.RankSteps(ring, 0, [step], q, do, kv, args.head_dim**-0.5)
    calls = (("forward", partial(rank.forward, step)), ("backward", partial(rank.backward, step)))
    return [(name, *issue_and_total_us(fn, args.calls, device)) for name, fn in calls]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ring_host", description=__doc__.split("\n\n")[0])
    harness.add_device_args(parser)
    harness.add_shape_args(parser)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[262144, 1048576])
    parser.add_argument("--worlds", type=int, nargs="+", default=[32, 128], help="one ring size per length, in order")
    parser.add_argument("--density", type=float, default=0.05, help="planted pattern's density")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=200, help="calls issued back to back per measurement")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if len(args.worlds) != len(args.seqlens):
        parser.error(f"--worlds gives one ring size per length: {len(args.seqlens)} lengths, {len(args.worlds)} sizes")
    args.pattern = "planted"
    if args.device == "cuda":
        harness.require_kernels(args.device)
    report = harness.Report(args.out)
    report.add(
        *harness.header("The host's share of a ring step", __spec__.name, argv, device=args.device),
        "",
        f"B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, block {ring_steps.BLOCK}, "
        f"striped layout, rank 0's step over shard 1, planted pattern (density {args.density}), {args.calls} calls",
        "",
        "| tokens | W | tokens a rank | call | host µs a call | back to back µs a call | host share |",
        "|---|---|---|---|---|---|---|",
    )
    for seqlen, world in zip(args.seqlens, args.worlds, strict=True):
        for name, host, total in measure(args, seqlen, world):
            report.add(
                f"| {harness.tokens(seqlen)} | {world} | {seqlen // world} | {name} | {host:.1f} | {total:.1f} | "
                f"{host / total:.0%} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
