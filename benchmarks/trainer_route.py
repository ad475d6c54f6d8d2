"""Training throughput of the two routes on the same inputs: the job (``launch/train.py``) against a
``transformers.Trainer`` script (``examples/hf_trainer.py``, ``ds_mtraining.integration.hf_trainer``).

    python -m benchmarks.trainer_route --deepspeed ds_configs/zero2_offload.json --model model_configs/qwen2.5-3b \
        --rope-kind yarn --rope-factor 16 --seqlen 131072 --steps 4 --out FILE

Why: the Trainer route does to a step what the job does (the mesh, the batch layout, the attention handle, the
tiled loss, the activation checkpointing and the memory plan that decides ``"auto"`` of ``keep_attention`` and the
MLP's tile, ``ds_mtraining.memory.plan_memory``), and the example trains on the job's rows; what differs is the loop
around the step (the Trainer's own, Accelerate's engine set-up, its data loader and callbacks). On the same model,
length, steps, seed, DeepSpeed JSON and RoPE stretch the two should train equally fast; this measures whether they
do, and by how much they differ.

One after the other, each in its own subprocess (this interpreter, the repository root as working directory, this
environment) and its own temporary output directory, one process each:

    python launch/train.py --no-save --deepspeed JSON --model M --seqlen N --steps S --seed SEED --output-dir DIR
    python examples/hf_trainer.py --deepspeed JSON --model M --seqlen N --steps S --seed SEED --output-dir DIR

(each with ``--rope-kind`` / ``--rope-factor`` where given). Tokens/s of a route: the steps after the first (which
also compiles kernels and warms the allocator; all of them where only one ran), their tokens over their seconds:
the job's from ``OUTPUT_DIR/metrics.jsonl`` (each step's ``tokens_per_s`` and ``seconds``), the example's from its
``OUTPUT_DIR/throughput.json`` (the same figure, its ``StepClock``). The report: the machine and versions, the
exact commands, a table of route, tokens/s, its ratio to the job's and the steps timed, and the memory plan's lines
each route printed (the same where both decided the same). A run that fails prints its last 40 lines of output and
the benchmark exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parents[1]
ROUTES = (
    ("job", "launch/train.py", ("--no-save",)),
    ("Trainer", "examples/hf_trainer.py", ()),
)
"""(route, script relative to the repository root, the script's own flags)."""
TAIL = 40
"""Lines of a failed run's output shown."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed", default="ds_configs/zero2_offload.json", help="the DeepSpeed JSON of both")
    parser.add_argument("--model", default="tiny-qwen2", help="tiny-qwen2, smollm2-135m, a folder or a config JSON")
    parser.add_argument("--seqlen", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each run (the first is not timed)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument("--rope-kind", choices=["linear", "yarn", "ntk"], help="RoPE scaling past the trained context")
    parser.add_argument("--rope-factor", type=float, default=2.0, help="new context / trained context")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--out", help="the markdown report")
    return parser.parse_args(argv)


def command(script: str, own: tuple[str, ...], args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The command line of one route: ``script`` with its ``own`` flags and the shared ones."""
    shared = ["--deepspeed", args.deepspeed, "--model", args.model, "--seqlen", str(args.seqlen),
              "--steps", str(args.steps), "--seed", str(args.seed), "--output-dir", str(output_dir)]  # fmt: skip
    if args.rope_kind:
        shared += ["--rope-kind", args.rope_kind, "--rope-factor", f"{args.rope_factor:g}"]
    return [sys.executable, script, *own, *shared]


def throughput(route: str, output_dir: Path) -> tuple[float, int]:
    """(tokens/s, steps timed) of a finished run: the steps after the first, their tokens over their seconds."""
    if route == "job":
        records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
        timed = records[1:] or records
        seconds = sum(r["seconds"] for r in timed)
        return sum(r["tokens_per_s"] * r["seconds"] for r in timed) / seconds if seconds else math.nan, len(timed)
    recorded = json.loads((output_dir / "throughput.json").read_text())
    rate = recorded["tokens_per_s"]
    return (math.nan if rate is None else float(rate)), int(recorded["steps_timed"])


def run(route: str, line: list[str], output_dir: Path, timeout: int) -> tuple[float, int, list[str], str | None]:
    """Run one route: (tokens/s, steps timed, its memory plan's lines, ``None``), or on failure ``(nan, 0, [],
    its last lines of output)``."""
    try:
        done = subprocess.run(line, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, check=False)  # fmt: skip
        output, failed = done.stdout, f"exit status {done.returncode}" if done.returncode else None
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        failed = f"no end after {timeout} s"
    rate, timed = math.nan, 0
    if failed is None:
        try:
            rate, timed = throughput(route, output_dir)
        except (OSError, ValueError, KeyError, TypeError) as e:
            failed = f"no throughput recorded ({type(e).__name__}: {e})"
        else:
            if not (math.isfinite(rate) and rate > 0):
                failed = f"tokens/s {rate}"
    if failed is not None:
        tail = "\n".join(output.splitlines()[-TAIL:])
        return math.nan, 0, [], f"{route} run failed ({failed}); its last {TAIL} lines of output:\n{tail}"
    plan = [text for text in output.splitlines() if text.startswith("memory    ")]
    return rate, timed, plan, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = harness.Report(args.out)
    rope = f", RoPE {args.rope_kind} x{args.rope_factor:g}" if args.rope_kind else ""
    report.add(
        *harness.header("Training throughput: the job against the Trainer route", __spec__.name, argv),
        "",
        f"{args.model}{rope}, one sequence of {args.seqlen} tokens a micro-batch, {args.steps} steps, seed "
        f"{args.seed}, {args.deepspeed}; one process each, one after the other; tokens/s over the steps after the "
        "first.",
    )
    results: dict[str, tuple[float, int, list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="trainer_route-") as tmp:
        lines = {route: command(script, own, args, Path(tmp) / route.lower()) for route, script, own in ROUTES}
        # As a reader reruns them: no interpreter path or temporary directory of this machine in the report.
        shown = {route: ["python", *command(script, own, args, Path("DIR") / route.lower())[1:]]
                 for route, script, own in ROUTES}  # fmt: skip
        report.add("", *(f"{route}: `{shlex.join(shown[route])}`" for route, _, _ in ROUTES))
        for route, _, _ in ROUTES:
            rate, timed, plan, failure = run(route, lines[route], Path(tmp) / route.lower(), args.timeout)
            if failure is not None:
                print(failure, file=sys.stderr, flush=True)
                report.add("", f"**{route} run failed**: see the output above; no comparison.")
                return 1
            results[route] = (rate, timed, plan)
    job = results["job"][0]
    report.add(
        "",
        "| route | tokens/s | vs the job | steps timed |",
        "|---|---|---|---|",
        *(f"| {route} | {rate:,.1f} | {rate / job:.3f}x | {timed} |" for route, (rate, timed, _) in results.items()),
    )
    for route, (_, _, plan) in results.items():
        said = "\n".join(f"    {text}" for text in plan) if plan else "    (no line: nothing estimated or decided)"
        report.add("", f"{route} memory plan:", "", said)
    return 0


if __name__ == "__main__":
    sys.exit(main())
