"""``python -m ds_mtraining.sim``: what a sparse (and a dense) training step does on a cluster, predicted.

    python -m ds_mtraining.sim --seqlen 524288 --world 32 --topology a100 --out FILE.md --heatmap FILE.png

Per plan (layout x ring), one layer's attention forward and backward (the ring's dataflow replayed with the measured
step costs), its worker- and step-level imbalance and ring efficiency, and the whole training step (the rest of the
model at its measured rate, ZeRO-2 traffic, the optimizer), next to dense attention on the same plan. The numbers
are predictions of a model (``ds_mtraining.sim.cluster``), calibrated on one GPU: say so wherever they are quoted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .block_patterns import moba_pattern, xattention_pattern
from .cluster import DENSE_COSTS, ModelShape, Plan, simulate_attention, simulate_step
from .costs import CALIBRATED, KernelCosts
from .patterns import cycled_heads, dense_index, load_saved_index, planted_pattern_index, stretched_index
from .timeline import PRESETS, Topology

LAYOUTS = ("contiguous", "zigzag", "striped")
RINGS = ("flat", "hierarchical", "ulysses")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_mtraining.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=524288, help="tokens per sequence (one sequence a step)")
    p.add_argument("--world", type=int, default=32, help="GPUs on the sequence (context parallel)")
    topo = p.add_argument_group("topology (a preset, each value overridable)")
    topo.add_argument("--topology", choices=sorted(PRESETS), default="a100")
    topo.add_argument("--gpus-per-node", type=int)
    topo.add_argument("--nvlink-gbs", type=float, help="intra-node GB/s per GPU, one direction")
    topo.add_argument("--internode-gbs", type=float, help="inter-node GB/s per GPU, one direction")
    topo.add_argument("--nvlink-latency-us", type=float)
    topo.add_argument("--internode-latency-us", type=float)
    plan = p.add_argument_group("plans")
    plan.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    plan.add_argument("--rings", nargs="+", choices=RINGS, default=["flat", "hierarchical"])
    plan.add_argument("--ulysses", type=int, default=2, help="Ulysses degree of the 'ulysses' ring")
    plan.add_argument(
        "--columns", choices=("per_step", "gathered"), default="per_step", help="the ring's ring_columns schedule"
    )
    pat = p.add_argument_group("pattern")
    pat.add_argument("--pattern", choices=("planted", "real", "moba", "xattention"), default="planted")
    pat.add_argument("--density", type=float, default=0.05, help="planted / xattention density")
    pat.add_argument("--indices", type=Path, help="saved indices (--pattern real)")
    pat.add_argument(
        "--layer", type=int, default=3, help="the saved layer (--pattern real; its heads repeat in turn up to --heads)"
    )
    pat.add_argument("--chunk", type=int, default=4096, help="MoBA chunk tokens")
    pat.add_argument("--topk", type=int, default=3, help="MoBA chunks chosen")
    pat.add_argument("--seed", type=int, default=0)
    model = p.add_argument_group("model (default: the 3B shape, measured on one H200)")
    shape = ModelShape()
    model.add_argument("--heads", type=int, default=shape.heads)
    model.add_argument("--kv-heads", type=int, default=shape.kv_heads)
    model.add_argument("--head-dim", type=int, default=shape.head_dim)
    model.add_argument("--layers", type=int, default=shape.layers)
    model.add_argument("--params", type=float, default=shape.params)
    model.add_argument("--non-attention-us-per-token", type=float, default=shape.non_attention_us_per_token)
    model.add_argument("--optimizer-s", type=float, default=shape.optimizer_s)
    model.add_argument("--accumulation", type=int, default=1)
    p.add_argument(
        "--costs", type=Path, help="a ring-step fit (benchmarks.ring_steps --fit); default: the committed one"
    )
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument("--heatmap", type=Path, help="PNG of forward compute per (worker, step), one panel per layout")
    p.add_argument("--out", type=Path, help="also write the report here (markdown)")
    return p


def _pattern(args: argparse.Namespace, block: int):
    if args.pattern == "planted":
        return planted_pattern_index(1, args.heads, args.seqlen, block, density=args.density, seed=args.seed)
    if args.pattern == "real":
        if args.indices is None:
            raise SystemExit(
                "error: --pattern real needs --indices FILE (e.g. benchmarks/results/2026-11-29-smollm2_8k_indices.pt)"
            )
        return cycled_heads(stretched_index(load_saved_index(args.indices, args.layer), args.seqlen, block), args.heads)
    if args.pattern == "moba":
        return moba_pattern(args.seqlen, args.heads, block_size=block, chunk=args.chunk, topk=args.topk, seed=args.seed)
    return xattention_pattern(args.seqlen, args.heads, block_size=block, density=args.density, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    base = PRESETS[args.topology]
    overrides = {k: getattr(args, k) for k in ("gpus_per_node", "nvlink_gbs", "internode_gbs", "nvlink_latency_us",
                                               "internode_latency_us") if getattr(args, k) is not None}  # fmt: skip
    topology = Topology(**{**base.__dict__, **overrides})
    costs = KernelCosts.from_fit(args.costs) if args.costs else CALIBRATED
    shape = ModelShape(
        args.heads, args.kv_heads, args.head_dim, args.layers, args.params, args.non_attention_us_per_token,
        args.optimizer_s,
    )  # fmt: skip
    block = costs.block_size
    pattern = _pattern(args, block)
    dense = None if args.no_dense else dense_index(args.heads, args.seqlen, block)
    lines = [
        f"# Predicted: {args.seqlen // 1024}K tokens on {args.world} GPUs ({args.pattern} pattern)",
        "",
        (
            f"Topology: {topology}. Step costs: {costs.source}. Dense steps: {DENSE_COSTS.source}. Model: {shape}. "
            f"Columns: {args.columns}. These are predictions of `ds_mtraining.sim`, not measurements."
        ),
        "",
        (
            "| plan | fwd ms | bwd ms | all-to-all ms | worker imb. | step imb. | ring eff. | exposed | step s | "
            "tokens/s | dense step s | vs dense |"
        ),
        "|" + "---|" * 12,
    ]
    heat, counted, dense_counted = {}, {}, {}
    for ring in args.rings:
        for layout in args.layouts:
            plan = Plan(layout, ring, args.ulysses if ring == "ulysses" else 1, args.columns)
            try:
                att = simulate_attention(
                    pattern, args.seqlen, args.world, plan, topology, costs, shape, counted=counted
                )  # fmt: skip
            except ValueError as err:
                lines.append(f"| {plan.name} | not possible: {err} |" + " |" * 10)
                continue
            step = simulate_step(att, args.seqlen, args.world, topology, shape, accumulation=args.accumulation)
            dense_s, ratio = "-", "-"
            if dense is not None:
                datt = simulate_attention(
                    dense, args.seqlen, args.world, plan, topology, DENSE_COSTS, shape, counted=dense_counted
                )  # fmt: skip
                d = simulate_step(datt, args.seqlen, args.world, topology, shape, accumulation=args.accumulation)
                dense_s, ratio = f"{d.step_s:.2f}", f"{d.step_s / step.step_s:.2f}x"
            fwd, bwd = att.forward, att.backward
            exposed = (fwd.exposed_ms + bwd.exposed_ms) / (fwd.total_ms + bwd.total_ms)
            w = att.work
            lines.append(
                f"| {plan.name} | {fwd.total_ms:.1f} | {bwd.total_ms:.1f} | {att.all_to_all_ms:.1f} | "
                f"{w.worker_imbalance:.3f} | {w.step_imbalance:.3f} | {(fwd.efficiency + bwd.efficiency) / 2:.3f} | "
                f"{exposed:.0%} | {step.step_s:.2f} | {step.tokens_per_s:,.0f} | {dense_s} | {ratio} |"
            )
            if ring == args.rings[0]:
                heat[layout] = fwd.compute
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    if args.heatmap and heat:
        _heatmap(heat, args.heatmap, f"forward ms per (worker, step), {args.rings[0]} ring, {args.world} GPUs")
    return 0


def _heatmap(panels: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    top = max(float(m.max()) for m in panels.values())
    for ax, (name, m) in zip(axes[0], panels.items()):
        im = ax.imshow(m.numpy(), vmin=0, vmax=top, cmap="viridis", aspect="auto")
        ax.set(title=name, xlabel="ring step", ylabel="worker")
    fig.colorbar(im, ax=axes[0].tolist(), label="ms")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
