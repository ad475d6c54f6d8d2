"""A/B of two checkouts on one GPU: the estimated indices bit for bit, the kernel and the estimator's times.

Run once per checkout, then compare::

    python benchmarks/ab_main.py --tree OLD --save old.pt
    python benchmarks/ab_main.py --tree . --save new.pt
    python benchmarks/ab_main.py --compare old.pt new.pt [--out FILE]

``--tree`` is the root of the checkout whose package and benchmark settings are used (its ``ds_mtraining`` and
``benchmarks/estimator_bench.py``, ``benchmarks/kernel_bench.py``), so one script measures both sides on the same
inputs. Recorded per side: the ``"baseline"`` and ``"spread"`` estimators' indices on three kinds of q/k (random,
``estimator_bench.planted``, ``estimator_bench.sparse95``) at 32K and 128K; the spread estimator's time at 128K;
``vertical_slash_attention`` forward and forward+backward at 128K on ``kernel_bench.index_for_density`` (95 %
sparsity, Hq=16, Hkv=2, D=128, bs=128, bf16; a new index object per call, so both sides convert it to the kernels'
form every call, as before the form was cached on the index). ``--compare`` prints the table and exits 1 unless every index is
equal bit for bit (times are reported, judged by the reader: noise on an H200 is about 1-2 %).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

LENGTHS = (32768, 131072)
TIMED = 131072


def _load(tree: Path):
    sys.path[:0] = [str(tree), str(tree / "benchmarks")]
    return importlib.import_module("estimator_bench"), importlib.import_module("kernel_bench")


def _inputs(eb, kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "random":
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(1, n, 16, 128, generator=gen).to("cuda", torch.bfloat16)
        return q, torch.randn(1, n, 2, 128, generator=gen).to("cuda", torch.bfloat16)
    return getattr(eb, kind)(n, 16, 0)


def _ms(fn, reps: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, rep=reps))


def measure(tree: Path) -> dict:
    eb, kb = _load(tree.resolve())
    # The estimator's CUDA graphs: module-global before the estimator package, a cache the caller passes after.
    graphs = {"graphs": eb.GRAPHS} if hasattr(eb, "GRAPHS") else {}
    record: dict = {"indices": {}, "ms": {}}
    for kind in ("random", "planted", "sparse95"):
        for n in LENGTHS:
            q, k = _inputs(eb, kind, n)
            for name in ("baseline", "spread"):
                index = eb.estimate_index(q, k, eb.STRATEGIES[name], **graphs)
                record["indices"][f"{name} {kind} {n}"] = (index.vertical.cpu(), index.slash.cpu())
            if kind == "sparse95" and n == TIMED:
                record["ms"]["spread estimator, 128K"] = _ms(
                    lambda q=q, k=k: eb.estimate_index(q, k, eb.STRATEGIES["spread"], **graphs)
                )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, TIMED, 16, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, TIMED, 2, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    index, _ = kb.index_for_density(1, 16, TIMED, 128, 0.05)
    record["density"] = float(index.density(TIMED).mean())

    def fresh():  # a new index object per call: both sides convert it to the kernels' form every time
        return type(index)(index.vertical, index.slash, index.block_size)

    record["ms"]["attention fwd, 128K / 95 %"] = _ms(
        lambda: eb.vertical_slash_attention(q, k, v, fresh(), check_index=False)
    )
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def step() -> None:
        out = eb.vertical_slash_attention(qg, kg, vg, fresh(), check_index=False)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    record["ms"]["attention fwd+bwd, 128K / 95 %"] = _ms(step)
    return record


def compare(old: dict, new: dict) -> tuple[str, bool]:
    lines = ["| case | old | new | new / old |", "|---|---|---|---|"]
    for name, ms in old["ms"].items():
        lines.append(f"| {name} (ms) | {ms:.3f} | {new['ms'][name]:.3f} | {new['ms'][name] / ms:.3f} |")
    lines += ["", f"attention index density {old['density']:.4f} (old), {new['density']:.4f} (new)", ""]
    lines += ["| index | vertical equal | slash equal |", "|---|---|---|"]
    ok = old["density"] == new["density"] and old["indices"].keys() == new["indices"].keys()
    for name, (vertical, slash) in old["indices"].items():
        v_new, s_new = new["indices"][name]
        same = (torch.equal(vertical, v_new), torch.equal(slash, s_new))
        ok &= all(same)
        lines.append(f"| {name} | {same[0]} | {same[1]} |")
    lines.append("")
    lines.append("PASS: every index equal bit for bit" if ok else "FAIL: an index or the density differs")
    return "\n".join(lines), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="checkout to measure")
    parser.add_argument("--save", type=Path, help="where --tree's record goes")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.compare:
        text, ok = compare(*(torch.load(p) for p in args.compare))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        sys.exit(0 if ok else 1)
    if args.tree is None or args.save is None:
        parser.error("give --tree and --save, or --compare OLD NEW")
    torch.save(measure(args.tree), args.save)


if __name__ == "__main__":
    main()
