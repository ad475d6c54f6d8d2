"""A/B of two checkouts on one GPU: the estimated indices bit for bit, the kernel and the estimator's times.

Run once in each checkout's root (``python -m`` imports that checkout's ``ds_mtraining`` and benchmark settings),
then compare::

    cd OLD && python -m benchmarks.ab_main --save ../old.pt
    cd NEW && python -m benchmarks.ab_main --save ../new.pt
    python -m benchmarks.ab_main --compare old.pt new.pt --out FILE
    python -m benchmarks.ab_main --device cpu --seqlens 256 --rep-ms 1 --save FILE       # CPU smoke test

Recorded per side: the ``"baseline"`` and ``"spread"`` estimators' indices (``benchmarks.strategies``) on three kinds
of q/k (random, ``benchmarks.cases.planted_heads``, ``benchmarks.cases.sparse95_heads``) at each of ``--seqlens``
(32K, 128K); at the longest, the spread estimator's time on the 95 %-sparse heads and ``vertical_slash_attention``
forward and forward+backward on ``benchmarks.cases.index_for_density`` (95 % sparsity, Hq=16, Hkv=2, D=128, bs=128,
bf16; a new index object per call, so both sides convert it to the kernels' form every call, as before the form was
cached on the index). ``--compare`` writes the table and exits 1 unless every index is equal bit for bit (times are
reported, judged by the reader: noise on an H200 is about 1-2 %).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.cases import index_for_density, planted_heads, random_qkv, sparse95_heads
from benchmarks.strategies import GRAPHS, STRATEGIES
from ds_mtraining.estimator import estimate_index
from ds_mtraining.sparse import AttentionPattern, vertical_slash_attention

KINDS = ("random", "planted", "sparse95")


def inputs(kind: str, n: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[1, n, 16, 128]``, k ``[1, n, 2, 128]`` of one kind."""
    if kind == "random":
        return random_qkv(n, torch.Generator().manual_seed(n), device=device, dtype=dtype)[:2]
    plant = planted_heads if kind == "planted" else sparse95_heads
    return plant(n, 16, 0, device=device, dtype=dtype)


def measure(args: argparse.Namespace) -> dict:
    """One side's record: ``indices`` by name (vertical, slash on the CPU), ``ms`` by name, the attention's
    ``density``."""
    device, dtype, timed = args.device, harness.DTYPES[args.dtype], max(args.seqlens)

    def ms(fn) -> float:
        return harness.median_ms(fn, rep_ms=args.rep_ms, device=device)

    record: dict = {"indices": {}, "ms": {}}
    for kind in KINDS:
        for n in args.seqlens:
            q, k = inputs(kind, n, device, dtype)
            for name in ("baseline", "spread"):
                index = estimate_index(q, k, STRATEGIES[name], graphs=GRAPHS)
                record["indices"][f"{name} {kind} {n}"] = (index.vertical.cpu(), index.slash.cpu())
            if kind == "sparse95" and n == timed:
                record["ms"][f"spread estimator, {harness.tokens(n)}"] = ms(
                    lambda q=q, k=k: estimate_index(q, k, STRATEGIES["spread"], graphs=GRAPHS)
                )
    q, k, v = random_qkv(timed, torch.Generator().manual_seed(1), device=device, dtype=dtype)
    index, record["density"] = index_for_density(1, 16, timed, 128, 0.05, device=device)

    def fresh():  # a new index object per call: both sides convert it to the kernels' form every time
        return AttentionPattern(timed, type(index)(index.vertical, index.slash, index.block_size))

    record["ms"][f"attention fwd, {harness.tokens(timed)} / 95 %"] = ms(
        lambda: vertical_slash_attention(q, k, v, fresh(), check_index=False)
    )
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def step() -> None:
        out = vertical_slash_attention(qg, kg, vg, fresh(), check_index=False)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    record["ms"][f"attention fwd+bwd, {harness.tokens(timed)} / 95 %"] = ms(step)
    return record


def compare(old: dict, new: dict) -> tuple[list[str], bool]:
    """The table of both records and whether every index and the density are equal."""
    lines = ["| case | old | new | new / old |", "|---|---|---|---|"]
    for name, ms in old["ms"].items():
        lines.append(f"| {name} (ms) | {ms:.3f} | {new['ms'][name]:.3f} | {new['ms'][name] / ms:.3f} |")
    lines += ["", f"attention index density {old['density']:.4f} (old), {new['density']:.4f} (new)", ""]
    lines += ["| index | vertical equal | slash equal |", "|---|---|---|"]
    ok = old["density"] == new["density"] and old["indices"].keys() == new["indices"].keys()
    for name, (vertical, slash) in old["indices"].items():
        v_new, s_new = new["indices"].get(name, (None, None))
        same = (v_new is not None and torch.equal(vertical, v_new), s_new is not None and torch.equal(slash, s_new))
        ok &= all(same)
        lines.append(f"| {name} | {same[0]} | {same[1]} |")
    lines += ["", "PASS: every index equal bit for bit" if ok else "FAIL: an index or the density differs"]
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="where this checkout's record goes")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    harness.add_device_args(parser)
    args = parser.parse_args(argv)
    if args.compare:
        lines, ok = compare(*(torch.load(p) for p in args.compare))
        harness.Report(args.out).add(*harness.header("A/B of two checkouts", __spec__.name, argv), "", *lines)
        return 0 if ok else 1
    if args.save is None:
        parser.error("give --save FILE, or --compare OLD NEW")
    torch.save(measure(args), args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
