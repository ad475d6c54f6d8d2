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

Per row: step time (mean of the timed steps after ``--warmup``) and its three phases (forward with the loss, backward,
optimizer step: each ended by a device synchronisation), tokens/s, speed-up over dense, the attention share
(``(sparse - none) / sparse``), the estimator share and the peak GPU memory of the step. ``--profile LENGTH:MODE``
runs one more step of that row under ``torch.profiler`` and reports its GPU kernel time by kind (sparse attention,
estimator, dense attention, matrix products, copies, the rest) against the step's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import platform
import re
import sys
import time
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


class Phases:
    """Wall time of the step's phases: ``forward_loss``, ``engine.backward`` and ``engine.step``, each ended by a
    device synchronisation so that its kernels count in it (patched on the module and the engine instance)."""

    def __init__(self, engine):
        self.engine = engine
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def _timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            _sync()
            self.seconds[name] += time.perf_counter() - start
            return result

        return wrapper

    @contextlib.contextmanager
    def use(self):
        from ds_mtraining.integration import loss

        real_forward = loss.forward_loss
        loss.forward_loss = self._timed("forward", real_forward)
        self.engine.backward = self._timed("backward", type(self.engine).backward.__get__(self.engine))
        self.engine.step = self._timed("optimizer", type(self.engine).step.__get__(self.engine))
        try:
            yield self
        finally:
            loss.forward_loss = real_forward
            del self.engine.backward, self.engine.step  # back to the class's methods


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


KERNEL_KINDS = (
    ("sparse attention", re.compile(r"^_(fwd|bwd_preprocess|bwd_dq|bwd_col|bwd_dkdv)_kernel")),
    ("dense attention", re.compile(r"flash|fmha|cudnn|attention", re.I)),
    ("estimator", re.compile(r"^_\w+_kernel|^_summary|^_key")),  # the package's other Triton kernels
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|cublas", re.I)),
    ("copies", re.compile(r"memcpy|memset", re.I)),
)


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel by its name (first match of :data:`KERNEL_KINDS`, else ``"other"``)."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def profile_step(row_plan, engine, attention, data, mesh, cursor) -> str:
    """One more step under ``torch.profiler``: a markdown table of GPU time by kernel kind and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        wall = train.train_step(row_plan, engine, attention, data, mesh, None, cursor)["seconds"]
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e6
    busy = sum(by_kind.values())
    lines = [
        f"Profiled step: {wall:.2f} s wall (under the profiler), GPU kernels {busy:.2f} s "
        f"(summed over streams), so the GPU waits at least {max(wall - busy, 0.0):.2f} s.",
        "",
        "| kernel kind | GPU s | share of wall |",
        "|---|---|---|",
        *(f"| {kind} | {t:.2f} | {t / wall:.0%} |" for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "",
        "| top kernels | kind | calls | GPU s |",
        "|---|---|---|---|",
    ]
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    lines += [
        f"| `{e.key[:70]}` | {kernel_kind(e.key)} | {e.count} | {e.self_device_time_total / 1e6:.3f} |" for e in top
    ]
    return "\n".join(lines)


def dense_kernels():
    """SDPA restricted to cuDNN / flash attention on a GPU (the math fallback would need N² memory)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True)


def run_row(
    p, engine, mesh, modes: Modes, seqlen: int, mode: str, warmup: int, steps: int, profiled: bool = False
) -> dict:
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
    records, phases = [], Phases(engine)
    with modes.use(mode), dense_kernels() if mode == "dense" else contextlib.nullcontext():
        for _ in range(warmup):
            records.append(train.train_step(row_plan, engine, attention, data, mesh, None, cursor))
        with phases.use():
            for _ in range(steps):
                records.append(train.train_step(row_plan, engine, attention, data, mesh, None, cursor))
        profiled_table = profile_step(row_plan, engine, attention, data, mesh, cursor) if profiled else None
    timed = records[warmup:]
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    sparse_layers = [d for d in timed[-1]["density"] if d < 1.0]
    return {
        "seqlen": seqlen,
        "mode": mode,
        "seconds": seconds,
        "spread": max(r["seconds"] for r in timed) - min(r["seconds"] for r in timed),
        **{name: t / steps for name, t in phases.seconds.items()},
        "profile": profiled_table,
        "tokens_per_s": seqlen / seconds,
        "peak_gib": peak,
        "loss": timed[-1]["loss"],
        "density": sum(sparse_layers) / len(sparse_layers) if sparse_layers else 1.0,
    }


def table(rows: list[dict]) -> str:
    by = {(r["seqlen"], r["mode"]): r for r in rows}
    lines = [
        "| tokens | mode | step (s) | ± (max-min) | forward | backward | optimizer | tokens/s | vs dense | "
        "attention share | estimator share | peak GPU (GiB) | sparse-layer density | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["seqlen"]
        dense, none, planted = by.get((n, "dense")), by.get((n, "none")), by.get((n, "planted"))
        speed = f"{dense['seconds'] / r['seconds']:.2f}x" if dense else "-"
        attn = f"{(r['seconds'] - none['seconds']) / r['seconds']:.0%}" if none and r["mode"] != "none" else "-"
        est = f"{(r['seconds'] - planted['seconds']) / r['seconds']:.1%}" if planted and r["mode"] == "sparse" else "-"
        lines.append(
            f"| {n // 1024}K | {r['mode']} | {r['seconds']:.2f} | {r['spread']:.2f} | {r['forward']:.2f} "
            f"| {r['backward']:.2f} | {r['optimizer']:.2f} | {r['tokens_per_s']:,.0f} | {speed} | {attn} | {est} "
            f"| {r['peak_gib']:.1f} | {r['density']:.3f} | {r['loss']:.3f} |"
        )
    for r in rows:
        if r["profile"]:
            lines += ["", f"### Profile: {r['seqlen'] // 1024}K {r['mode']}", "", r["profile"]]
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
    parser.add_argument(
        "--dense-warmup", type=int, help="warm-up steps of dense rows (default --warmup; cuDNN compiles nothing, so "
        "once an earlier row warmed the engine 0 saves a 100 s step at 256K)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.05, help="planted index density")
    parser.add_argument("--profile", nargs="*", default=[], help="LENGTH:MODE rows to profile one more step of")
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
    profiled = {(int(k), v) for k, v in (item.split(":") for item in args.profile)}
    rows = []
    for seqlen in args.lengths:
        for mode in only.get(seqlen, args.modes):
            try:
                warmup = args.warmup if mode != "dense" or args.dense_warmup is None else args.dense_warmup
                row = run_row(p, engine, mesh, modes, seqlen, mode, warmup, args.steps, (seqlen, mode) in profiled)
            except torch.OutOfMemoryError:
                print(f"{seqlen} {mode}: out of GPU memory", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(row)
            print(f"{seqlen} {mode}: {row['seconds']:.2f} s/step, peak {row['peak_gib']:.1f} GiB", flush=True)
            if row["profile"]:
                print(row["profile"], flush=True)
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.machine()} CPU"
    report = (
        f"# Training throughput through launch/train.py — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
        f"{device} · torch {torch.__version__} · transformers {transformers.__version__} · command: "
        f"`python {' '.join(sys.argv)}`\n\n```\n{train.describe(p)}\n```\n\n"
        f"Step = {p.accumulation} micro-batch(es) of 1 sequence; {args.warmup} warm-up step(s) "
        f"({args.warmup if args.dense_warmup is None else args.dense_warmup} for dense rows), then the mean of "
        f"{args.steps}. Sparse: the estimator runs every sparse layer (cost counted), then its index is replaced by a "
        f"planted one of density {args.density} (random weights have near-uniform attention).\n\n" + table(rows) + "\n"
    )
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
