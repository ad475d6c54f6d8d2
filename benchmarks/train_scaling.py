"""Training throughput of the main job on 1 GPU vs W GPUs (sequence parallel ring), sparse vs dense.

    python -m benchmarks.train_scaling --gpus 2 --seqlen 65536 --steps 6 --out FILE

For each attention (sparse = ``ds_configs/zero2.json``'s settings, dense = the same with ``pattern: "dense"``) and
each GPU count G in {1, W}: a DeepSpeed config derived from ``ds_configs/zero2.json`` (bf16 as the hardware allows,
PyTorch's AdamW so nothing is JIT-compiled, ``sequence_parallel_size = ring_degree = G``, striped layout), then

    torchrun --nproc_per_node G launch/train.py --deepspeed CFG --seqlen N --steps S --output-dir DIR

(the default ``tiny-qwen2`` model and data). Throughput: the mean ``tokens_per_s`` of ``metrics.jsonl`` over the
steps after the first two (Triton compilation, allocator warm-up). One sequence is split over the G GPUs
(strong scaling), so the scaling efficiency is tokens/s at W / (W x tokens/s at 1). Without a GPU the processes
run on CPU (gloo), as ``launch/train.py`` does: a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import harness

REPO = Path(__file__).resolve().parent.parent


def _config(gpus: int, dense: bool, directory: Path) -> Path:
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["optimizer"]["params"]["torch_adam"] = True
    config["mtraining"]["parallel"] = {
        "sequence_parallel_size": gpus,
        "ulysses_degree": 1,
        "ring_degree": gpus,
        "layout": "striped",
    }
    if dense:
        config["mtraining"]["sparse_attention"]["pattern"] = "dense"
    path = directory / f"{'dense' if dense else 'sparse'}_{gpus}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def _run(gpus: int, dense: bool, args: argparse.Namespace, directory: Path) -> tuple[float, float, str]:
    """Mean tokens/s after warm-up, the final loss, and the log's tail if the run failed."""
    out = directory / f"{'dense' if dense else 'sparse'}_{gpus}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(gpus),
        str(REPO / "launch" / "train.py"),
        "--deepspeed",
        str(_config(gpus, dense, directory)),
        "--seqlen",
        str(args.seqlen),
        "--steps",
        str(args.steps),
        "--output-dir",
        str(out),
    ]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=args.timeout)
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    timed = records[2:] or records[-1:]
    if not timed:
        return float("nan"), float("nan"), (done.stdout + done.stderr)[-3000:]
    tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
    return tps, records[-1]["loss"], "" if done.returncode == 0 else (done.stdout + done.stderr)[-1500:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="W: the GPU count compared with 1")
    parser.add_argument("--seqlen", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per training run")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus} needs that many CUDA devices; this machine has {torch.cuda.device_count()}")
    report = harness.Report(args.out)
    report.add(
        *harness.header(f"Training throughput, 1 vs {args.gpus} GPUs", __spec__.name, argv, count=args.gpus),
        "",
        (
            f"tiny-qwen2 (4 layers, hidden 256, 4 heads of 64, 2 KV heads), one sequence of {args.seqlen} tokens "
            f"per step, {args.steps} steps, tokens/s averaged over steps 3-{args.steps}; zero2.json, torch AdamW."
        ),
        "",
        "| attention | GPUs | tokens/s | speed-up vs 1 GPU | scaling efficiency | final loss |",
        "|---|---|---|---|---|---|",
    )
    failures = []
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dense in (False, True):
            for gpus in (1, args.gpus):
                tps, loss, log = _run(gpus, dense, args, Path(tmp))
                results[dense, gpus] = tps
                base = results[dense, 1]
                name = "dense" if dense else "sparse"
                report.add(
                    f"| {name} | {gpus} | {tps:,.0f} | {tps / base:.2f}x | {tps / (gpus * base):.1%} | {loss:.3f} |"
                )
                if log:
                    failures.append(f"{name}, {gpus} GPU(s):\n```\n{log}\n```")
    for gpus in (1, args.gpus):
        report.add(f"\nsparse / dense tokens/s at {gpus} GPU(s): {results[False, gpus] / results[True, gpus]:.2f}x")
    if failures:
        report.add("", "## Runs that exited with an error", "", *failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
