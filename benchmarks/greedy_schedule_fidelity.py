"""The fidelity harness (``launch/eval.py fidelity``) with the spread greedy's round schedule overridden.

The schedule (``estimator.spread.greedy.rounds``: most picks per head in each round, from the column cap) is not a
config knob; this runs the harness with another one to weigh fewer rounds (less GPU time) against index quality:

    python -m benchmarks.greedy_schedule_fidelity 8,32,128,512,1536 fidelity --model smollm2-135m --length 8192 \
        --masked --seed 0 --estimators spread --ds-config ds_configs/zero2.json --device cpu --threads 1 --out OUT

Everything after the schedule is ``launch/eval.py``'s command line; its report (``OUT/fidelity.md``) is the result.
On CPU the greedy runs in PyTorch, on CUDA as the Triton rounds (the same rules). The estimate's CUDA graphs are
cached (by their owner, a ``GraphCache``) without the schedule in their key, which is safe here: the schedule is
replaced before the first estimate and restored when the harness is done.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ds_mtraining.estimator.spread import greedy

EVAL = Path(__file__).resolve().parents[1] / "launch" / "eval.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    try:
        schedule = tuple(int(x) for x in argv[0].split(","))
    except ValueError:
        schedule = ()
    if not schedule or min(schedule) < 1:
        raise SystemExit(f"schedule: comma-separated positive picks per round, e.g. 8,32,128; got {argv[0]!r}")
    print(f"greedy schedule: {schedule}", flush=True)
    harness_main = runpy.run_path(str(EVAL))["main"]
    defaults, command = greedy.spread_select.__defaults__, sys.argv
    # spread_select's default argument is what select() passes on: replace it while the harness runs.
    greedy.spread_select.__defaults__ = (schedule, *defaults[1:])
    # The harness reads its flags from sys.argv and writes `python {sys.argv}` as its report's command: this
    # command, the schedule included.
    sys.argv = [f"-m {__spec__.name} {argv[0]}", *argv[1:]]
    try:
        return harness_main()
    finally:
        greedy.spread_select.__defaults__, sys.argv = defaults, command


if __name__ == "__main__":
    sys.exit(main())
