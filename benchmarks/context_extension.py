"""Context extension, dense against sparse: the same model, tokens, seed and schedule trained twice by the main job.

Runs ``launch/train.py`` once with ``--sparse-config`` (dynamic vertical-slash attention) and once with
``--dense-config`` (every layer dense), both with the given RoPE stretch, data, held-out rows and steps, and
``--lr`` as the peak learning rate of both (the configs' own optimizer and scheduler otherwise), each into
``WORK/<run>``. Then exports each final checkpoint to a Hugging Face folder (``WORK/<run>/hf``, ready for
``launch/eval.py --model``) and writes the report to ``--out`` (per-run tokens/s, final training and held-out loss,
the sparse/dense gaps) and its plot beside it (``.png``: training and held-out loss of both runs against tokens).

The dense run is the reference: the target is a sparse held-out loss within 2 % of it at equal tokens, and a
faster sparse run. ``--runs`` picks the runs to train now (a run whose ``hf`` folder exists is kept, so two
calls can train one each); the report covers the runs found in ``WORK``. Exit 1 when a run fails.

    python -m benchmarks.context_extension --model M --data D/train --heldout D/heldout --seqlen 32768 \
        --steps 134 --rope-kind yarn --rope-factor 4 --lr 1e-4 --heldout-every 10 --work WORK --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parent.parent
RUNS = ("dense", "sparse")
FIRST_STEPS_LEFT_OUT = 2  # compilation and autotuning land in the first steps; tokens/s is over the rest


def with_peak_lr(config: dict, lr: float) -> dict:
    """``config`` with its optimizer's and WarmupDecayLR's peak set to ``lr`` (warm-up starts at ``lr / 10``)."""
    config = json.loads(json.dumps(config))
    config["optimizer"]["params"]["lr"] = lr
    scheduler = config.get("scheduler", {}).get("params")
    if scheduler is not None:
        scheduler["warmup_max_lr"], scheduler["warmup_min_lr"] = lr, lr / 10
    return config


def train(name: str, config_path: Path, args: argparse.Namespace) -> None:
    """One run of the main job into ``WORK/name`` (its ``metrics.jsonl``, checkpoints and log)."""
    out = args.work / name
    config = with_peak_lr(json.loads(config_path.read_text()), args.lr)
    (args.work / f"{name}.json").write_text(json.dumps(config, indent=2) + "\n")
    command = [
        sys.executable, str(REPO / "launch" / "train.py"), "--deepspeed", str(args.work / f"{name}.json"),
        "--model", args.model, "--data", str(args.data), "--heldout", str(args.heldout),
        "--heldout-rows", str(args.heldout_rows), "--heldout-every", str(args.heldout_every),
        "--seqlen", str(args.seqlen), "--steps", str(args.steps), "--seed", str(args.seed), "--output-dir", str(out),
        *(["--rope-kind", args.rope_kind, "--rope-factor", str(args.rope_factor)] if args.rope_kind else []),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    t0 = time.time()
    with open(args.work / f"{name}.log", "w") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"{name}: train.py exited {done.returncode}; see {args.work / f'{name}.log'}")
    print(f"{name}: {args.steps} steps in {time.time() - t0:.0f} s", flush=True)


def export(name: str, args: argparse.Namespace) -> None:
    """``WORK/name/hf``: the run's last checkpoint as a Hugging Face folder."""
    command = [
        sys.executable, str(REPO / "launch" / "export.py"), "--checkpoint", str(args.work / name / "checkpoints"),
        "--model", args.model, "--out", str(args.work / name / "hf"),
        *(["--rope-kind", args.rope_kind, "--rope-factor", str(args.rope_factor)] if args.rope_kind else []),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, text=True, capture_output=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{name}: export.py exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def summary(records: dict[str, list[dict]], args: argparse.Namespace) -> list[str]:
    """The markdown table of both runs (the dense run is the reference of the ratios)."""

    def final(rows: list[dict], key: str, last: int) -> float:
        values = [r[key] for r in rows if r.get(key) is not None][-last:]
        return sum(values) / len(values)

    speed = {
        name: sum(r["tokens_per_s"] for r in rows[FIRST_STEPS_LEFT_OUT:]) / len(rows[FIRST_STEPS_LEFT_OUT:])
        for name, rows in records.items()
    }
    train_loss = {name: final(rows, "loss", 10) for name, rows in records.items()}
    heldout = {name: final(rows, "heldout_loss", 1) for name, rows in records.items()}
    tokens = args.steps * args.seqlen
    lines = [
        (
            f"model {args.model}, {args.seqlen} tokens per row, {args.steps} steps ({tokens:,} tokens), "
            f"peak lr {args.lr}, RoPE {args.rope_kind or 'as trained'} x{args.rope_factor}, seed {args.seed}; "
            f"held-out: the first {args.heldout_rows} rows of {args.heldout}"
        ),
        "",
        "| run | tokens/s | vs dense | training loss (mean of last 10 steps) | held-out loss (end) | gap to dense |",
        "|---|---|---|---|---|---|",
    ]
    for name in records:
        # One run alone (``--runs sparse``) has nothing to compare with: its cells say so instead of "nan".
        ratio, gap = "-", "-"
        if "dense" in records:
            ratio = f"{speed[name] / speed['dense']:.2f}x"
            gap = f"{(heldout[name] - heldout['dense']) / heldout['dense']:+.2%}"
        lines.append(
            f"| {name} | {speed[name]:,.0f} | {ratio} | {train_loss[name]:.4f} | {heldout[name]:.4f} | {gap} |"
        )
    lines += ["", f"tokens/s: mean over steps {FIRST_STEPS_LEFT_OUT + 1}-{args.steps} (compilation excluded)"]
    return lines


def plot(records: dict[str, list[dict]], args: argparse.Namespace, path: Path) -> None:
    """Training and held-out loss of both runs against tokens seen, on one figure, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, color in zip(RUNS, ("tab:blue", "tab:orange")):
        rows = records.get(name, [])
        ax.plot([r["step"] * args.seqlen / 1e6 for r in rows], [r["loss"] for r in rows], color=color, alpha=0.35,
                lw=1, label=f"{name}: training")  # fmt: skip
        held = [r for r in rows if r.get("heldout_loss") is not None]
        ax.plot([r["step"] * args.seqlen / 1e6 for r in held], [r["heldout_loss"] for r in held], color=color,
                marker="o", lw=2, label=f"{name}: held-out")  # fmt: skip
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("loss")
    ax.set_title(f"{Path(args.model).name}: context extension to {args.seqlen // 1024}K, dense vs sparse attention")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="launch/train.py's --model (a pretrained one)")
    parser.add_argument("--data", type=Path, required=True, help="packed training rows (prepare_data.py OUT/train)")
    parser.add_argument("--heldout", type=Path, required=True, help="packed held-out rows (OUT/heldout)")
    parser.add_argument("--heldout-rows", type=int, default=4)
    parser.add_argument("--heldout-every", type=int, default=10)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rope-kind", choices=["linear", "yarn", "ntk"])
    parser.add_argument("--rope-factor", type=float, default=4.0)
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of both runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sparse-config", type=Path, default=REPO / "ds_configs" / "zero2_offload.json")
    parser.add_argument("--dense-config", type=Path, default=REPO / "ds_configs" / "dense_baseline.json")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="the runs to train now")
    parser.add_argument("--work", type=Path, required=True, help="folder of the runs, their logs and exports")
    parser.add_argument("--out", type=Path, help="the report (default: WORK/context_extension.md); its plot beside it")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or args.work / "context_extension.md"

    configs = {"dense": args.dense_config, "sparse": args.sparse_config}
    for name in args.runs:
        if (args.work / name / "hf").is_dir():
            print(f"{name}: {args.work / name / 'hf'} exists, kept", flush=True)
            continue
        train(name, configs[name], args)
        export(name, args)
    records = {
        name: [json.loads(line) for line in (args.work / name / "metrics.jsonl").read_text().splitlines()]
        for name in RUNS
        if (args.work / name / "hf").is_dir()
    }
    title = "Context extension, dense against sparse attention"
    harness.Report(out).add(*harness.header(title, __spec__.name, argv), "", *summary(records, args))
    plot(records, args, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
