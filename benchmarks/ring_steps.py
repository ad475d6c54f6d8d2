"""Every (rank, ring step) of a W-rank sparse ring, timed on one GPU through the ring's own per-step kernels, and a
cost model per step fitted to them: the measured costs a cluster simulator prices the ring with (issue 43).

A ring of W ranks runs W x W steps: at step ``s`` rank ``r`` computes its query shard against the K/V shard of
``src = ring_sources(W)[r, s]``. One GPU holds every shard, so each pair runs alone here, exactly as the ring runs
it, through the ring's own ``parallel.ring.StepKernels`` (the Triton kernels on CUDA, the PyTorch path elsewhere)
on the layout's shards, forward (merged into a
running out / lse) and backward (dq, dk, dv of the pair from the rows' final out / lse; as the ring runs it since
2026-12-06: dq added into a running fp32 one, dk / dv written in fp32, the rows' delta computed once). The work of
each pair is the ring's work model (``parallel.work.pair_work``: slash tiles and vertical columns per query rank and
key rank), and the fit is, per direction,

    ms(pair) = fixed + per_tile * tiles(pair) + per_chunk * column chunks(pair) + per_offset * offsets(query rank)
               + per_program * programs

by least squares over every measured pair of every length and ring size (coefficients >= 0): tiles are the slash
tiles of the pair; offsets the chosen slash offsets the kernels visit for each local query tile (``walked_offsets``:
a scalar load each, the key tile only where the shard holds it; the ring gives a step only the offsets that can reach
the shard in hand, striped one residue class mod W); programs the query-tile programs of a launch (heads x local
tiles; a program with nothing in the shard stops before loading anything); column chunks the chunks of columns before
each local query tile that the step's kernel walks (``parallel.work.walked_columns``: it loads and masks every column
of its index before the tile rather than skipping those it does not attend; the ring gives a step only the columns of
the shard in hand). Both lists come from ``parallel.ring.shard_index``, as in the ring. The attended column work
(``columns``, in tile units) is recorded too; it is small beside the walk and aliases with it, so it is not a term (a
fit with tiles and attended columns alone missed the W = 8 and W = 32 pairs by 34-67 % when every step walked the
whole list, one set of coefficients for both). The report gives the coefficients and the fit's error on each pair;
``--fit`` writes them as JSON for the simulator. With ``--worlds 1`` among the worlds the report also gives each
ring's overhead: the sum over its (rank, step) pairs of forward + backward over the one-device kernels' time (W = 1)
on the same index and length. The one-device time is the kernels one GPU runs: the whole index without tile maps or a
merge (before 2026-12-06 it was the W = 1 ring's mapped, merging call). ``--check-ranks`` first checks that the merged
steps of those ranks equal the one-device attention of their rows (so what is timed is the ring's work, whole).
``--ranks K`` measures K evenly spaced ranks of each ring (W = 128 at 1M has 16,384 ring pairs); the sums scale them
to the whole ring.

Patterns: ``planted`` (the MTraining authors' planted pattern, ``sparse.planted``, at ``--density``), or ``real``
(an index saved by the evaluation code, ``eval.fidelity.measure_fidelity(keep_indices=True)`` as a ``torch.save``d
``{layer: {"vertical", "slash"}}``, or the committed form that wraps it with its length, ``--indices FILE --layer L``,
stretched to each length: columns and offsets scaled by ``N / n``, so each keeps its share of the sequence; its heads
taken in turn up to ``--heads``, so a small model's pattern runs at the priced shape).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path

import torch

from benchmarks import harness
from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.ring import StepKernels
from ds_mtraining.parallel.work import (
    pair_work,
    ring_sources,
    walked_columns,
    walked_offsets,
)
from ds_mtraining.sim.patterns import cycled_heads, load_saved_index, planted_pattern_index, stretched_index
from ds_mtraining.sparse import AttentionPattern, vertical_slash_attention
from ds_mtraining.sparse.attention import kernel_backend

BLOCK = 64
"""The sparse block size of the shipped configs, which the ring's layout keeps whole."""
TOLERANCES = {
    "bf16": {"atol": 2e-2, "rtol": 2e-2},
    "fp16": {"atol": 2e-3, "rtol": 2e-3},
    "fp32": {"atol": 1e-4, "rtol": 1e-4},
}
"""The merged steps against the one-device call: the same kernels, only the merge order differs."""


def make_pattern(args: argparse.Namespace, seqlen: int) -> AttentionPattern:
    """The pattern ``args`` name (``--pattern``: planted at ``--density``, or a saved real index) at ``seqlen``."""
    if args.pattern == "real":
        index = cycled_heads(stretched_index(load_saved_index(args.indices, args.layer), seqlen, BLOCK, args.device),
                             args.heads)  # fmt: skip
    else:
        index = planted_pattern_index(
            1, args.heads, seqlen, BLOCK, density=args.density, seed=args.seed, device=args.device
        )
    return AttentionPattern(seqlen, index)


TimeCall = Callable[[Callable[[], object], str], float]
"""Times one call: ``(fn, direction)`` -> ms, ``direction`` ``"forward"`` or ``"backward"``."""


class Ring:
    """A ``world``-rank striped ring over ``pattern`` as ``parallel.ring`` lays it out on ``device``: its layout,
    the kernels' backend for ``dtype`` and every rank's global blocks."""

    def __init__(self, pattern: AttentionPattern, world: int, device: str, dtype: torch.dtype):
        self.layout = make_layout("striped", world, pattern.seqlen, block_size=BLOCK)
        self.backend = kernel_backend(torch.empty(0, device=device, dtype=dtype))
        self.index = pattern.index
        self.blocks = [self.layout.block_ids_on(r, device) for r in range(world)]


class RankSteps:
    """Rank ``r``'s steps of ``ring``, each over the K/V shards of a range of sources (one call), run through the
    ring's own ``parallel.ring.StepKernels``: the step's K/V (``kv[s]``: shard s's k, v ``[1, N / W, Hkv, D]``) laid
    end to end, the forward merged into a running out / lse; the backward from the rows' final out / lse, their
    delta computed once, adding into one running fp32 dq and writing the step's dK/dV in fp32. Building it runs
    every forward step once (the rows' final out / lse)."""

    def __init__(self, ring: Ring, r: int, steps: Sequence[range], q: torch.Tensor, do: torch.Tensor,
                 kv: Mapping[int, Sequence[torch.Tensor]], scale: float):  # fmt: skip
        self.q, self.do, self.scale = q, do, scale
        self.kernels = StepKernels(q, ring.index, ring.layout, r, ring.blocks)
        self.kv = {srcs: torch.stack([torch.cat([kv[s][i] for s in srcs], dim=1) for i in (0, 1)]) for srcs in steps}
        self.compute = torch.promote_types(q.dtype, torch.float32)
        self.out = torch.zeros(q.shape, dtype=self.compute, device=q.device)
        self.lse = torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=self.compute, device=q.device)
        for srcs in steps:
            self.forward(srcs)
        self.final_out, self.final_lse = self.out.to(q.dtype), self.lse.clone()
        self.delta = ring.backend.backward_delta(do, self.final_out)
        self.dq = torch.zeros_like(q, dtype=self.compute)

    def forward(self, srcs: range) -> None:
        """The step over ``srcs``, merged into the running out / lse."""
        self.kernels.forward(self.q, self.kv[srcs], self.scale, self.out, self.lse, srcs)

    def backward(self, srcs: range) -> torch.Tensor:
        """The step's backward over ``srcs``: dq added into the running one; its dK/dV ``[2, 1, ·, Hkv, D]`` (fp32),
        laid end to end as the ring's reduce-scatter takes it."""
        return self.kernels.backward(
            self.do, self.q, self.kv[srcs], self.final_out, self.final_lse, self.scale, srcs, self.delta, self.dq
        )


def measure(
    args: argparse.Namespace,
    seqlen: int,
    world: int,
    group: int = 1,
    *,
    pattern: AttentionPattern | None = None,
    time_call: TimeCall | None = None,
) -> list[dict[str, float]]:
    """Each (rank, step) of a ``world``-rank striped ring over ``seqlen`` tokens: its work and its fwd / bwd ms.

    ``pattern``: the pattern to run (default: ``args``' planted or real one); ``time_call``: how a call is timed
    (default: ``harness.median_ms`` with ``args.rep_ms``).

    ``group`` > 1: the ring's ``kv_exchange="all_gather"`` with inner groups of ``group`` ranks: a step is one call
    over the K/V of a group's ``group`` shards (concatenated, placed by one tile map; the all-gather itself is not
    timed), and its work terms are those of the ring steps it replaces, summed, its programs counted once."""
    device, dtype = args.device, harness.DTYPES[args.dtype]
    pattern = pattern or make_pattern(args, seqlen)
    if time_call is None:

        def time_call(fn: Callable[[], object], direction: str) -> float:
            return harness.median_ms(fn, rep_ms=args.rep_ms, device=device)

    ring = Ring(pattern, world, device, dtype)
    layout = ring.layout
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v, do = (
        torch.randn(1, seqlen, h, args.head_dim, generator=gen, device=device, dtype=dtype)
        for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)
    )
    # Every rank's K/V (the steps hold them); the queries of the measured ranks only, cut in the loop: at 4M tokens
    # on 1024 ranks every rank's q and dO shards would be 32 GiB more than an 80 GB card holds beside the rest.
    kv_parts = [] if world == 1 else [[layout.shard(x, r) for x in (k, v)] for r in range(world)]
    index, scale = pattern.index, args.head_dim**-0.5
    work = pair_work(pattern, layout)  # [W, W] sums: per-block work would be 34 GB at 4M tokens on 1024 ranks
    tiles, columns = work.slash_pairs()[0].tolist(), work.column_pairs()[0].tolist()
    chunks = walked_columns(pattern, layout).tolist()
    offsets = walked_offsets(pattern, layout).tolist()
    programs = args.heads * layout.local_len // BLOCK
    # The rows the checked ranks' merged steps must give: one one-device call, sharded per rank below.
    expected = None
    if args.check_ranks > 0 and world > 1:
        expected = vertical_slash_attention(q, k, v, pattern, softmax_scale=scale, check_index=False)
    sources = ring_sources(world, group).tolist()
    ranks = sampled_ranks(world, args.ranks)
    rows = []

    def row(r: int, step: int, srcs: range, fwd: float, bwd: float) -> dict[str, float]:
        """Rank ``r``'s step over the shards ``srcs``: its work terms summed over them, its times, and the ranks it
        stands for."""
        return {"seqlen": seqlen, "world": world, "group": group, "rank": r, "step": step, "src": srcs.start,
                "tiles": sum(tiles[r][s] for s in srcs), "columns": sum(columns[r][s] for s in srcs),
                "column_chunks": sum(chunks[r][s] for s in srcs), "offsets": sum(offsets[r][s] for s in srcs),
                "programs": programs, "fwd_ms": fwd, "bwd_ms": bwd, "weight": world / len(ranks)}  # fmt: skip

    for checked, r in enumerate(ranks):
        if world == 1:  # the baseline: the kernels one GPU runs (whole index, no maps, no merge), and nothing else
            backend = ring.backend
            final_out, final_lse = backend.vertical_slash_forward(q, k, v, index, scale)
            fwd_call = partial(backend.vertical_slash_forward, q, k, v, index, scale)
            bwd_call = partial(backend.vertical_slash_backward, do, q, k, v, final_out, final_lse, index, scale)
            fwd, bwd = time_call(fwd_call, "forward"), time_call(bwd_call, "backward")
            rows.append(row(0, 0, range(1), fwd, bwd))
            del final_out, final_lse, fwd_call, bwd_call  # at 4M tokens their 16 GiB are the rings' room
            continue
        steps = [range(s - s % group, s - s % group + group) for s in sources[r][::group]]  # one per outer step
        rank = RankSteps(ring, r, steps, layout.shard(q, r), layout.shard(do, r), kv_parts, scale)
        if checked < args.check_ranks:
            torch.testing.assert_close(rank.final_out, layout.shard(expected, r), **TOLERANCES[args.dtype])
        for step, srcs in enumerate(steps):
            fwd = time_call(partial(rank.forward, srcs), "forward")
            bwd = time_call(partial(rank.backward, srcs), "backward")
            rows.append(row(r, step, srcs, fwd, bwd))
    return rows


def sampled_ranks(world: int, count: int | None) -> list[int]:
    """The ranks measured: all (``count`` None or >= ``world``), else ``count`` evenly spaced ones, the first and the
    last among them (the striped layout gives every rank nearly the same work, so a few stand for all)."""
    if count is None or count >= world:
        return list(range(world))
    if count < 1:
        raise ValueError(f"--ranks must be >= 1; got {count}")
    return sorted({round(i * (world - 1) / max(count - 1, 1)) for i in range(count)})


FIT_TERMS = ("tiles", "column_chunks", "offsets", "programs")
"""The rows' per-step terms the fit prices, in ``sim.costs.StepCost``'s order after the fixed cost."""


def fit(rows: Sequence[dict[str, float]], key: str) -> tuple[list[float], torch.Tensor]:
    """Least squares ``ms = fixed + Σ coefficient · term`` over :data:`FIT_TERMS` of ``rows``' ``key``, on the
    relative error (from the 0.2 ms steps of W = 32 to the 30 ms ones of W = 8), each ring shape (length, W, group)
    weighing the same in total (a ring passing its shards has W steps per rank, a whole gathered K/V one; weighing
    pairs alike fitted the one-step shapes 8-14 % off), every coefficient kept >= 0 (a cost: a term whose coefficient
    comes out negative is dropped and the rest refitted). The five coefficients (ms) and each row's relative error
    ``(predicted - measured) / measured``."""
    a = torch.tensor([[1.0] + [r.get(t, 0.0) for t in FIT_TERMS] for r in rows], dtype=torch.float64)
    y = torch.tensor([r[key] for r in rows], dtype=torch.float64)
    shape = [(r["seqlen"], r["world"], r["group"]) for r in rows]
    counts = Counter(shape)
    w = torch.tensor([counts[x] ** -0.5 for x in shape], dtype=torch.float64)
    kept = list(range(a.shape[1]))
    while True:
        coef = torch.zeros(a.shape[1], dtype=torch.float64)
        coef[kept] = torch.linalg.lstsq(a[:, kept] / y[:, None] * w[:, None], w[:, None]).solution[:, 0]
        negative = [i for i in kept if coef[i] < 0]
        if not negative:
            return coef.tolist(), (a @ coef - y) / y
        kept.remove(min(negative, key=lambda i: coef[i]))


def exchange(group: int) -> str:
    """How a row's K/V moved: the ring's one hop per step, or all-gathered in groups."""
    return "ring" if group == 1 else f"all-gather {group}"


def overhead_table(
    rows: Sequence[dict[str, float]], seqlens: Sequence[int], shapes: Sequence[tuple[int, int]]
) -> list[str]:
    """Markdown lines: per length and (ring size, group), the (rank, step) pairs' forward and backward ms summed and
    their total over the one-device kernels' (the ``world == 1`` rows of the same length); a sampled rank's rows count
    for the ranks it stands for (``weight``)."""

    def total(seqlen: int, world: int, group: int, key: str) -> float:
        # A sampled rank stands for world / sampled ranks (its row's weight).
        picked = [r for r in rows if (r["seqlen"], r["world"], r["group"]) == (seqlen, world, group)]
        return sum(r[key] * r["weight"] for r in picked)

    lines = [
        "",
        "## Ring overhead: the sum over (rank, step) of forward + backward over the one-device kernels",
        "",
        "| tokens | W | K/V | steps per rank | fwd ms (sum) | bwd ms (sum) | fwd + bwd ms | overhead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seqlen in seqlens:
        one = total(seqlen, 1, 1, "fwd_ms") + total(seqlen, 1, 1, "bwd_ms")
        for world, group in shapes:
            fwd, bwd = total(seqlen, world, group, "fwd_ms"), total(seqlen, world, group, "bwd_ms")
            if not one or not fwd:  # a length measured without one device, or without this ring (--refit)
                continue
            lines.append(
                f"| {harness.tokens(seqlen)} | {world} | {exchange(group)} | {world // group} | {fwd:.2f} | "
                f"{bwd:.2f} | {fwd + bwd:.2f} | {(fwd + bwd) / one:.2f} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ring_steps", description=__doc__.split("\n\n")[0])
    harness.add_device_args(parser)
    harness.add_shape_args(parser)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--pattern", choices=("planted", "real"), default="planted")
    parser.add_argument("--density", type=float, default=0.05, help="planted pattern's density")
    parser.add_argument("--indices", type=Path, help="saved indices (--pattern real)")
    parser.add_argument("--layer", type=int, default=0, help="the saved layer to use (--pattern real)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rep-ms", type=float, default=20.0, help="timing budget per pair and direction")
    parser.add_argument("--check-ranks", type=int, default=1, help="ranks whose merged steps are checked first")
    parser.add_argument(
        "--ranks", type=int, default=None,
        help="measure this many evenly spaced ranks of each ring (default all), their sums scaled to the whole ring",
    )  # fmt: skip
    parser.add_argument(
        "--groups", type=int, nargs="+", default=[1],
        help="inner group sizes whose K/V is all-gathered into one step (1: the ring passes every shard; W: the whole "
        "K/V gathered); each run on the worlds it divides",
    )  # fmt: skip
    parser.add_argument("--fit", type=Path, help="where the fitted cost model goes (JSON)")
    parser.add_argument(
        "--refit", type=Path, nargs="+",
        help="measure nothing: fit the ring steps of these --fit files together (a calibration from several calls)",
    )  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.pattern == "real" and args.indices is None:
        parser.error("--pattern real needs --indices FILE (saved by eval.fidelity with keep_indices=True)")
    if args.device == "cuda" and not args.refit:
        harness.require_kernels(args.device)
    shape = (
        f"the steps of {', '.join(str(f) for f in args.refit)} (their shapes and GPU)"
        if args.refit
        else f"B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, block {BLOCK}, striped "
        f"layout, flat ring; pattern {args.pattern}"
        + (f" (density {args.density})" if args.pattern == "planted" else f" ({args.indices}, layer {args.layer})")
    )
    report = harness.Report(args.out)
    report.add(
        *harness.header("Ring steps on one GPU, and their cost model", __spec__.name, argv, device=args.device),
        "",
        shape,
    )
    if args.refit:
        # Files before 2026-12-06 have no groups (every call one ring step) and no weights (every rank measured).
        rows = [{"group": 1, "weight": 1.0, **r} for f in args.refit for r in json.loads(f.read_text())["steps"]]
        seqlens = sorted({r["seqlen"] for r in rows})
        shapes = sorted({(r["world"], r["group"]) for r in rows})
    else:
        seqlens = args.seqlens
        shapes = [(w, g) for w in args.worlds for g in args.groups if g <= w and w % g == 0 and (g == 1 or w > 1)]
        rows = [r for seqlen in seqlens for world, group in shapes for r in measure(args, seqlen, world, group)]
    # The model prices ring steps; the one-device rows are the overhead's baseline, another kernel form.
    ring = [r for r in rows if r["world"] > 1]
    model = {}
    for key, name in (("fwd_ms", "forward"), ("bwd_ms", "backward")):
        coef, error = fit(ring, key)
        model[name] = dict(zip(("fixed_ms", "per_tile_ms", "per_column_chunk_ms", "per_offset_ms", "per_program_ms"),
                               coef))  # fmt: skip
        report.add(
            "",
            f"## {name}: ms = {coef[0] * 1e3:.2f} µs + {coef[1] * 1e3:.4f} µs x tiles + {coef[2] * 1e3:.4f} µs x "
            f"column chunks + {coef[3] * 1e3:.5f} µs x offsets walked + {coef[4] * 1e3:.4f} µs x query-tile programs",
            "",
            "| tokens | W | K/V | pairs | measured ms (sum) | fitted ms (sum) | mean abs error | max abs error |",
            "|---|---|---|---|---|---|---|---|",
        )
        for seqlen in seqlens:
            for world, group in shapes:
                where = (seqlen, world, group)
                picked = [i for i, r in enumerate(ring) if (r["seqlen"], r["world"], r["group"]) == where]
                if not picked:
                    continue
                measured = sum(ring[i][key] * ring[i]["weight"] for i in picked)
                err = error[picked].abs()
                fitted = sum(ring[i][key] * ring[i]["weight"] * (1 + float(error[i])) for i in picked)
                report.add(
                    f"| {harness.tokens(seqlen)} | {world} | {exchange(group)} | {len(picked)} | {measured:.2f} | "
                    f"{fitted:.2f} | {float(err.mean()):.1%} | {float(err.max()):.1%} |"
                )
    if any(world == 1 for world, _ in shapes):
        report.add(*overhead_table(rows, seqlens, shapes))
    if args.fit is not None:
        args.fit.write_text(json.dumps({"model": model, "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
