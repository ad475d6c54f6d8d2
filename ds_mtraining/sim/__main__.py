"""``python -m ds_mtraining.sim``: what a sparse (and a dense) training step does on a cluster, predicted.

    python -m ds_mtraining.sim --seqlen 524288 --world 32 --topology h100 --out FILE.md --heatmap FILE.png

Per plan (layout x ring x K/V exchange), one layer's attention forward and backward (the ring's dataflow replayed
with the measured step costs), its worker- and step-level imbalance and ring efficiency, the whole training step (the
rest of the model at its measured rate, ZeRO traffic, the optimizer) and one GPU's memory and its node's RAM (training's
start-up plan under the memory flags, ``sim.memory``); plans ranked by step time (``sim.report.rank_plans``), each
against one dense reference (the fastest of the same plans with dense attention).
The numbers are predictions of a model (``ds_mtraining.sim.cluster``), calibrated on one GPU: say so wherever they are
quoted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .block_patterns import moba_pattern, xattention_pattern
from .cluster import DENSE_COSTS, GPU_OPTIMIZER_S, ModelShape
from .costs import CALIBRATED, KernelCosts
from .heatmap import draw_heatmap
from .memory import MemoryAssumptions, memory_line, step_memory
from .patterns import cycled_heads, dense_index, load_saved_index, planted_pattern_index, stretched_index
from .presets import PRESETS
from .report import KV_EXCHANGES, LAYOUTS, RINGS, candidate_plans, rank_plans, table
from .timeline import Topology

OVERRIDES = (
    "gpus_per_node", "nvlink_gbs", "internode_gbs", "nvlink_latency_us", "internode_latency_us", "memory_gib",
    "host_gib",
)  # fmt: skip


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``: lists as typed, ``--x / --no-x`` pairs as the one that holds; options
    defaulting to None say in their help what decides them, and a plain flag is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default, pair = action.default, isinstance(action, argparse.BooleanOptionalAction)
        if default is None or default is argparse.SUPPRESS or (action.nargs == 0 and not pair):
            return action.help
        if pair:
            shown = action.option_strings[0 if default else 1]
        else:
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{action.help} (default: {shown})"


def _at_least(text: str, least: int, what: str) -> int:
    """``text`` as an integer of at least ``least``, else argparse's error naming ``what`` it should be."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1 (a count of tokens, GPUs, heads, layers...)."""
    return _at_least(text, 1, "a positive integer")


def _tile(text: str) -> int | str | None:
    """An argparse type for ``--mlp-tile``: ``auto``, ``none`` or a whole number of at least 1024 tokens."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    return _at_least(text, 1024, "auto, none or a number of tokens >= 1024")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ds_mtraining.sim", description=__doc__.split("\n\n")[0], formatter_class=_Defaults
    )
    p.add_argument("--seqlen", type=_positive, default=524288, help="tokens per sequence (one sequence a step)")
    p.add_argument("--world", type=_positive, default=32, help="GPUs on the sequence (context parallel)")
    topo = p.add_argument_group("topology (a preset, each value overridable; default: the preset's)")
    topo.add_argument(
        "--topology", choices=sorted(PRESETS), default="h100",
        help="a node of 8 GPUs: a100 (the MTraining paper's), h100 (what the step costs were fitted on), h200",
    )  # fmt: skip
    topo.add_argument("--gpus-per-node", type=int, help="GPUs sharing NVLink")
    topo.add_argument("--nvlink-gbs", type=float, help="intra-node GB/s per GPU, one direction")
    topo.add_argument("--internode-gbs", type=float, help="inter-node GB/s per GPU, one direction")
    topo.add_argument("--nvlink-latency-us", type=float, help="latency of an intra-node transfer")
    topo.add_argument("--internode-latency-us", type=float, help="latency of an inter-node transfer")
    topo.add_argument("--memory-gib", type=float, help="one GPU's memory as PyTorch reports it (80 GB cards: 79.1)")
    topo.add_argument(
        "--host-gib", type=float, help="one node's RAM, GiB (its ranks pin their checkpoints and offloaded state there)"
    )
    plan = p.add_argument_group("plans")
    plan.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="token layouts")
    plan.add_argument("--rings", nargs="+", choices=RINGS, default=["flat", "hierarchical"], help="ring kinds")
    plan.add_argument(
        "--ulysses", type=_positive, nargs="+", default=[2], help="Ulysses degrees of the 'ulysses' ring, a plan each"
    )
    plan.add_argument(
        "--columns", choices=("per_step", "gathered"), default="per_step", help="the ring's ring_columns schedule"
    )
    plan.add_argument(
        "--kv-exchange", nargs="+", choices=KV_EXCHANGES, default=list(KV_EXCHANGES),
        help="how K/V moves inside a group of ring ranks (parallel.kv_exchange), a plan each",
    )  # fmt: skip
    pat = p.add_argument_group("pattern")
    pat.add_argument(
        "--pattern", choices=("planted", "real", "moba", "xattention"), default="planted", help="the attention pattern"
    )
    pat.add_argument("--density", type=float, default=0.05, help="planted / xattention density")
    pat.add_argument("--indices", type=Path, help="saved indices (needed by --pattern real)")
    pat.add_argument(
        "--layer", type=int, default=3, help="the saved layer (--pattern real; its heads repeat in turn up to --heads)"
    )
    pat.add_argument("--chunk", type=int, default=4096, help="MoBA chunk tokens")
    pat.add_argument("--topk", type=int, default=3, help="MoBA chunks chosen")
    pat.add_argument("--seed", type=int, default=0, help="the pattern's random seed")
    model = p.add_argument_group("model (default: the 3B shape, measured on one H200)")
    shape = ModelShape()
    model.add_argument("--heads", type=_positive, default=shape.heads, help="query heads")
    model.add_argument("--kv-heads", type=_positive, default=shape.kv_heads, help="key / value heads")
    model.add_argument("--head-dim", type=_positive, default=shape.head_dim, help="dim of a head")
    model.add_argument("--layers", type=_positive, default=shape.layers, help="decoder layers")
    model.add_argument("--hidden", type=_positive, default=shape.hidden, help="hidden size (memory estimate)")
    model.add_argument("--intermediate", type=_positive, default=shape.intermediate, help="MLP size (memory estimate)")
    model.add_argument("--vocab", type=_positive, default=shape.vocab, help="vocabulary (memory estimate)")
    model.add_argument("--params", type=float, default=shape.params, help="parameters")
    model.add_argument(
        "--non-attention-us-per-token", type=float, default=shape.non_attention_us_per_token,
        help="the rest of the model's time a token on one GPU, µs",
    )  # fmt: skip
    model.add_argument(
        "--optimizer-s", type=float,
        help=f"the optimizer step on one GPU, s (default: {shape.optimizer_s} with --offload, {GPU_OPTIMIZER_S} "
        "without)",
    )  # fmt: skip
    model.add_argument("--accumulation", type=_positive, default=1, help="micro-batches a step")
    mem = p.add_argument_group("memory (training's own estimate, for each plan)")
    mem.add_argument("--zero-stage", type=int, choices=range(4), default=2, help="ZeRO stage (the step's time prices "
                     "ZeRO-2's traffic whatever the stage)")  # fmt: skip
    mem.add_argument(
        "--offload", action=argparse.BooleanOptionalAction, default=True, help="optimizer state on the CPU"
    )
    mem.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True, help="Liger's fused kernels")
    mem.add_argument(
        "--cpu-checkpointing", action=argparse.BooleanOptionalAction, default=False,
        help="activation checkpoints in pinned host memory (DeepSpeed's activation_checkpointing.cpu_checkpointing)",
    )  # fmt: skip
    mem.add_argument(
        "--mlp-tile", type=_tile, default="none",
        help="the MLP in tiles of this many tokens (tiled_mlp.tokens_per_tile): a number >= 1024, none, or auto "
        "(decided as the training job decides it, on this topology's GPUs and nodes)",
    )  # fmt: skip
    p.add_argument(
        "--costs", type=Path, help="a ring-step fit (benchmarks.ring_steps --fit); default: the committed one"
    )
    p.add_argument("--no-dense", action="store_true", help="skip the dense reference")
    p.add_argument("--heatmap", type=Path, help="PNG of the fastest plan's kernel time per (ring rank, step)")
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


def _topology(args: argparse.Namespace) -> Topology:
    overrides = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    try:
        return Topology(**{**PRESETS[args.topology].__dict__, **overrides})
    except ValueError as err:
        raise SystemExit(f"error: {err}; fix the override that made it (--{'/--'.join(OVERRIDES).replace('_', '-')})")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    topology = _topology(args)
    if args.costs and not args.costs.is_file():
        raise SystemExit(
            f"error: --costs {args.costs}: no such file; write one with python -m benchmarks.ring_steps --fit, or "
            "leave --costs out for the committed fit"
        )
    costs = KernelCosts.from_fit(args.costs) if args.costs else CALIBRATED
    assumptions = MemoryAssumptions(args.zero_stage, args.offload, args.fused, args.cpu_checkpointing, args.mlp_tile)
    optimizer_s = args.optimizer_s
    if optimizer_s is None:
        optimizer_s = ModelShape.optimizer_s if args.offload else GPU_OPTIMIZER_S
    shape = ModelShape(
        args.heads, args.kv_heads, args.head_dim, args.layers, args.params, args.non_attention_us_per_token,
        optimizer_s, hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab,
    )  # fmt: skip
    block = costs.block_size
    plans = candidate_plans(
        topology.gpus_per_node, layouts=args.layouts, rings=args.rings, ulysses=args.ulysses,
        kv_exchanges=args.kv_exchange, columns=args.columns,
    )  # fmt: skip
    common = dict(shape=shape, plans=plans, assumptions=assumptions, accumulation=args.accumulation)
    sparse, refused = rank_plans(args.world, args.seqlen, topology, costs, pattern=_pattern(args, block), **common)
    dense_runs = []
    if not args.no_dense:  # the same plans, dense: those the cluster cannot run are refused alike
        dense = dense_index(args.heads, args.seqlen, block)
        dense_runs = rank_plans(args.world, args.seqlen, topology, DENSE_COSTS, pattern=dense, **common)[0]
    memory = step_memory(shape, args.seqlen, args.world, assumptions, topology)
    lines = [
        f"# Predicted: {args.seqlen // 1024}K tokens on {args.world} GPUs ({args.pattern} pattern, {args.topology})",
        "",
        (
            f"Topology: {topology}. Step costs: {costs.source}. Dense steps: {DENSE_COSTS.source}. Model: {shape}. "
            f"Columns: {args.columns}. K/V exchange: {', '.join(args.kv_exchange)} (all-gathered: the collectives not "
            "overlapped with compute, the runtime does not prefetch them). These are predictions of "
            "`ds_mtraining.sim`, not measurements."
        ),
        "",
        *table(sparse, dense_runs, refused),
        memory_line(memory, args.seqlen, args.world),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    if args.heatmap and sparse:
        draw_heatmap(sparse[0].attention, args.heatmap, args.world, "the fastest predicted plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
