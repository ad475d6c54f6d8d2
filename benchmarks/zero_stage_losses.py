"""One rank, ZeRO-2 against ZeRO-3: the main job's losses and gradient norms step by step, printed as a table.

Runs ``launch/train.py`` once per ZeRO variant on the same model, data, seed and sparse settings (the given
DeepSpeed config with only ``zero_optimization`` replaced) and compares every step's loss and gradient norm
with the first variant's. Step 1 runs the same weights through the same kernels, so its loss must agree to
bf16 rounding of the reductions; later steps may drift by the optimizer's different reduction order.
Pass: step-1 loss within 1e-3 relative, every step's loss within 1e-2 and gradient norm within 5e-2 (a
gradient scaled by the SP degree or left unreduced moves the norm by 2x, and through clipping the losses).
Exit 1 on failure.

    python -m benchmarks.zero_stage_losses --model M --seqlen N --steps S [--deepspeed CONFIG] --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parent.parent
CPU = {"device": "cpu", "pin_memory": True}
VARIANTS = {
    "ZeRO-2, optimizer offload": {"stage": 2, "offload_optimizer": CPU, "contiguous_gradients": True},
    "ZeRO-3, optimizer offload": {"stage": 3, "offload_optimizer": CPU},
    "ZeRO-3, optimizer + parameter offload": {"stage": 3, "offload_optimizer": CPU, "offload_param": CPU},
}
LIMITS = {"first_loss": 1e-3, "loss": 1e-2, "grad_norm": 5e-2}


def run(name: str, zero: dict, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Train one variant; returns its ``metrics.jsonl`` records."""
    config = json.loads(Path(args.deepspeed).read_text())
    config["zero_optimization"] = zero
    path = tmp / f"{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(config))
    out = tmp / path.stem
    argv = ["--model", args.model, "--seqlen", str(args.seqlen), "--steps", str(args.steps), "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, str(REPO / "launch" / "train.py"), "--deepspeed", str(path), *argv]
    done = subprocess.run(
        [*command, "--no-save", "--output-dir", str(out)],
        check=False,
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
    )
    if done.returncode != 0:
        sys.exit(f"{name}: train.py exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--deepspeed", default=str(REPO / "ds_configs" / "zero2_offload.json"))
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        records = {name: run(name, zero, args, Path(tmp)) for name, zero in VARIANTS.items()}
    base_name, base = next(iter(records.items()))
    report = harness.Report(args.out)
    report.add(
        *harness.header("ZeRO-2 against ZeRO-3: losses and gradient norms", __spec__.name, argv),
        "",
        f"model {args.model}, seqlen {args.seqlen}, {args.steps} steps, config {Path(args.deepspeed).name} "
        f"with zero_optimization replaced; baseline: {base_name}",
        "",
        "| variant | step | loss | rel. diff | grad norm | rel. diff | s/step |",
        "|---|---|---|---|---|---|---|",
    )
    failed = []
    for name, rows in records.items():
        if len(rows) != len(base):
            failed.append(f"{name}: {len(rows)} steps, baseline {len(base)}")
        for row, ref in zip(rows, base):
            loss = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
            norm = abs(row["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
            limit = LIMITS["first_loss"] if row["step"] == 1 else LIMITS["loss"]
            if loss > limit or norm > LIMITS["grad_norm"]:
                failed.append(f"{name} step {row['step']}: loss {loss:.2e} (limit {limit}), grad norm {norm:.2e}")
            report.add(
                f"| {name} | {row['step']} | {row['loss']:.5f} | {loss:.1e} | {row['grad_norm']:.4f} | {norm:.1e} "
                f"| {row['seconds']:.2f} |"
            )
    if base[-1]["loss"] >= base[0]["loss"]:
        failed.append(f"{base_name} does not train: loss {base[0]['loss']:.4f} -> {base[-1]['loss']:.4f}")
    report.add(
        "", "FAIL: " + "; ".join(failed) if failed else "PASS: " + ", ".join(f"{k} {v}" for k, v in LIMITS.items())
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
