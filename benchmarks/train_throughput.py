"""End-to-end training throughput through the package's own ``Trainer``: dense vs sparse vs no attention, per
length, each micro-batch and the optimizer step apart, the step at accumulation 1 and at ``--accumulation``.

    python -m benchmarks.train_throughput --model model_configs/qwen2.5-3b --rope-kind yarn --rope-factor 16 \
        --lengths 131072 262144 --accumulation 64 --out benchmarks/results/train_throughput.md

Per ``--fused-kernels`` setting (``true false`` compares Liger's fused RMSNorm, SwiGLU and RoPE with transformers'
modules in one run), one process builds one :class:`~ds_mtraining.training.Trainer` from the config (the DeepSpeed
engine: ZeRO stage, CPU optimizer offload, activation checkpointing with index reuse, the tiled loss), with
``gradient_accumulation_steps`` set to ``--accumulation``, and times its micro-batches at every length in every mode,
so the rows of a setting share one model and engine (building a 3B-parameter engine once per row would cost more
device time than the rows); the next setting's Trainer is built after the previous one is closed. The modes are the
attention handle's index sources (``MTrainingAttention.indices``):

- ``dense``: every layer dense causal attention (SDPA, cuDNN or flash only: never the N² math fallback).
- ``sparse``: the config's sparse attention, the estimator run every layer with its cost counted, then a planted
  index of ``--density`` (``PlantedIndices``): random weights have near-uniform attention and no real index.
- ``planted``: the planted index without running the estimator (its cost = ``sparse`` - ``planted``).
- ``none``: no attention at all (each head returns its V): the ceiling no attention kernel can beat.

Per row, after ``--warmup`` micro-batches (the last one at an accumulation boundary, so the optimizer is warm too;
with CPU offload the first micro-batch inside an accumulation allocates DeepSpeed's pinned gradient buffers, so
the default 2 warms that path too):
``--steps`` micro-batches inside an accumulation (DeepSpeed's ``set_gradient_accumulation_boundary(False)``: no
optimizer step), then one at the boundary followed by the optimizer step. Reported: the micro-batch (forward +
backward, mean), the boundary micro-batch, the optimizer step, the step at accumulation 1 (boundary micro-batch +
optimizer) and at ``--accumulation`` A (``(A - 1)`` micro-batches + boundary micro-batch + optimizer), tokens/s and
speed-up over dense at both, the attention share, the estimator share, the peak GPU memory and beside it the
start-up estimate of it (``memory.step_estimate``, the levers as the run has them). ``--profile
LENGTH:MODE`` runs one more boundary micro-batch of that row under ``torch.profiler`` and reports its GPU kernel
time by kind (sparse attention, estimator, dense attention, matrix products, copies, the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import harness

REPO = Path(__file__).resolve().parents[1]
MODES = ("dense", "sparse", "planted", "none")
KERNEL_KINDS = (
    ("sparse attention", re.compile(r"^_(fwd|bwd_preprocess|bwd_dq|bwd_col|bwd_dkdv)_kernel")),
    ("dense attention", re.compile(r"flash|fmha|cudnn|attention", re.I)),
    ("fused element-wise (Liger)", re.compile(r"^_?(swiglu|rms_norm|triton_rope|rope|liger|element_mul)", re.I)),
    ("estimator", re.compile(r"^_\w+_kernel|^_summary|^_key")),  # the package's other Triton kernels
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|cublas", re.I)),
    ("copies", re.compile(r"memcpy|memset", re.I)),
)


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel by its name (first match of :data:`KERNEL_KINDS`, else ``"other"``)."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def profile_micro_batch(trainer) -> str:
    """One more boundary micro-batch and optimizer step under ``torch.profiler``: a markdown table of GPU time by
    kernel kind and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        harness.sync()
        start = time.perf_counter()
        trainer.engine.set_gradient_accumulation_boundary(True)
        trainer.micro_batch()
        harness.sync()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e6
    busy = sum(by_kind.values())
    lines = [
        f"Profiled boundary micro-batch + optimizer step: {wall:.2f} s wall (under the profiler), GPU kernels "
        f"{busy:.2f} s (summed over streams), so the GPU waits at least {max(wall - busy, 0.0):.2f} s.",
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


def use_mode(trainer, seqlen: int, mode: str, density: float) -> None:
    """Point ``trainer`` at synthetic rows of ``seqlen`` tokens and an attention handle of ``mode``."""
    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.data import SyntheticCopyData
    from ds_mtraining.integration.transformers import PlantedIndices

    p = trainer.plan
    data = SyntheticCopyData(seqlen, vocab_size=p.spec.config.vocab_size, seed=p.settings.seed)
    trainer.plan = replace(p, settings=replace(p.settings, seqlen=seqlen), data=data)
    sparse = SparseAttentionConfig(pattern="dense") if mode == "dense" else p.mtraining.sparse_attention
    indices = {
        "dense": "estimated",  # every layer dense: nothing is estimated
        "sparse": PlantedIndices(density, run_estimator=True),
        "planted": PlantedIndices(density, run_estimator=False),
        "none": "none",
    }[mode]
    trainer.attention = replace(trainer.attention, sparse=sparse, indices=indices, stats={})


def estimated_gib(trainer, seqlen: int) -> float:
    """The start-up estimate of a rank's peak GPU memory (``memory.step_estimate``) for the row's length and attention,
    to stand beside the measured peak."""
    from ds_mtraining.memory import step_estimate

    p = trainer.plan
    mtraining = p.mtraining.model_copy(update={"sparse_attention": trainer.attention.sparse})
    tokens = p.micro_batch * seqlen
    estimate = step_estimate(p.ds_config, mtraining, p.spec.config, p.shape, tokens=tokens, fused=p.fused.apply)
    return estimate.total / 2**30


def timed_micro_batch(trainer, boundary: bool) -> dict[str, float]:
    """One micro-batch inside an accumulation (``boundary`` False: no optimizer step) or at its boundary: the
    seconds of its phases (``Trainer.micro_batch``'s) and its loss."""
    from ds_mtraining.training.trainer import PHASES

    trainer.engine.set_gradient_accumulation_boundary(boundary)
    phases = dict.fromkeys(PHASES, 0.0)
    loss = trainer.micro_batch(phases)
    return phases | {"loss": float(loss)}


def run_row(trainer, seqlen: int, mode: str, *, density: float, warmup: int, steps: int, accumulation: int,
            profiled: bool = False) -> dict:  # fmt: skip
    """Time one (length, mode) row: ``warmup`` micro-batches (the last at a boundary), ``steps`` inside an
    accumulation, one at the boundary with the optimizer step."""
    use_mode(trainer, seqlen, mode, density)
    harness.sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with dense_kernels() if mode == "dense" else contextlib.nullcontext():
        for i in range(warmup):
            timed_micro_batch(trainer, boundary=i == warmup - 1)
        inside = [timed_micro_batch(trainer, boundary=False) for _ in range(steps)]
        last = timed_micro_batch(trainer, boundary=True)
        profile = profile_micro_batch(trainer) if profiled else None
    last_micro = last["forward"] + last["backward"]
    micro = sum(r["forward"] + r["backward"] + r["optimizer"] for r in inside) / steps if steps else last_micro
    step_1 = last_micro + last["optimizer"]
    step_a = (accumulation - 1) * micro + step_1
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    densities = [float(s.density) for s in trainer.attention.stats.values()]
    sparse_layers = [d for d in densities if d < 1.0]
    return {
        "seqlen": seqlen,
        "mode": mode,
        "micro": micro,
        "spread": max(r["forward"] + r["backward"] + r["optimizer"] for r in inside) - min(
            r["forward"] + r["backward"] + r["optimizer"] for r in inside
        ) if len(inside) > 1 else 0.0,
        "forward": last["forward"],
        "backward": last["backward"],
        "optimizer": last["optimizer"],
        "step_1": step_1,
        "step_a": step_a,
        "tokens_per_s_1": seqlen / step_1,
        "tokens_per_s_a": seqlen * accumulation / step_a,
        "peak_gib": peak,
        "estimated_gib": estimated_gib(trainer, seqlen),
        "loss": last["loss"],
        "density": sum(sparse_layers) / len(sparse_layers) if sparse_layers else 1.0,
        "profile": profile,
    }


def table(rows: list[dict], accumulation: int) -> str:
    """The rows as a markdown table: ratios against the same length's and fused setting's dense / none / planted
    rows (dense: the other setting's where this one has none), and (with both settings) the fused micro-batch's
    speed-up over the unfused one."""
    by = {(r["fused"], r["seqlen"], r["mode"]): r for r in rows if not r.get("out_of_memory")}
    a = accumulation
    lines = [
        f"| fused | tokens | mode | micro-batch (s) | fused speed-up | ± (max-min) | boundary fwd | boundary bwd | optimizer | step @1 (s) | "
        f"step @{a} (s) | tokens/s @1 | tokens/s @{a} | vs dense @1 | vs dense @{a} | attention share | "
        "estimator share | peak GPU (GiB) | estimated (GiB) | sparse-layer density | loss |",
        "|" + "---|" * 21,
    ]
    for r in rows:
        n, f = r["seqlen"], r["fused"]
        if r.get("out_of_memory"):
            lines.append(f"| {'on' if f else 'off'} | {harness.tokens(n)} | {r['mode']} | out of GPU memory |" + " |" * 13
                         + f" {r['peak_gib']:.1f} | | | |")  # fmt: skip
            continue
        dense = by.get((f, n, "dense")) or by.get((not f, n, "dense"))  # --dense-once: the other setting's
        none, planted = by.get((f, n, "none")), by.get((f, n, "planted"))
        unfused = by.get((False, n, r["mode"])) if f else None
        gain = f"{unfused['micro'] / r['micro']:.2f}x" if unfused else "-"
        speed_1 = f"{dense['step_1'] / r['step_1']:.2f}x" if dense else "-"
        speed_a = f"{dense['step_a'] / r['step_a']:.2f}x" if dense else "-"
        attn = f"{(r['micro'] - none['micro']) / r['micro']:.0%}" if none and r["mode"] != "none" else "-"
        est = f"{(r['micro'] - planted['micro']) / r['micro']:.1%}" if planted and r["mode"] == "sparse" else "-"
        lines.append(
            f"| {'on' if f else 'off'} | {harness.tokens(n)} | {r['mode']} | {r['micro']:.2f} | {gain} | {r['spread']:.2f} | {r['forward']:.2f} "
            f"| {r['backward']:.2f} | {r['optimizer']:.3f} | {r['step_1']:.2f} | {r['step_a']:.1f} "
            f"| {r['tokens_per_s_1']:,.0f} | {r['tokens_per_s_a']:,.0f} | {speed_1} | {speed_a} | {attn} | {est} "
            f"| {r['peak_gib']:.1f} | {r['estimated_gib']:.1f} | {r['density']:.3f} | {r['loss']:.3f} |"
        )
    for r in rows:
        if r.get("profile"):
            fused = "fused" if r["fused"] else "unfused"
            lines += ["", f"### Profile: {harness.tokens(r['seqlen'])} {r['mode']}, {fused}", "", r["profile"]]
    return "\n".join(lines)


def run_rows(trainer, args: argparse.Namespace, rows: list[dict], dense: bool = True, saved=lambda: None) -> None:
    """Append every (length, mode) row the flags ask for to ``rows``, in order, with this Trainer's fused setting
    (the dense rows only if ``dense``), calling ``saved`` after each. A row out of GPU memory is recorded as such and
    ends the setting: DeepSpeed's engine is not usable after it (the next row failed with "The parameter ... has
    already been reduced")."""
    only = {int(k): v.split(",") for k, v in (item.split(":") for item in args.only)}
    profiled = {(int(k), v) for k, v in (item.split(":") for item in args.profile)}
    fused = trainer.plan.fused.apply
    for seqlen in args.lengths:
        for mode in [m for m in only.get(seqlen, args.modes) if dense or m != "dense"]:
            is_dense = mode == "dense"
            warmup = args.dense_warmup if is_dense and args.dense_warmup is not None else args.warmup
            steps = args.dense_steps if is_dense and args.dense_steps is not None else args.steps
            try:
                row = run_row(trainer, seqlen, mode, density=args.density, warmup=warmup, steps=steps,
                              accumulation=args.accumulation, profiled=(seqlen, mode) in profiled)  # fmt: skip
            except torch.OutOfMemoryError:
                peak = torch.cuda.max_memory_allocated() / 2**30
                rows.append({"seqlen": seqlen, "mode": mode, "fused": fused, "out_of_memory": True, "peak_gib": peak})
                print(f"{seqlen} {mode}: out of GPU memory ({peak:.1f} GiB allocated); this setting's later rows "
                      "are not run", flush=True)  # fmt: skip
                saved()
                return
            rows.append(row | {"fused": fused})
            print(f"{time.strftime('%H:%M:%S')} {seqlen} {mode}{' fused' if fused else ''}: micro-batch {row['micro']:.2f} s, optimizer {row['optimizer']:.3f} s, "
                  f"peak {row['peak_gib']:.1f} GiB", flush=True)  # fmt: skip
            saved()


def plan_setting(args: argparse.Namespace, scratch: Path, fused: bool | str | None):
    """The benchmark's plan of one ``--fused-kernels`` setting: the config with ``gradient_accumulation_steps`` =
    ``--accumulation`` and ``mtraining.fused_kernels.enabled`` = ``fused`` (``None``: the config's), planned for the
    longest length, no checkpoints."""
    from ds_mtraining.training import TrainSettings, plan

    config = json.loads(Path(args.deepspeed).read_text())
    config["gradient_accumulation_steps"] = args.accumulation
    if fused is not None:
        config.setdefault("mtraining", {})["fused_kernels"] = {"enabled": fused}
    config.pop("train_batch_size", None)
    path = scratch / f"fused-{fused}-{Path(args.deepspeed).name}"
    path.write_text(json.dumps(config))
    rope = {"rope_kind": args.rope_kind, "rope_factor": args.rope_factor} if args.rope_kind else {}
    settings = TrainSettings(deepspeed=str(path), model=args.model, seqlen=max(args.lengths), no_save=True,
                             output_dir=str(scratch / "run"), **rope)  # fmt: skip
    return plan(settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="model_configs/qwen2.5-3b")
    parser.add_argument("--deepspeed", default=str(REPO / "ds_configs" / "zero2_offload.json"))
    parser.add_argument("--rope-kind", default=None)
    parser.add_argument("--rope-factor", type=float, default=16.0)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--only", nargs="*", default=[], help="LENGTH:MODE,MODE rows to restrict a length to")
    parser.add_argument("--accumulation", type=int, default=64, help="micro-batches per optimizer step to report")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up micro-batches per row (the last at a boundary)")
    parser.add_argument(
        "--dense-warmup", type=int, help="warm-up micro-batches of dense rows (default --warmup; cuDNN compiles "
        "nothing, so once an earlier row warmed the engine 0 saves a 100 s micro-batch at 256K)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=1, help="timed micro-batches inside an accumulation per row")
    parser.add_argument(
        "--dense-steps", type=int, help="timed micro-batches inside an accumulation of dense rows (default --steps; 0: "
        "the boundary micro-batch stands for them, which saves a 100 s micro-batch at 256K)",
    )  # fmt: skip
    parser.add_argument(
        "--dense-once", action="store_true", help="dense rows with the first --fused-kernels setting only; the "
        "other settings' rows are compared with them (saves a 100 s micro-batch per setting at 256K)",
    )  # fmt: skip
    parser.add_argument("--density", type=float, default=0.05, help="planted index density")
    parser.add_argument(
        "--fused-kernels", nargs="+", type=lambda v: {"true": True, "false": False}.get(v, v),
        choices=[True, False, "auto"], default=[None],
        help="mtraining.fused_kernels.enabled; several: each in a process of its own, in turn (default: the config's)",
    )  # fmt: skip
    parser.add_argument("--profile", nargs="*", default=[], help="LENGTH:MODE rows to profile one more step of")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.accumulation < 1 or min(args.steps, args.warmup, args.dense_steps or 0, args.dense_warmup or 0) < 0:
        parser.error("--accumulation must be >= 1, the --steps and --warmup counts >= 0")
    from ds_mtraining.notices import quiet_library_notices
    from ds_mtraining.training import describe

    quiet_library_notices()
    rows, banners = [], []

    out = harness.Report(args.out)

    def save() -> None:  # after every row: a run cut short by a time limit keeps the rows it measured
        out.replace(report(args, argv, banners, rows))

    with tempfile.TemporaryDirectory() as scratch:
        plans, seen = [], {}
        for fused in args.fused_kernels:
            p = plan_setting(args, Path(scratch), fused)
            if p.fused.apply in seen:  # the table keys rows by whether the kernels are fused
                parser.error(f"--fused-kernels {seen[p.fused.apply]} and {fused} both mean '{p.fused.note}' here")
            seen[p.fused.apply] = fused
            plans.append(p)
        for i, (fused, p) in enumerate(zip(args.fused_kernels, plans, strict=True)):
            banners.append(describe(p))
            dense = i == 0 or not args.dense_once
            if len(plans) == 1:
                setting_rows(args, p, dense, None, rows, save)
                continue
            # Each setting in a process of its own: a closed engine does not give all of its pinned host memory back
            # (with CPU offload a second 3B engine in the same process did not finish building in 5 minutes).
            out = Path(scratch) / f"rows-{i}.json"
            child = multiprocessing.get_context("spawn").Process(target=setting_rows, args=(args, p, dense, out))
            child.start()
            child.join()
            rows += json.loads(out.read_text()) if out.exists() else []
            save()
            if child.exitcode != 0:
                print(f"--fused-kernels {fused}: the benchmark's process ended with status {child.exitcode}", flush=True)
    print(report(args, argv, banners, rows))
    return 0


def setting_rows(args: argparse.Namespace, p, dense: bool, out: Path | None, rows: list[dict] | None = None,
                 saved=lambda: None) -> None:  # fmt: skip
    """Run the rows of one setting's plan ``p`` (:func:`plan_setting`) into ``rows``, or (a child process) into the
    JSON file ``out`` after every row."""
    from ds_mtraining.notices import quiet_library_notices
    from ds_mtraining.training import Trainer, describe

    quiet_library_notices()
    rows = [] if rows is None else rows

    def save() -> None:
        saved()
        if out is not None:
            out.write_text(json.dumps(rows))

    with Trainer(p, banner=describe(p)) as trainer:
        run_rows(trainer, args, rows, dense=dense, saved=save)
        if out is not None:
            # A child ends as the training job does, without the engine's and the interpreter's teardown: on the
            # H200 one (the second of two, no offload) was still running 60 s after its last row was written.
            from ds_mtraining.training.cli import leave

            leave(0)


def report(args: argparse.Namespace, argv: list[str] | None, banners: list[str], rows: list[dict]) -> str:
    """The markdown report of the rows so far: the header, the banners, what a row measures, the table."""
    dense_warmup = args.warmup if args.dense_warmup is None else args.dense_warmup
    dense_steps = args.steps if args.dense_steps is None else args.dense_steps
    once = " Dense rows ran with the first fused setting only; the other rows are compared with them."
    return (
        "\n".join([*harness.header("Training throughput through the Trainer", __spec__.name, argv), "", ""])
        + "".join(f"```\n{banner}\n```\n\n" for banner in banners)
        + f"Micro-batch = 1 sequence. Per row: {args.warmup} warm-up micro-batch(es) ({dense_warmup} for dense rows), "
        f"{args.steps} timed inside an accumulation ({dense_steps} for dense rows; 0: the boundary micro-batch's "
        "forward + backward stands for them), 1 at the boundary with the optimizer step. Step @1 = boundary "
        f"micro-batch + optimizer; step @{args.accumulation} = {args.accumulation - 1} micro-batches + boundary "
        "micro-batch + optimizer. Sparse: the estimator runs every sparse layer (cost counted), then a planted index "
        f"of density {args.density} is used (random weights have near-uniform attention).{once if args.dense_once else ''}"
        "\n\n" + table(rows, args.accumulation)
    )


if __name__ == "__main__":
    sys.exit(main())
