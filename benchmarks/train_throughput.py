"""End-to-end training throughput through the main job's own code: dense vs sparse vs no attention, per length.

    python benchmarks/train_throughput.py --model model_configs/qwen2.5-3b --rope-kind yarn --rope-factor 16 \
        --lengths 32768 65536 131072 --out benchmarks/results/train_throughput.md

One process builds the engine once with ``launch/train.py``'s own ``plan`` and ``build_engine`` (the DeepSpeed
config, ZeRO stage, CPU optimizer offload, activation checkpointing with index reuse, the tiled loss) and times
``launch/train.py``'s own ``train_step`` at every length in every mode, so every row shares the same model and
engine (building a 3B-parameter engine once per row would cost more device time than the rows):

- ``dense``: every layer dense causal attention (SDPA, cuDNN or flash only: never the N² math fallback).
- ``sparse``: the config's sparse attention, the estimator run every layer with its cost counted. With random
  weights attention is near uniform and no real index exists, so the estimated index is then replaced by a planted
  one of ``--density`` (``ds_mtraining.sparse.planted``: sinks, columns, a local band and far bands, the shape of
  real indices); the report says so.
- ``planted``: the planted index without running the estimator (its cost = ``sparse`` - ``planted``).
- ``none``: no attention at all (each head returns its V): the ceiling no attention kernel can beat.

Per row: step time (mean of the timed steps after ``--warmup``), tokens/s, speed-up over dense, the attention share
(``(sparse - none) / sparse``), the estimator share and the peak GPU memory of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import platform
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = ("dense", "sparse", "planted", "none")


def _train_module():
    spec = importlib.util.spec_from_file_location("train_main", REPO / "launch" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


train = _train_module()


class Modes:
    """Switches ``ds_mtraining.integration.transformers`` between the benchmark's modes (module attributes)."""

    def __init__(self, density: float):
        from ds_mtraining.integration import transformers as integration

        self.integration = integration
        self.density = density
        self.real_estimate = integration.estimate_index
        self.real_attend = integration.MTrainingAttention.attend
        self.planted: dict[tuple, object] = {}

    def _planted(self, q: torch.Tensor, block_size: int):
        from ds_mtraining.sparse.planted import planted_index

        key = (q.shape[0], q.shape[2], q.shape[1], block_size, q.device)
        if key not in self.planted:
            generator = torch.Generator().manual_seed(0)
            self.planted[key] = planted_index(
                q.shape[0], q.shape[2], q.shape[1], block_size, density=self.density, generator=generator,
                device=q.device,
            )  # fmt: skip
        return self.planted[key]

    @contextlib.contextmanager
    def use(self, mode: str):
        integration, real_estimate = self.integration, self.real_estimate

        def plant_only(q, k, config, **kwargs):
            index = self._planted(q, config.block_size)
            ones = torch.ones(q.shape[0], q.shape[2], device=q.device)  # no observed recall: nothing was estimated
            return index, SimpleNamespace(density=index.density(q.shape[1]).float(), recall=ones)

        def estimate_then_plant(q, k, config, **kwargs):
            real_estimate(q, k, config, **kwargs)  # its cost counts; its index is not used
            return plant_only(q, k, config)

        def no_attention(attention, layer, q, k, v, scale):
            attention._record(layer, None, q)
            return v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)

        patches = {
            "sparse": ("estimate_index", estimate_then_plant),
            "planted": ("estimate_index", plant_only),
            "none": ("attend", no_attention),
        }
        try:
            if mode in patches:
                name, fn = patches[mode]
                target = integration.MTrainingAttention if name == "attend" else integration
                setattr(target, name, fn)
            yield
        finally:
            integration.estimate_index = real_estimate
            integration.MTrainingAttention.attend = self.real_attend


def dense_kernels():
    """SDPA restricted to cuDNN / flash attention on a GPU (the math fallback would need N² memory)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True)


def run_row(p, engine, mesh, modes: Modes, seqlen: int, mode: str, warmup: int, steps: int) -> dict:
    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.data import SyntheticCopyData
    from ds_mtraining.integration.transformers import MTrainingAttention

    args = argparse.Namespace(**(vars(p.args) | {"seqlen": seqlen}))
    data = SyntheticCopyData(seqlen, vocab_size=p.spec.config.vocab_size, seed=p.args.seed)
    row_plan = replace(p, args=args, data=data)
    sparse = SparseAttentionConfig(pattern="dense") if mode == "dense" else p.mtraining.sparse_attention
    attention = MTrainingAttention(sparse)
    cursor = train.Cursor()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    records = []
    with modes.use(mode), dense_kernels() if mode == "dense" else contextlib.nullcontext():
        for _ in range(warmup + steps):
            records.append(train.train_step(row_plan, engine, attention, data, mesh, None, cursor))
    timed = records[warmup:]
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    sparse_layers = [d for d in timed[-1]["density"] if d < 1.0]
    return {
        "seqlen": seqlen,
        "mode": mode,
        "seconds": seconds,
        "tokens_per_s": seqlen / seconds,
        "peak_gib": peak,
        "loss": timed[-1]["loss"],
        "density": sum(sparse_layers) / len(sparse_layers) if sparse_layers else 1.0,
    }


def table(rows: list[dict]) -> str:
    by = {(r["seqlen"], r["mode"]): r for r in rows}
    lines = [
        "| tokens | mode | step (s) | tokens/s | vs dense | attention share | estimator share | peak GPU (GiB) | "
        "sparse-layer density | loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["seqlen"]
        dense, none, planted = by.get((n, "dense")), by.get((n, "none")), by.get((n, "planted"))
        speed = f"{dense['seconds'] / r['seconds']:.2f}x" if dense else "-"
        attn = f"{(r['seconds'] - none['seconds']) / r['seconds']:.0%}" if none and r["mode"] != "none" else "-"
        est = f"{(r['seconds'] - planted['seconds']) / r['seconds']:.1%}" if planted and r["mode"] == "sparse" else "-"
        lines.append(
            f"| {n // 1024}K | {r['mode']} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | {speed} | {attn} | {est} "
            f"| {r['peak_gib']:.1f} | {r['density']:.3f} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="model_configs/qwen2.5-3b")
    parser.add_argument("--deepspeed", default=str(REPO / "ds_configs" / "zero2_offload.json"))
    parser.add_argument("--rope-kind", default=None)
    parser.add_argument("--rope-factor", default="16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--only", nargs="*", default=[], help="LENGTH:MODE,MODE rows to restrict a length to")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.05, help="planted index density")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    train.quiet_library_notices()
    argv = ["--model", args.model, "--deepspeed", args.deepspeed, "--seqlen", str(max(args.lengths)), "--no-save",
            "--output-dir", "/tmp/train_throughput"]  # fmt: skip
    if args.rope_kind:
        argv += ["--rope-kind", args.rope_kind, "--rope-factor", args.rope_factor]
    p = train.plan(train.parse_args(argv))
    print(train.describe(p), flush=True)
    train.init_distributed()
    from ds_mtraining.parallel.mesh import Mesh

    mesh = Mesh(p.shape)
    engine = train.build_engine(p, mesh)
    modes = Modes(args.density)
    only = {int(k): v.split(",") for k, v in (item.split(":") for item in args.only)}
    rows = []
    for seqlen in args.lengths:
        for mode in only.get(seqlen, args.modes):
            try:
                row = run_row(p, engine, mesh, modes, seqlen, mode, args.warmup, args.steps)
            except torch.OutOfMemoryError:
                print(f"{seqlen} {mode}: out of GPU memory", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(row)
            print(f"{seqlen} {mode}: {row['seconds']:.2f} s/step, peak {row['peak_gib']:.1f} GiB", flush=True)
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.machine()} CPU"
    report = (
        f"# Training throughput through launch/train.py — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
        f"{device} · torch {torch.__version__} · transformers {transformers.__version__} · command: "
        f"`python {' '.join(sys.argv)}`\n\n```\n{train.describe(p)}\n```\n\n"
        f"Step = {p.accumulation} micro-batch(es) of 1 sequence; {args.warmup} warm-up step(s), then the mean of "
        f"{args.steps}. Sparse: the estimator runs every sparse layer (cost counted), then its index is replaced by a "
        f"planted one of density {args.density} (random weights have near-uniform attention).\n\n" + table(rows) + "\n"
    )
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
