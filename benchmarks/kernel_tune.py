"""Sweep the launch configs (tile sizes, warps, pipeline stages) of the vertical-slash Triton kernels at one shape.

For each pass — the forward (``fwd``) and the three passes of the backward (``dq``, ``col``, ``dkdv``) — every
candidate of a grid runs with the other passes at their ``_CONFIG`` defaults, through ``override_launch_config``.
A pass is timed through the launcher that runs it: ``vertical_slash_forward`` (the index's kernel form cached on
it) for ``fwd``, the whole ``vertical_slash_backward`` for the others; the candidates of a pass differ from the
default only in that pass, so their differences in ms are that kernel's. Every candidate's
outputs (out and lse, or dq, dk and dv) are compared with the default config's: the largest difference relative
to the tensor's largest magnitude must stay within ``2 * eps`` of the input dtype (fp32 dots run as tf32 on a GPU,
so fp32 counts as tf32); reordering the fp32 sums and rounding p differently moves results by about one rounding
step, a dropped or doubled tile by far more. Candidates that fail to compile or to launch (shared memory,
registers) are recorded and skipped. Per pass the best is the fastest matching candidate, the default unless
something beats it by more than ``NOISE``; all best configs together are then checked once more and timed
against the defaults as kernel_bench times them (fwd: index conversion + forward; fwd+bwd: conversion, forward,
backward), with a torch-profiler breakdown per kernel of both, and the ``_CONFIG`` entry to paste is printed.

Shape: kernel_bench's (B=1 unless ``--batch``, Hq=16, Hkv=2, D=128, bf16, causal, block size 128) at N=131072
and 95 % sparsity, with kernel_bench's planted index (``benchmarks.cases.index_for_density``). Grid
(``candidates``): blocks that
divide the block size, warps by the rows of fp32 accumulators a program holds (128 rows: 8, 64: 4 or 8, 32: 4),
2-4 stages (1-3 for the dk/dv and column passes, which hold two accumulators); about 20 candidates per pass. They
run nearest-to-the-default first, and each pass gets an equal share of ``--budget-s`` plus what earlier passes left
(dk/dv, the slowest to compile, runs last), so slow compiles cost far candidates, never a whole pass.

Timing: ``benchmarks.harness.median_ms`` (``triton.testing.do_bench``'s median; on CPU, where the Triton
interpreter runs the kernels for smoke tests only, wall-clock calls for ``--rep-ms``).

    python -m benchmarks.kernel_tune --out FILE
    TRITON_INTERPRET=1 python -m benchmarks.kernel_tune --quick --seqlen 1024 --heads 2 --kv-heads 1 --dtype fp16
        # CPU smoke test; the interpreter's bf16 dot is broken, hence fp16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from benchmarks import harness
from benchmarks.cases import index_for_density
from ds_mtraining.sparse import triton as vs
from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.triton.launch_config import launch_config, override_launch_config

# Sweep order: the dk/dv pass compiles slowest and takes most time, so it runs last and gets what the others leave.
PASSES = ("fwd", "dq", "col", "dkdv")
NOISE = 0.01  # a candidate must beat the default by more than this fraction to replace it (run-to-run spread)
# Tolerance unit per input dtype: 2x machine epsilon; fp32 as tf32 (10 mantissa bits), how GPU dots run it.
EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-10}
# --quick: the default and one alternative per pass, both legal for block sizes 64 and 128.
QUICK = {"fwd": (64, 64, 4, 2), "dq": (64, 64, 4, 2), "dkdv": (64, 32, 4, 2), "col": (32, 64, 4, 2)}

Config = tuple[int, int, int, int]  # (block per program, inner block, num_warps, num_stages), as in _CONFIG


def candidates(name: str, default: Config, block_size: int) -> list[Config]:
    """The grid of one pass at this block size: the default first, then the others nearest to it first.

    ``fwd`` / ``dq``: (query rows, key sub-block); ``dkdv``: (keys, query sub-block); ``col``: (columns, query
    sub-block). Warps follow the rows of fp32 accumulators a program holds (below).
    """
    if name in ("fwd", "dq"):
        outers, inners, stages = (64, 128), (32, 64, 128), (2, 3, 4)
        min_area = 64 * 64  # smaller score tiles leave the tensor cores idle
    else:
        outers = (64, 128) if name == "dkdv" else (32, 64, 128)
        inners = (16, 32, 64) if name == "dkdv" else (32, 64)
        stages = (1, 2, 3)  # two fp32 accumulators and five operand tiles leave little shared memory to pipeline
        min_area = 64 * 32
    # Each program holds [outer, D] fp32 accumulators (out or dq; dk and dv) and operands in registers: with 128
    # rows, 4 warps spill (and ptxas then takes minutes to compile); 64 rows fit either way; 32 rows need 4.
    warps = {32: (4,), 64: (4, 8), 128: (8,)}
    grid = [
        (outer, inner, w, s)
        for outer in outers
        for inner in inners
        if block_size % inner == 0 and (name == "col" or block_size % outer == 0) and outer * inner >= min_area
        for w in warps[outer]
        for s in stages
    ]
    others = sorted((c for c in grid if c != default), key=lambda c: (sum(a != b for a, b in zip(c, default)), c))
    return [default, *others]


def max_rel_diff(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """Largest ``|got - ref|`` over the tensors, each relative to its reference's largest magnitude; NaN if any
    output holds a NaN."""
    tiny = torch.finfo(torch.float32).tiny
    diffs = [(g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(tiny) for g, r in zip(got, ref)]
    return torch.stack(diffs).max().item()  # torch's max propagates NaN


@dataclass
class Problem:
    """Inputs of one shape.

    q, do ``[B, N, Hq, D]`` and k, v ``[B, N, Hkv, D]`` in the swept dtype; out ``[B, N, Hq, D]`` and lse
    ``[B, Hq, N]`` (fp32) the default config's forward, which every backward candidate differentiates. The
    candidates' launches share the index's cached kernel form; the ``convert_*`` timings convert afresh.
    """

    n: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    scale: float
    index: VerticalSlashIndex
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return vs.vertical_slash_forward(self.q, self.k, self.v, self.index, self.scale)

    def backward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return vs.vertical_slash_backward(self.do, self.q, self.k, self.v, self.out, self.lse, self.index, self.scale)

    def run(self, name: str) -> tuple[torch.Tensor, ...]:
        """The outputs of the launcher that runs pass ``name``."""
        return self.forward() if name == "fwd" else self.backward()

    def convert_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kernel_bench's "fwd": index conversion + forward."""
        return vs.vertical_slash_forward(self.q, self.k, self.v, vs.prepare_index(self.index, self.n), self.scale)

    def convert_forward_backward(self) -> tuple[torch.Tensor, ...]:
        """kernel_bench's "fwd+bwd": index conversion, forward, backward; returns out, lse, dq, dk, dv."""
        kidx = vs.prepare_index(self.index, self.n)
        out, lse = vs.vertical_slash_forward(self.q, self.k, self.v, kidx, self.scale)
        return out, lse, *vs.vertical_slash_backward(self.do, self.q, self.k, self.v, out, lse, kidx, self.scale)


@dataclass
class Result:
    config: Config
    ms: float = float("nan")
    diff: float = float("nan")
    error: str = ""  # why it did not run: a compile / launch failure, or the time budget


def sweep_pass(
    prob: Problem,
    name: str,
    configs: list[Config],
    ref: Sequence[torch.Tensor],
    tol: float,
    deadline: float,
    rep_ms: float,
) -> list[Result]:
    """Run, check against ``ref`` and time each config of pass ``name``; after ``deadline`` (``time.monotonic``)
    only the first (the default) still runs."""
    results = []
    for cfg in configs:
        res = Result(cfg)
        results.append(res)
        if time.monotonic() > deadline and results[0] is not res:
            res.error = "not run: time budget"
            continue
        t0 = time.monotonic()
        try:
            with override_launch_config(**{name: cfg}):
                res.diff = max_rel_diff(prob.run(name), ref)  # the first launch compiles
                res.ms = harness.median_ms(lambda: prob.run(name), rep_ms=rep_ms)
        except Exception as err:  # noqa: BLE001 - a config that does not compile or fit is recorded, not fatal
            res.error = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
        status = res.error or ("ok" if res.diff <= tol else "MISMATCH")
        print(
            f"{name} {cfg}: {res.ms:.3f} ms, diff {res.diff:.2e} ({status}, {time.monotonic() - t0:.1f} s)", flush=True
        )
    return results


def best_of(results: list[Result], tol: float) -> Result:
    """The fastest matching result; the default (first) unless it is beaten by more than NOISE."""
    default = results[0]
    ok = [r for r in results if not r.error and r.diff <= tol]
    best = min(ok, key=lambda r: r.ms, default=default)
    return best if best.ms < default.ms * (1 - NOISE) else default


def pass_table(name: str, results: list[Result], best: Result, tol: float) -> list[str]:
    default = results[0]
    lines = [
        "",
        f"### {name}",
        "",
        "| config (block, inner, warps, stages) | ms | vs default | max rel. diff | status |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (1, 0.0) if r.error else (0, r.ms)):
        tags = " ".join(t for t, on in (("**best**", r is best), ("(default)", r is default)) if on)
        status = r.error or ("ok" if r.diff <= tol else f"**MISMATCH** (> {tol:.1e})")
        speed = f"{default.ms / r.ms:.3f}x" if not r.error else ""
        lines.append(f"| {r.config} {tags} | {r.ms:.3f} | {speed} | {r.diff:.2e} | {status} |")
    return lines


def config_snippet(dtype: torch.dtype, block_size: int, head_dim: int, tuned: dict[str, Config]) -> list[str]:
    """The ``_CONFIG`` entry (``_CONFIG_FP32`` for fp32) with the tuned passes, as Python to paste."""
    full = {**launch_config(dtype, block_size, head_dim), **tuned}
    body = [f'    "{k}": {c},' for k, c in full.items()]
    if dtype == torch.float32:
        return ["_CONFIG_FP32 = {", *body, "}"]
    return [f"    ({block_size}, {head_dim}): {{", *("    " + line for line in body), "    },"]


def make_problem(args: argparse.Namespace, device: str) -> tuple[Problem, float]:
    """Random inputs and kernel_bench's planted index for the target density; returns it and the density."""
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    b, n, hq, hkv, d = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
    q, do = (torch.randn(b, n, hq, d, device=device).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=device).to(dtype) for _ in range(2))
    index, density = index_for_density(b, hq, n, args.block_size, args.density, device=device)
    prob = Problem(n, q, k, v, do, d**-0.5, index)
    prob.out, prob.lse = prob.forward()
    return prob, density


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="markdown file for the tables (rewritten after each pass)")
    ap.add_argument("--seqlen", type=int, help="tokens N (default 131072; 8192 with --quick)")
    ap.add_argument(
        "--batch", type=int, default=1,
        help="sequences B (e.g. 16 x 8192: a packed 128K row of 8K documents costs what the batch costs)",
    )  # fmt: skip
    ap.add_argument("--block-size", type=int, default=128, choices=(64, 128))
    ap.add_argument("--density", type=float, default=0.05, help="target index density (0.05 = 95 %% sparsity)")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement")
    harness.add_shape_args(ap)
    harness.add_device_args(ap)
    ap.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated subset of {','.join(PASSES)}")
    ap.add_argument("--budget-s", type=float, default=360.0, help="wall-clock seconds for the whole run")
    ap.add_argument("--quick", action="store_true", help="2 configs per pass (default + one), N=8192 by default")
    args = ap.parse_args(argv)
    args.seqlen = args.seqlen or (8192 if args.quick else 131072)
    if args.batch < 1:
        ap.error(f"--batch takes a number of sequences >= 1; got {args.batch}")
    args.passes = [p for p in args.passes.split(",") if p]
    if set(args.passes) - set(PASSES):
        ap.error(f"--passes takes names from {PASSES}; got {args.passes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    harness.require_kernels(args.device)
    if args.device == "cpu" and args.dtype == "bf16":
        raise SystemExit("the Triton interpreter's bf16 dot is broken: use --dtype fp16 or fp32 on CPU")
    dtype, bs, d = harness.DTYPES[args.dtype], args.block_size, args.head_dim
    tol = 2 * EPS[dtype]

    prob, density = make_problem(args, args.device)
    defaults = launch_config(dtype, bs, d)
    report = harness.Report(args.out)
    report.add(
        *harness.header("Launch-config sweep", __spec__.name, argv, device=args.device),
        "",
        (
            f"- shape: B={args.batch}, N={args.seqlen}, Hq={args.heads}, Hkv={args.kv_heads}, D={d}, {args.dtype}, "
            f"block size {bs}; planted index (benchmarks.cases.index_for_density), density {density:.4f}"
        ),
        (
            "- ms: the launcher running the pass with only that pass's config changed (fwd: forward on a converted "
            "index; dq / dkdv / col: the whole backward), do_bench median; 'vs default' = default ms / ms"
        ),
        (
            f"- max rel. diff: largest |x - default| / max|default| over the outputs; tolerance {tol:.1e} "
            f"(2 eps of {args.dtype}); best = fastest matching, the default unless beaten by > {NOISE:.0%}"
        ),
    )
    gpu = args.device == "cuda"
    reserve = 30.0 if gpu else 0.0  # the final timings and the profiler breakdowns
    tuned: dict[str, Config] = {}
    for p, name in enumerate(args.passes):
        configs = [defaults[name], QUICK[name]] if args.quick else candidates(name, defaults[name], bs)
        ref = (prob.out, prob.lse) if name == "fwd" else prob.backward()
        deadline = start + (args.budget_s - reserve) * (p + 1) / len(args.passes)
        results = sweep_pass(prob, name, configs, ref, tol, deadline, args.rep_ms)
        del ref
        best = best_of(results, tol)
        tuned[name] = best.config
        report.add(*pass_table(name, results, best, tol))

    # All best configs together: check against the defaults once more, time as kernel_bench does.
    ref = prob.convert_forward_backward()
    with override_launch_config(**tuned):
        diff = max_rel_diff(prob.convert_forward_backward(), ref)
    del ref
    times = {}
    for label, over in (("default", {}), ("tuned", tuned)):
        with override_launch_config(**over):
            fwd = harness.median_ms(prob.convert_forward, rep_ms=args.rep_ms)
            fb = harness.median_ms(prob.convert_forward_backward, rep_ms=args.rep_ms)
            breakdown = harness.profile_ms(prob.convert_forward_backward) if gpu else {}
        times[label] = (fwd, fb, breakdown)
    (f0, fb0, br0), (f1, fb1, br1) = times["default"], times["tuned"]
    lines = [
        "",
        "## All best configs together",
        "",
        (
            f"max rel. diff of out, lse, dq, dk, dv vs the defaults: {diff:.2e} "
            f"({'ok' if diff <= tol else '**MISMATCH**'}, tolerance {tol:.1e})"
        ),
        "",
        "| configs | fwd ms (incl. index conversion) | fwd+bwd ms | bwd / fwd |",
        "|---|---|---|---|",
        f"| default | {f0:.2f} | {fb0:.2f} | {(fb0 - f0) / f0:.2f} |",
        f"| tuned | {f1:.2f} | {fb1:.2f} | {(fb1 - f1) / f1:.2f} |",
        "",
        f"fwd+bwd speed-up: {fb0 / fb1:.3f}x",
    ]
    if br0:
        lines += ["", "Per kernel, ms per fwd+bwd (torch profiler, 3 runs):", "", "| kernel | default | tuned |"]
        lines += ["|---|---|---|"]
        lines += [f"| {k} | {t:.2f} | {br1.get(k, float('nan')):.2f} |" for k, t in br0.items()]
    lines += ["", "Entry to paste into `_CONFIG` (ds_mtraining/sparse/triton/launch_config.py):", "", "```python"]
    lines += config_snippet(dtype, bs, d, tuned)
    lines += ["```", "", f"Total wall time: {time.monotonic() - start:.0f} s"]
    report.add(*lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
